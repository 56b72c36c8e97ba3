"""What ``compression: "auto"`` chooses on given roots (issue 45): starts vLLM's real tiering classes with a kvformat
tier on each root (tests/vllm_harness.py) and prints the tier's start-up choice, the numbers behind it and what the
measurement cost, for a DeepSeek-V3-shaped chunk (61 layers x 64 tokens x 576 bf16, 4.5 MB) and the e2e engine's
(2 layers x 16 tokens x 8 blocks, 295 KB).

Usage: python tools/auto_codec.py [ROOT ...] [--fuse-delay S] [--runs N] [--loads N]
``--fuse-delay S`` adds a slow root: tests/hangfs.py mounted over a scratch directory, each payload read request
(up to 128 KiB) answered after S seconds (needs root and /dev/fuse). Each root and layout is started ``--runs``
times (default 3): the choice is made per start, from that start's measurement. ``--loads N`` checks the rule's
prediction: N KV-shaped chunks (kvformat's synthetic chunk, seeds 1..N) stored with compression none, then planes,
each loaded back verified by the tier's own load path, one after the other; the measured time of a planes load
over a raw one is printed next to the start-up lines' prediction.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent))

from vllm_harness import Deployment, kvformat_tier, make_keys, wait_for  # noqa: E402

from kvformat.cache._measure import synthetic_payload  # noqa: E402

LAYOUTS = {"deepseek-v3 4.5 MB": {"n_layers": 61, "tokens_per_block": 64},
           "e2e engine 295 KB": {"n_layers": 2, "tokens_per_block": 16, "blocks_per_chunk": 8}}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def _slow_root(delay_s: float) -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="kvf-auto-") as tmp:
        src, mnt, ctl = Path(tmp, "src"), Path(tmp, "mnt"), Path(tmp, "ctl")
        src.mkdir()
        mnt.mkdir()
        ctl.write_text("")
        proc = subprocess.Popen([sys.executable, str(HERE.parent / "tests" / "hangfs.py"), str(src), str(mnt),
                                 str(ctl), str(delay_s)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            if not wait_for(lambda: os.path.ismount(mnt) or proc.poll() is not None, 30) or not os.path.ismount(mnt):
                raise SystemExit("the FUSE mount did not come up (needs root and /dev/fuse)")
            yield str(mnt)
        finally:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
            proc.terminate()
            proc.wait(10)


def _start(root: str, shape: dict[str, Any], handler: _Lines) -> tuple[str, float]:
    handler.lines.clear()
    t0 = time.perf_counter()
    with Deployment([kvformat_tier(root, compression="auto")], num_chunks=2, **shape):
        took = time.perf_counter() - t0
    line = next(m for m in handler.lines if "starting on" in m)
    return "compression=" + line.split("compression=", 1)[1].split(", o_direct=", 1)[0], took


def _load_s(root: str, shape: dict[str, Any], codec: str, n: int) -> float:
    """Seconds per verified load of ``n`` chunks written with ``codec``: the tier's own load path (RowEngine's
    load_chunk, the one a load job runs), one chunk after the other, as one read stream on one core does."""
    keys = make_keys(n, salt=f"auto-codec {codec} {time.time_ns()}")
    with Deployment([kvformat_tier(root, compression=codec)], num_chunks=2 * n, **shape) as dep:
        tier = dep.tier()
        dep.store({k: bytes(synthetic_payload(tier.layout, seed=i + 1)) for i, k in enumerate(keys)})
        targets = [tier._target(k) for k in keys]
        t0 = time.perf_counter()
        got = [eng.load_chunk(h, 0) for eng, h in targets]
        took = time.perf_counter() - t0
        if any(v is None for v in got):
            raise SystemExit(f"a {codec} load missed on {root}: {tier.counters()}")
    return took / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("roots", nargs="*", default=["/dev/shm/kvf-auto", "/var/tmp/kvf-auto"])
    ap.add_argument("--fuse-delay", type=float, default=None)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--loads", type=int, default=0)
    args = ap.parse_args()
    handler = _Lines()
    log = logging.getLogger("vllm.kvformat")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    load = os.getloadavg()[0]
    print(f"python tools/auto_codec.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"{os.cpu_count()} CPUs, load average {load:.1f} at start; each line: one tier start-up's choice "
          f"(the start-up line's text) and the tier's whole start-up time")
    with contextlib.ExitStack() as stack:
        roots = [(r, r) for r in args.roots]
        if args.fuse_delay is not None:
            roots.append((stack.enter_context(_slow_root(args.fuse_delay)),
                          f"FUSE pass-through, {args.fuse_delay * 1000:g} ms per read request (tests/hangfs.py)"))
        for root, label in roots:
            os.makedirs(root, exist_ok=True)
            for name, shape in LAYOUTS.items():
                print(f"\n{label}, {name} chunks:")
                for _ in range(args.runs):
                    line, took = _start(root, shape, handler)
                    print(f"  {line}  [start-up {took:.2f} s]")
                if args.loads:
                    raw, planes = (_load_s(root, shape, c, args.loads) for c in ("none", "planes"))
                    print(f"  measured: {args.loads} verified loads, {raw * 1000:.1f} ms each raw, "
                          f"{planes * 1000:.1f} ms planes: a planes load took {planes / raw:.2f}x a raw one")
    print(f"\nload average {os.getloadavg()[0]:.1f} at end (other processes on this machine share its CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
