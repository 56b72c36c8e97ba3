"""The static count of issue 44 over kvformat/: how far each layer reaches past another's face.

    python tools/house_count.py            # one JSON line of totals
    python tools/house_count.py --list     # every offending place, then the totals

Counted from the source text and its AST, nothing imported or run:
- ``private_imports``: an import of another package's private module (``from kvformat.cache._jobs import``
  in kvformat/vllm/), one per imported module per statement; a package importing its own private modules is
  not counted, nor are imports of a package's face (``kvformat.cache``) or of ``kvformat.errors``.
- ``long_functions``: functions (and methods) whose ``def`` to last line spans more than 80 lines.
- ``localstore_type_tests``: ``isinstance(.., LocalStore)`` / ``type(..) is LocalStore`` outside storage/.
- ``url_checks``: the string literal ``"://"`` outside storage/.
- ``private_store_calls``: ``<name ending in store>._attr`` outside storage/.
- ``format_imports_torch``: modules in format/ that import kvformat.torch.
- ``long_modules``: modules over 450 lines.
- ``import_cycles``: 1 if the module graph has a loop (the loop is printed to stderr), else 0.
"""

from __future__ import annotations

import argparse
import ast
import graphlib
import json
import re
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "kvformat"
MAX_FUNC = 80
MAX_MODULE = 450


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_of(mod: str) -> str:
    """The top package under kvformat a module belongs to (``kvformat.cache`` for kvformat.cache._jobs)."""
    parts = mod.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else mod


def _imported(node: ast.AST, mod: str, is_pkg: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = mod.split(".") if is_pkg else mod.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        if node.module is None:  # `from . import _native`: the modules named, not the package's face
            return [f"{target}.{a.name}" for a in node.names]
        out = [target]
        # `from kvformat.cache import _jobs` names a private module too.
        out += [f"{target}.{a.name}" for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
        return out
    return []


def _is_private_module(name: str) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in name.split(".")[1:])


def count(list_places: bool = False) -> dict[str, object]:
    places: dict[str, list[str]] = {k: [] for k in (
        "private_imports", "long_functions", "localstore_type_tests", "url_checks",
        "private_store_calls", "format_imports_torch", "long_modules")}
    store_private = re.compile(r"\b\w*store\._[a-z]\w*", re.IGNORECASE)
    for path in sorted(PKG.rglob("*.py")):
        mod = _module_name(path)
        is_pkg = path.name == "__init__.py"
        text = path.read_text()
        tree = ast.parse(text, str(path))
        rel = str(path.relative_to(PKG.parent))
        own = _package_of(mod)
        in_storage = own == "kvformat.storage"
        if text.count("\n") + 1 > MAX_MODULE:
            places["long_modules"].append(f"{rel} {text.count(chr(10)) + 1}")
        for node in ast.walk(tree):
            for target in _imported(node, mod, is_pkg):
                if not target.startswith("kvformat."):
                    continue
                if own == "kvformat.format" and target.startswith("kvformat.torch"):
                    places["format_imports_torch"].append(f"{rel}:{getattr(node, 'lineno', 0)}")
                if _package_of(target) != own and _is_private_module(target):
                    places["private_imports"].append(f"{rel}:{getattr(node, 'lineno', 0)} {target}")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                span = (node.end_lineno or node.lineno) - node.lineno + 1
                if span > MAX_FUNC:
                    places["long_functions"].append(f"{rel}:{node.lineno} {node.name} {span}")
            if in_storage:
                continue
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
                if "LocalStore" in ast.unparse(node.args[1]) if len(node.args) > 1 else False:
                    places["localstore_type_tests"].append(f"{rel}:{node.lineno}")
            if isinstance(node, ast.Compare) and any(isinstance(o, (ast.Is, ast.IsNot)) for o in node.ops):
                src = ast.unparse(node)
                if "type(" in src and "LocalStore" in src:
                    places["localstore_type_tests"].append(f"{rel}:{node.lineno}")
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "://" in node.value:
                if node.value.strip() == "://" or node.value.endswith("://") and len(node.value) <= 3:
                    places["url_checks"].append(f"{rel}:{node.lineno}")
        if not in_storage:
            for i, line in enumerate(text.splitlines(), 1):
                code = line.split("#", 1)[0]
                for m in store_private.finditer(code):
                    places["private_store_calls"].append(f"{rel}:{i} {m.group(0)}")
    totals: dict[str, object] = {k: len(v) for k, v in places.items()}
    totals["import_cycles"] = _cycles()
    if list_places:
        for k, v in places.items():
            for p in v:
                print(f"{k}\t{p}")
    return totals


def _cycles() -> int:
    """Import cycles in the kvformat module graph: 0, or 1 with the first loop found (graphlib names one)."""
    mods: dict[str, Path] = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        is_pkg = p.name == "__init__.py"
        for node in ast.walk(ast.parse(p.read_text())):
            for t in _imported(node, m, is_pkg):
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != m:
                    graph[m].add(t)
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        print("import cycle:", " -> ".join(e.args[1]), file=sys.stderr)
        return 1
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="print every counted place before the totals")
    args = ap.parse_args()
    print(json.dumps(count(args.list)))


if __name__ == "__main__":
    main()
