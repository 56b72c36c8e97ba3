"""Writer (TP, PP, DCP) x reader (TP, PP, DCP): one canonical file per chunk, whatever the parallel layout.

Each writer layout stores the same chunks (the same model KV: a function of seed, layer, logical block and
token) through vLLM's REAL ``TieringOffloadingManager`` with ``KVFormatTier`` (tests/vllm_parallel.py:
vLLM's own planning of every worker's KV-cache config, vLLM's own PP partition and DCP token mapping) into
its own root; every reader layout then loads every chunk from that root into an emptied primary tier, and
every reader worker's layers (its stage's layers, its DCP rank's tokens, read through vLLM's own layer
views) are compared byte for byte with what that worker must hold.

A cell prints ``hit`` when every chunk was a HIT and every worker of the reader held exactly its part;
``MISS`` / ``WRONG`` otherwise. Per writer: files, bytes on disk per chunk, and that number minus the
canonical payload (the header). DCP layouts use a GPU block of ``logical / dcp`` tokens, so every layout
hashes the same ``--logical``-token blocks (vLLM hashes a DCP deployment's blocks at block_size x dcp).

    python tools/parallel_matrix.py [--family deepseek-v3-bf16] [--layers 7] [--chunks 3] [--bpc 2]
        [--logical 64] [--interleave 1] [--layouts TP8,TP4,TP1,PP2xTP4,PP4xTP2,DCP2xTP4,DCP2xTP8,PCP2xTP4]
        [--platform cuda] [--oracle]

``--platform`` is the platform the played workers run on (this machine's vLLM reports none): it decides the
pages' FP8 flavour and the DSA indexer's order. vLLM's own writers produce every page wherever they run here
(tests/vllm_writers.py: the DSA families), so the default and ``--oracle`` (which requires them) give one
verdict; other families keep kvformat's model of a page. E.g. the DSA + DCP matrix on ROCm's shuffled indexer:

    python tools/parallel_matrix.py --family glm-5-fp8 --oracle --platform rocm --layers 2 --chunks 1 --bpc 1 \
        --interleave 8 --layouts TP1,DCP2xTP2,DCP4xTP4,PP2xDCP2xTP2

Exit status 0 only if every cell is ``hit`` and every writer's bytes per chunk equal payload + header.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_harness import kvformat_tier, make_keys  # noqa: E402
from vllm_parallel import ParallelDeployment  # noqa: E402

DEFAULT_LAYOUTS = "TP8,TP4,TP1,PP2xTP4,PP4xTP2,DCP2xTP4,DCP2xTP8,PCP2xTP4"


def parse_layout(s: str) -> tuple[int, int, int, int]:
    """``PP2xDCP2xTP4`` -> (tp, pp, dcp, pcp)."""
    parts = dict.fromkeys(("TP", "PP", "DCP", "PCP"), 1)
    for p in s.upper().split("X"):
        m = re.fullmatch(r"(TP|PP|DCP|PCP)(\d+)", p)
        if m is None:
            raise SystemExit(f"bad layout {s!r} (e.g. TP8, PP2xTP4, DCP2xTP8, PCP2xTP4)")
        parts[m.group(1)] = int(m.group(2))
    return parts["TP"], parts["PP"], parts["DCP"], parts["PCP"]


def deploy(layout: str, root: str, a: argparse.Namespace) -> ParallelDeployment:
    tp, pp, dcp, pcp = parse_layout(layout)
    return ParallelDeployment(a.family, [kvformat_tier(root)], tp=tp, pp=pp, dcp=dcp, pcp=pcp,
                              block_size=a.logical // dcp, bpc=a.bpc, n_layers=a.layers, interleave=a.interleave,
                              num_chunks=2 * a.chunks + 2, oracle=True if a.oracle else None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="deepseek-v3-bf16", help="a family of tests/vllm_models.py")
    ap.add_argument("--layers", type=int, default=7, help="decoder layers (7: vLLM partitions PP4 unevenly)")
    ap.add_argument("--chunks", type=int, default=3)
    ap.add_argument("--bpc", type=int, default=2, help="blocks per chunk")
    ap.add_argument("--logical", type=int, default=64, help="tokens per logical (hashed) block")
    ap.add_argument("--interleave", type=int, default=1, help="vLLM's cp_kv_cache_interleave_size")
    ap.add_argument("--layouts", default=DEFAULT_LAYOUTS)
    ap.add_argument("--platform", default="cuda", help="the workers' platform (kvformat.layout.PLATFORMS)")
    # One page model: vLLM's own writers wherever they run here (the DSA families), kvformat's model of a
    # page only where they do not (its DSA indexer pages disagreed with vLLM's: issue 32).
    ap.add_argument("--oracle", action="store_true", help="require vLLM's own writers (fail where they do not run)")
    a = ap.parse_args(argv)
    import kvformat.vllm._facts as facts

    facts.vllm_platform = lambda: a.platform  # type: ignore[assignment]  # the played workers' platform
    quiet, level = logging.getLogger("vllm"), logging.getLogger("vllm").level
    quiet.setLevel(logging.ERROR)  # restored on return: tests run this in-process
    layouts = [s.strip() for s in a.layouts.split(",") if s.strip()]
    keys = make_keys(a.chunks, "matrix")
    seeds = {k: f"seed{i}" for i, k in enumerate(keys)}
    tmp = tempfile.mkdtemp(prefix="kvf-matrix-")
    cells: dict[tuple[str, str], str] = {}
    disk: dict[str, tuple[int, int, int, set[str]]] = {}
    t0 = time.monotonic()
    try:
        for w in layouts:
            root = os.path.join(tmp, w)
            with deploy(w, root, a) as dep:
                stored = dep.store(seeds)
                assert len(stored) == len(keys), (w, len(stored))
                payload = dep.tier().layout.payload_bytes
            files = sorted(Path(root).rglob("*.kvf"))
            sizes = {f.stat().st_size for f in files}
            disk[w] = (len(files), max(sizes) if sizes else 0, payload, {f.parent.parent.parent.name for f in files})
            for r in layouts:
                with deploy(r, root, a) as dep:
                    got = dep.load_checked(seeds)
                cells[(w, r)] = ("hit" if all(v is True for v in got.values())
                                 else "MISS" if any(v is None for v in got.values()) else "WRONG")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        quiet.setLevel(level)
    width = max(9, *(len(x) for x in layouts))
    print(f"family {a.family}, {a.layers} layers, {a.chunks} chunks x {a.bpc} blocks of {a.logical} tokens, "
          f"interleave {a.interleave}; rows: writer, columns: reader ({time.monotonic() - t0:.1f} s)")
    print(" " * width + " " + " ".join(f"{r:>{width}}" for r in layouts))
    for w in layouts:
        print(f"{w:>{width}} " + " ".join(f"{cells[(w, r)]:>{width}}" for r in layouts))
    print()
    print(f"{'writer':>{width}} {'files':>6} {'bytes/chunk':>12} {'payload':>10} {'header':>7} namespace")
    namespaces = set()
    ok = all(v == "hit" for v in cells.values())
    for w in layouts:
        n, size, payload, ns = disk[w]
        namespaces |= ns
        ok = ok and n == a.chunks and size - payload in (4096, 8192, 12288)
        print(f"{w:>{width}} {n:>6} {size:>12,} {payload:>10,} {size - payload:>7,} {','.join(sorted(ns))}")
    print(f"\nnamespaces: {len(namespaces)} (one for every layout); all cells hit: "
          f"{all(v == 'hit' for v in cells.values())}")
    return 0 if ok and len(namespaces) == 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
