"""The package tree's layering, read from the imports (issue 22): each folder is one layer, imports only run
down the layers, no two modules import each other (directly or round a loop), and engines are imported
only by their adapters.

Every import statement counts, wherever it is (module level, inside a function, under ``TYPE_CHECKING``):
a lazy import is still a dependency, and a type-only one still ties the two modules' edits together.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "kvformat"

# Lowest first. A module may import modules of its own folder and of any lower layer; two folders on one
# layer (cache, staging, legacy; vllm, sglang) never import each other. kvformat.torch is the format's
# framework binding (safetensors' torch.py), so it shares the format's layer.
LAYERS: list[tuple[str, ...]] = [
    ("kvformat._version", "kvformat.errors"),
    ("kvformat.format", "kvformat.torch"),
    ("kvformat.layout",),
    ("kvformat.storage",),
    ("kvformat.cache", "kvformat.staging", "kvformat.legacy"),
    ("kvformat.admin",),
    ("kvformat.vllm", "kvformat.sglang"),
    ("kvformat.cli",),
    ("kvformat.testing",),
]
# The one group of two folders (kvformat.torch binds the format's buffers to tensors; format never imports it).
SAME_GROUP = {"kvformat.format": "format", "kvformat.torch": "format"}
# Third-party engines and frameworks: only these folders may import them.
CONFINED = {"vllm": ("kvformat.vllm",), "sglang": ("kvformat.sglang",)}


def _modules() -> dict[str, Path]:
    mods = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = p
    return mods


MODULES = _modules()


def _is_pkg(mod: str) -> bool:
    return MODULES[mod].name == "__init__.py"


def _imports(mod: str, text: str | None = None) -> list[tuple[str, int]]:
    """(imported kvformat module or third-party name, line) for every import statement of ``mod``."""
    tree = ast.parse(MODULES[mod].read_text() if text is None else text, mod)
    base = mod if _is_pkg(mod) else mod.rpartition(".")[0]
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                target = ".".join(parts[: len(parts) - (node.level - 1)])
                target = f"{target}.{node.module}" if node.module else target
            else:
                target = node.module or ""
            for a in node.names:  # `from pkg import sub` imports the submodule when there is one
                sub = f"{target}.{a.name}"
                out.append((sub if sub in MODULES else target, node.lineno))
    return out


def _internal(name: str) -> str | None:
    """The kvformat module an imported name refers to (its longest known prefix), or None if not ours."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        cand = ".".join(parts[:i])
        if cand in MODULES:
            return cand
    return None


def _layer(mod: str) -> tuple[int, str]:
    for rank, folders in enumerate(LAYERS):
        for f in folders:
            if mod == f or mod.startswith(f + "."):
                return rank, f
    raise AssertionError(f"{mod} is in no layer of LAYERS: give its folder a place in the tree")


def _graph(texts: dict[str, str] | None = None) -> dict[str, set[str]]:
    g: dict[str, set[str]] = {m: set() for m in MODULES}
    for m in MODULES:
        for name, _ in _imports(m, (texts or {}).get(m)):
            t = _internal(name)
            if t is not None and t != m:
                g[m].add(t)
    return g


def test_every_module_has_a_layer_and_the_root_is_only_a_face() -> None:
    for m in MODULES:
        if m != "kvformat":
            _layer(m)
    imported_by_root = {_internal(n) for n, _ in _imports("kvformat")}
    # kvformat.torch: the file API that takes or gives tensors (format/ takes buffers only), imported on first use.
    assert imported_by_root <= {"kvformat.format", "kvformat.torch", "kvformat.errors", "kvformat._version"}, \
        imported_by_root


def _upward(texts: dict[str, str] | None = None) -> list[str]:
    bad = []
    for m in MODULES:
        if m == "kvformat":
            continue
        rank, folder = _layer(m)
        for name, line in _imports(m, (texts or {}).get(m)):
            t = _internal(name)
            if t is None or t == m:
                continue
            if t == "kvformat":
                bad.append(f"{m}:{line} imports the root package (import the module that holds the name)")
                continue
            trank, tfolder = _layer(t)
            same = tfolder == folder or SAME_GROUP.get(tfolder, tfolder) == SAME_GROUP.get(folder, folder)
            if trank > rank or (trank == rank and not same):
                bad.append(f"{m}:{line} imports {t} (layer {trank} {tfolder}) from layer {rank} {folder}")
    return bad


def test_imports_run_only_down_the_layers() -> None:
    bad = _upward()
    assert not bad, "\n".join(bad)


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    sccs: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components (the tree is small: recursion is fine)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return sccs


def test_no_import_cycles() -> None:
    sccs = _cycles(_graph())
    assert not sccs, f"import cycles: {sccs}"


@pytest.mark.parametrize("engine", sorted(CONFINED))
def test_engines_are_imported_only_by_their_adapters(engine: str) -> None:
    bad = [f"{m}:{line}" for m in MODULES for name, line in _imports(m)
           if name.split(".")[0] == engine and not any(m == a or m.startswith(a + ".") for a in CONFINED[engine])]
    assert not bad, f"{engine} imported outside its adapter: {bad}"


def test_the_checks_see_a_cycle_and_an_upward_import() -> None:
    """The walk itself: the same checks over the real tree with two modules' sources replaced by a loop that
    also runs upward (format -> cache -> format) report both, so a passing run above means something."""
    texts = {"kvformat.format._paths": "from ..cache import _lru\n", "kvformat.cache._lru": "from ..format import _paths\n"}
    assert any("kvformat.format._paths:1 imports kvformat.cache._lru" in b for b in _upward(texts))
    assert any({"kvformat.format._paths", "kvformat.cache._lru"} <= set(c) for c in _cycles(_graph(texts)))


def test_format_takes_buffers_only() -> None:
    """format/ never imports its torch binding: tensors become buffers in kvformat.torch and its callers."""
    bad = [f"{m}:{line}" for m in MODULES if m == "kvformat.format" or m.startswith("kvformat.format.")
           for name, line in _imports(m) if _internal(name) == "kvformat.torch"]
    assert not bad, f"format/ imports kvformat.torch: {bad}"


def test_layers_talk_through_their_faces() -> None:
    """Issue 44's static count (tools/house_count.py) stays where the change left it: other packages are reached
    through their faces only (the two imports of kvformat._version from format/ are the named exceptions, in
    docs/DEVELOPING.md), no function over 80 lines, no module over 450, Store the only I/O seam."""
    out = subprocess.run([sys.executable, str(PKG.parent / "tools" / "house_count.py"), "--list"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    counts = json.loads(out[-1])
    private = [line for line in out[:-1] if line.startswith("private_imports\t")]
    assert all(line.endswith(" kvformat._version") for line in private) and len(private) <= 2, private
    others = {k: v for k, v in counts.items() if k != "private_imports" and v}
    assert not others, (others, [line for line in out[:-1] if not line.startswith("private_imports\t")])


def test_the_buffer_api_does_not_import_torch() -> None:
    """``kvformat``'s file API given buffers never imports torch (its import costs seconds and ~1 GB of address
    space: tools/fuzz.py's memory cap turned it into a MemoryError); a tensor brings it in."""
    code = ("import sys, kvformat as K\n"
            "K.read_into, K.save_file, K.encode, K.decode, K.open_block\n"
            "assert 'torch' not in sys.modules, 'imported by the buffer API'\n"
            "import torch\n"
            "assert K.torch.as_buffer(torch.zeros(2)).nbytes == 8\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
