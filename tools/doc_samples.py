"""The sample sessions of the docs, reproduced: ``python tools/doc_samples.py NAME`` builds the sample's trees in a
scratch directory, runs its commands there and prints the session (``$ command`` lines and their output).

The docs' blocks marked ``<!-- snippet: sample NAME -->`` are this output, with ``…`` where a line holds
something that changes from run to run (times, speeds) or is too long to show, and ``...`` for elided lines;
``tests/test_docs.py`` runs every sample and checks the block still matches. To refresh a block after a change
of output, run this and paste.

The trees are vLLM fs-tier caches written by ``tests/legacy_trees.py`` (byte for byte vLLM's naming and rows,
checked against vLLM's own FileMapper in tests/test_compact_vllm.py): a DeepSeek-V2-Lite-shaped model (27
layers, 16-token blocks, 576 bf16), 20 files written at TP=8 with one slot per worker and 10 with vLLM's
replicated (single-slot) rows, their mtimes one minute apart from 2025-12-02 07:20:00Z.
"""

from __future__ import annotations

import argparse
import calendar
import os
import shlex
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

from legacy_trees import block_hash, build  # noqa: E402

T0 = calendar.timegm((2025, 12, 2, 7, 20, 0))
N_LAYERS, PER_WORKER, REPLICATED = 27, 20, 10


def _fixture(d: str) -> dict[str, str]:
    src = os.path.join(d, "vllm-cache")
    a = build(src, n_files=PER_WORKER, n_layers=N_LAYERS, tp=8)
    b = build(src, n_files=REPLICATED, n_layers=N_LAYERS, tp=1, replicated=True, salt="rep")
    for t in (a, b):
        for i, path in enumerate(t.paths.values()):  # in the order written: file i of each tree at minute i
            os.utime(path, (T0 + 60 * i, T0 + 60 * i))
    h = block_hash(0)
    return {"legacy_file": os.path.relpath(a.paths[h], d), "hash": h}


def _kvf_path(d: str, h: str) -> str:
    for dp, _, fn in os.walk(os.path.join(d, "kv-cache")):
        for f in fn:
            if f == f"{h}.kvf":
                return os.path.relpath(os.path.join(dp, f), d)
    raise FileNotFoundError(h)


def _run(d: str, args: list[str], comment: str = "") -> str:
    r = subprocess.run([sys.executable, "-m", "kvformat.cli", *args], cwd=d, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
    line = "$ kvformat " + " ".join(shlex.quote(a) for a in args) + (f"   # {comment}" if comment else "")
    return line + "\n" + r.stdout + r.stderr


def session(name: str, d: str) -> str:
    """The session ``name`` run in the empty directory ``d``."""
    fx = _fixture(d)
    if name == "inspect-file":
        _run(d, ["compact", "vllm-cache", "kv-cache"])
        return (_run(d, ["inspect", _kvf_path(d, fx["hash"])])
                + "\n" + _run(d, ["inspect", fx["legacy_file"]], "a legacy file"))
    if name == "inspect-roots":
        return "\n".join(_run(d, a) for a in (["inspect", "vllm-cache"], ["compact", "vllm-cache", "kv-cache"],
                                              ["inspect", "kv-cache"]))
    raise SystemExit(f"doc_samples: unknown sample {name!r} (known: {', '.join(NAMES)})")


NAMES = ("inspect-file", "inspect-roots")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("name", choices=NAMES)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        sys.stdout.write(session(a.name, d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
