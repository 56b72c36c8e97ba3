"""Issue 31 item 5: the one bound of a shared root counts every file under it, whatever its key id, namespace or
writer. Attack: while a bounded, sealed deployment serves the root, a deployment under a retired key (another key
id, hence another namespace) keeps writing there with no bound and no journal. Before the fix the bounded
deployment's evictor learnt of files only from journals and its start-up scan, so the root grew past max_bytes
for as long as it ran (measured: 1,474,560 bytes on disk for max_bytes 245,760). Both deployments are vLLM's real TieringOffloadingManager with
KVFormatTier, on real files."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM is installed by tools/setup.sh")

from vllm_harness import Deployment, kvf, kvf_files, make_keys, payloads  # noqa: E402

from kvformat.cache._ops import rescan_interval  # noqa: E402

N_LAYERS = 2
INTERVAL_S = 0.05  # the shared ticks; the periodic listing then runs every rescan_interval(INTERVAL_S) = 3 s


def _key(tmp_path: Path, name: str) -> str:
    p = tmp_path / f"{name}.key"
    p.write_text(os.urandom(32).hex() + "\n")
    p.chmod(0o600)
    return str(p)


def _disk(root: Path) -> int:
    return sum(p.stat().st_size for p in kvf_files(root))


def test_files_no_journal_names_are_counted_toward_the_bound(tmp_path: Path) -> None:
    root = tmp_path / "root"
    probe = tmp_path / "probe"
    with Deployment([kvf(probe)], n_layers=N_LAYERS, num_chunks=8) as d:  # one file's size on this layout
        d.store(payloads(d, make_keys(1, "probe")))
    file_bytes = _disk(probe)
    bound = 6 * file_bytes
    sentinel = tmp_path / "outside"
    sentinel.mkdir()
    (sentinel / "keep.kvf").write_bytes(b"x" * file_bytes)
    current, retired = _key(tmp_path, "current"), _key(tmp_path, "retired")
    with Deployment([kvf(root, max_bytes=bound, shared_interval_s=INTERVAL_S, seal="encrypt", seal_key=current)],
                    n_layers=N_LAYERS, num_chunks=64) as a:
        a.store(payloads(a, make_keys(4, "current")))
        assert _disk(root) <= bound
        with Deployment([kvf(root, seal="encrypt", seal_key=retired)], n_layers=N_LAYERS, num_chunks=64) as old:
            for i in range(4):  # the unbounded writer keeps going while the bounded one serves
                old.store(payloads(old, make_keys(8, f"retired-{i}")))
        written = _disk(root)
        assert written > 3 * bound, written  # the attack took: the root is far past the bound
        deadline = time.monotonic() + 4 * rescan_interval(INTERVAL_S) + 10
        while _disk(root) > bound and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _disk(root) <= bound, (_disk(root), bound)
        c = a.tier().counters()
        assert c["files_written"] >= 4
        a.store(payloads(a, make_keys(2, "after")))  # the bounded deployment still stores, and stays bounded
        assert _disk(root) <= bound
        assert a.load(make_keys(2, "after")) == payloads(a, make_keys(2, "after"))
    assert (sentinel / "keep.kvf").read_bytes() == b"x" * file_bytes  # nothing outside the root was touched


def test_sealed_engines_share_one_bound_through_authenticated_records(tmp_path: Path) -> None:
    """Two deployments holding one key on one bounded sealed root: every control record they write carries a MAC
    under it (issue 31 item 6), and they still keep one bound between them."""
    root = tmp_path / "root"
    key = _key(tmp_path, "k")
    cfg = kvf(root, max_bytes=None, shared_interval_s=INTERVAL_S, seal="encrypt", seal_key=key)
    with Deployment([dict(cfg, max_bytes=1 << 30)], n_layers=N_LAYERS, num_chunks=8) as d:
        d.store(payloads(d, make_keys(1, "size")))
        file_bytes = _disk(root)
    bound = 6 * file_bytes
    cfg["max_bytes"] = bound
    with Deployment([cfg], n_layers=N_LAYERS, num_chunks=64) as a, \
            Deployment([cfg], n_layers=N_LAYERS, num_chunks=64) as b:
        for i in range(4):
            a.store(payloads(a, make_keys(4, f"a{i}")))
            b.store(payloads(b, make_keys(4, f"b{i}")))
            assert _disk(root) <= bound
        control = [p for p in (root / ".kvformat").rglob("*") if p.is_file()]
        assert control and all(b"\nkvf-mac " in p.read_bytes() for p in control), control
        assert sum(t.tier().counters()["evictor"] for t in (a, b)) == 1
