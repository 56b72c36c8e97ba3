"""Issue 31's fuzz test on real processes: two engine processes (vLLM's real TieringOffloadingManager with
KVFormatTier, tests/shared_root_child.py) store and load overlapping keys on one bounded root while this process,
as a co-tenant, writes random bytes, truncations, out-of-range numbers, path tricks, FIFOs, symlinks and planted
leases into the root's control files for a fixed number of rounds (the same mutations as the one-process fuzz in
tests/test_shared_control.py). Nothing may show a traceback, load a wrong byte, change anything outside the root,
or leave the disk over the bound once the co-tenant stops."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest

from shared_root import FILE, MAX, start
from test_shared_control import _mutations
from treediff import changes, snapshot as _tree

ROUNDS = 150  # co-tenant writes, one every 20 ms while the engines run
ENGINE_ROUNDS = 80  # each engine's store+load rounds: they outlast the fuzz by more than one periodic rescan


def test_fuzzed_control_files_under_two_engine_processes(tmp_path: Path) -> None:
    pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM is installed by tools/setup.sh")
    root = tmp_path / "root"
    root.mkdir()
    sentinel = tmp_path / "outside"
    (sentinel / "ns").mkdir(parents=True)
    for i in range(3):
        (sentinel / "ns" / f"{i:06d}.kvf").write_bytes(os.urandom(FILE))
    (sentinel / "keep.txt").write_bytes(b"not the cache's")
    before = _tree(sentinel)
    go = tmp_path / "go"
    procs = start(str(root), str(go), 2, ENGINE_ROUNDS, {})
    go.touch()
    rng = random.Random(3136)
    for _ in range(ROUNDS):
        _mutations(rng, str(root), sentinel)
        time.sleep(0.02)
    for p in Path(root, ".kvformat").rglob("*"):  # the co-tenant stops: its planted FIFOs and symlinks go
        if p.is_symlink() or (p.exists() and not p.is_file() and not p.is_dir()):
            p.unlink()
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0 and "Traceback" not in err, err[-4000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert sum(r["wrong"] for r in results) == 0
    assert sum(r["counters"]["corrupt_files"] for r in results) == 0
    assert sum(r["hits"] for r in results) > 0  # the engines served through it
    assert not changes(before, _tree(sentinel)), changes(before, _tree(sentinel))
    on_disk = sum(p.stat().st_size for p in root.rglob("*.kvf") if ".kvformat" not in p.parts)
    assert on_disk <= MAX, (on_disk, MAX)
