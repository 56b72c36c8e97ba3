"""A read that never returns (issue 43): two real tiers (vLLM's offloading manager, KVFormatTier) share one bounded
root; engine B reaches it through a FUSE mount (tests/hangfs.py) on which one file's payload read blocks, as on a
mount whose chunkserver or NFS server stopped. What must hold: B's load becomes a miss at ``read_deadline_s``
instead of holding the request for ever; the evictor (A) goes on deleting and storing while B's read is still
stuck; and when the read finally returns, its bytes are dropped, never written into B's KV memory (the chunk was
handed back to vLLM when the load was reported a miss). Without the deadline the load never finishes and B's
acknowledgement, pinned by the stuck read, stops every deletion on the root.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM is installed by tools/setup.sh")

from hang_mount import hang_mount  # noqa: E402
from vllm_harness import Deployment, kvf, kvf_files, make_keys, payloads, wait_for  # noqa: E402

HERE = Path(__file__).resolve().parent
# Every load through the FUSE pass-through (a Python process) must finish inside the deadline; 1 s was too
# tight for a loaded CI machine, where a healthy load through the mount missed and failed the test.
DEADLINE_S = 3.0
FILES = 12  # the bound, in chunk files


@pytest.fixture
def hung_mount(tmp_path: Path) -> Iterator[tuple[Path, Path, Path]]:
    """(root, the same root through a FUSE mount, the mount's list of files whose reads hang)."""
    src, mnt, ctl = tmp_path / "root", tmp_path / "mnt", tmp_path / "hang.list"
    src.mkdir()
    mnt.mkdir()
    ctl.write_text("")
    with hang_mount(src, mnt, ctl, tmp_path / "hangfs.log"):
        yield src, mnt, ctl


def test_a_read_that_never_returns_is_a_miss_and_deletions_go_on(hung_mount: tuple[Path, Path, Path]) -> None:
    src, mnt, ctl = hung_mount
    probe = Deployment([kvf(src)], n_layers=4, num_chunks=4)
    file_bytes = probe.tier().ops.file_bytes
    probe.close()
    tier = {"max_bytes": FILES * file_bytes, "shared_interval_s": 0.1, "read_deadline_s": DEADLINE_S}
    with Deployment([kvf(src, **tier)], n_layers=4, num_chunks=16) as a, \
            Deployment([kvf(mnt, **tier)], n_layers=4, num_chunks=16) as b:
        assert a.tier().engine.isolated_reads is False  # a local disk: direct reads into the row
        assert b.tier().engine.isolated_reads is True  # FUSE: reads that may hang go to a private buffer
        assert wait_for(lambda: a.tier().ops.shared.is_evictor and b.tier().ops.shared.may_read("x"), 20)
        keys = make_keys(40, salt="deadline")
        data = payloads(a, keys)
        a.store({k: data[k] for k in keys[:4]})
        first = b.load(keys[:2], timeout=30)
        assert first == {k: data[k] for k in keys[:2]}, b.tier().counters()  # through the mount, before any hang
        b.evict_primary()  # the next load of keys[0] must come from the tier, whose index knows the file now

        hung = keys[0]
        eng, h = b.tier()._target(hung)
        assert eng is not None and h is not None
        rel = eng.relpath(h)
        assert (src / rel).is_file()
        ctl.write_text(os.path.basename(rel) + "\n")
        t0 = time.monotonic()
        got = b.load([hung], timeout=30)  # without the deadline: TimeoutError, the load never finishes
        waited = time.monotonic() - t0
        assert got == {hung: None}
        counters = b.tier().counters()
        assert counters["load_deadline_misses"] == 1 and counters["late_reads_dropped"] == 0

        # The read is still stuck in the mount. The evictor keeps the root bounded: it stores and deletes.
        before = a.tier().counters()
        for k in keys[4:]:  # one at a time, as requests arrive: each store waits for the evictor's grant
            a.store({k: data[k]})
        after = a.tier().counters()
        evicted = after["evictions"] - before["evictions"]
        written = after["files_written"] - before["files_written"]
        # Without the deadline B's acknowledgement stays at the state its stuck read began under: nothing doomed
        # since is deleted, and once the bound is full every store is refused (reason "bound").
        assert evicted >= 2 * FILES // 3 and written >= FILES + 4, {k: v for k, v in after.items() if v}
        on_root = sum(p.stat().st_size for p in kvf_files(src))
        assert on_root <= FILES * file_bytes, (on_root, FILES * file_bytes)

        # B still answers: a chunk A stored after the hang loads, byte for byte
        last = b.load([keys[-1]], timeout=30)
        assert last == {keys[-1]: data[keys[-1]]}, b.tier().counters()

        # Released, the stuck read returns; its bytes must not reach KV memory handed back long ago.
        assert b._rows is not None
        b._rows[:] = 0
        ctl.write_text("")
        assert wait_for(lambda: b.tier().counters()["late_reads_dropped"] == 1, 30), b.tier().counters()
        assert not b._rows.any(), "a read given up on wrote into the primary rows"
        print(f"\nhung read: miss after {waited:.2f} s (deadline {DEADLINE_S} s); evictions while it hung "
              f"{evicted}, stores {written} of {len(keys) - 4}; root {on_root} of {FILES * file_bytes} bytes")


def test_a_follower_whose_round_hangs_answers_misses_it_counts(hung_mount: tuple[Path, Path, Path]) -> None:
    """B's coordination round hangs reading the evictor's state (every read of state.json blocks): past ttl_s/2
    its view is not current, so a chunk A stored is a miss for B, counted in stale_view_misses (issue 43: two
    fresh-clone fleet runs answered B's hung prompt with misses no counter named). Released, B loads it."""
    src, mnt, ctl = hung_mount
    tier = {"max_bytes": 64 << 20, "shared_interval_s": 0.1, "read_deadline_s": DEADLINE_S}
    with Deployment([kvf(src, **tier)], n_layers=4, num_chunks=8) as a, \
            Deployment([kvf(mnt, **tier)], n_layers=4, num_chunks=8) as b:
        shared = b.tier().ops.shared
        assert wait_for(lambda: a.tier().ops.shared.is_evictor and shared.view_current(), 20)
        keys = make_keys(2, salt="stale")
        data = payloads(a, keys)
        a.store(data)
        ctl.write_text("!state.json\n")
        assert wait_for(lambda: not shared.view_current(), 20)
        assert b.load(keys[:1], timeout=30) == {keys[0]: None}
        assert b.tier().counters()["stale_view_misses"] >= 1
        ctl.write_text("")
        assert wait_for(shared.view_current, 30)
        assert b.load(keys[1:], timeout=30) == {keys[1]: data[keys[1]]}, b.tier().counters()
