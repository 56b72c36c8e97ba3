"""compression="auto" on real roots (issue 45): vLLM's real tiering classes and SGLang's real backend start on a
local root, a slow FUSE root (tests/hangfs.py with a read delay) and a hung one, and each names its choice, the
numbers behind it, and writes files with the codec chosen, loaded back verified. The rule itself, on numbers from
both sides: tests/test_autocodec.py."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM is installed by tools/setup.sh")

from hang_mount import hang_mount  # noqa: E402
from vllm_harness import Deployment, kvf, kvf_files, make_keys  # noqa: E402

import kvformat as K  # noqa: E402
from kvformat.cache import choose_compression  # noqa: E402
from kvformat.vllm import METRIC_PREFIX  # noqa: E402

HERE = Path(__file__).resolve().parent
# Each payload-sized read request through the slow mount waits this long: at most 128 KiB per 50 ms, 2.6 MB/s,
# a root far slower than any planes decode (above 0.1 GB/s even on this loaded 2-core VM).
DELAY_S = 0.05


def _kv_like(n: int, seed: int) -> bytes:
    import numpy as np

    v = (np.random.default_rng(seed).standard_normal(n // 2).astype(np.float32) * 0.5).view(np.uint32)
    return (v >> 16).astype(np.uint16).tobytes()


def _startup(caplog: pytest.LogCaptureFixture, ops) -> str:  # type: ignore[no-untyped-def]
    """The codec the start-up line names, checked to be followed by the choice's reason in parentheses."""
    lines = [r.getMessage() for r in caplog.records if "starting on" in r.getMessage()]
    assert lines, caplog.text[-2000:]
    m = re.search(r"compression=(\w+) ", lines[-1])
    assert m and f"compression={ops.compression.codec} ({ops.compression.reason}), o_direct=" in lines[-1], lines[-1]
    return m.group(1)


def _check_choice(ops) -> None:  # type: ignore[no-untyped-def]
    """The tier's choice is the rule applied to the numbers it reported (whatever this machine measured)."""
    c = ops.compression
    assert c.mode == "auto" and c.read_gbps and c.decode_gbps and c.ratio == 1.44, c
    assert choose_compression(c.read_gbps, c.decode_gbps, c.ratio).codec == c.codec, c


def _round_trip(dep: Deployment, root: Path, codec: str, salt: str) -> None:
    keys = make_keys(3, salt)
    items = {k: _kv_like(dep.slot_bytes, i) for i, k in enumerate(keys)}
    dep.store(items)
    dep.evict_primary()
    assert dep.load(list(items)) == items  # verified loads (verify=True, the default)
    files = kvf_files(root)
    assert len(files) == 3
    for p in files:
        assert K.verify_file(p).codec == codec  # header and payload checksums hold, the codec is the one chosen
        assert (p.stat().st_size < dep.slot_bytes) == (codec == "planes")


def test_auto_on_a_local_root_follows_the_rule_on_its_own_numbers(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A local disk reads faster than planes decodes (none), unless this machine says otherwise: the assertion
    is that the choice is the rule's on the numbers the tier reported, and that stores then use it."""
    caplog.set_level(logging.INFO, logger="vllm.kvformat")
    with Deployment([kvf(tmp_path, compression="auto")], tp=2, replicated=False, n_layers=3) as dep:
        ops = dep.tier().ops
        _check_choice(ops)
        codec = _startup(caplog, ops)
        assert codec == ops.compression.codec
        assert ops.compression.reason.startswith(f"auto: root reads {ops.compression.read_gbps:.3g} GB/s, planes "
                                                 "decodes ")
        _round_trip(dep, tmp_path, codec, "auto local")
        tier = "'1:KVFormatTier'"
        reduced = dep.stats().reduce()
        assert reduced[f"{METRIC_PREFIX}compression_info:({tier}, '{codec}', 'auto')"] == 1
        assert reduced[f"{METRIC_PREFIX}root_read_gbps:({tier},)"] == ops.compression.read_gbps
        assert reduced[f"{METRIC_PREFIX}codec_decode_gbps:({tier},)"] == ops.compression.decode_gbps
    assert not list((tmp_path / ".kvformat" / "probe").glob("*"))  # the probe objects are gone


def test_a_fixed_codec_is_reported_as_fixed(tmp_path: Path) -> None:
    with Deployment([kvf(tmp_path, compression="planes")], n_layers=3) as dep:
        reduced = dep.stats().reduce()
        assert reduced[f"{METRIC_PREFIX}compression_info:('1:KVFormatTier', 'planes', 'fixed')"] == 1
        assert not [k for k in reduced if "gbps" in k]  # nothing measured, no speed reported


@pytest.fixture
def slow_mount(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Path, Path]]:
    """(the mount, its control file): tests/hangfs.py over ``tmp_path/root`` with a read delay of ``param``."""
    src, mnt, ctl = tmp_path / "root", tmp_path / "mnt", tmp_path / "hang.list"
    for d in (src, mnt):
        d.mkdir()
    ctl.write_text(getattr(request, "param", ""))
    with hang_mount(src, mnt, ctl, tmp_path / "hangfs.log", DELAY_S):
        yield mnt, ctl


def test_auto_on_a_slow_root_chooses_planes(slow_mount: tuple[Path, Path], caplog: pytest.LogCaptureFixture) -> None:
    mnt, _ = slow_mount
    caplog.set_level(logging.INFO, logger="vllm.kvformat")
    with Deployment([kvf(mnt, compression="auto", read_deadline_s=30.0)], n_layers=3) as dep:
        ops = dep.tier().ops
        _check_choice(ops)
        assert ops.compression.codec == "planes", ops.compression.reason
        assert _startup(caplog, ops) == "planes"
        _round_trip(dep, mnt, "planes", "auto slow")


@pytest.mark.parametrize("slow_mount", [pytest.param("*.speed\n", id="probe-reads-hang")], indirect=True)
def test_auto_on_a_hung_root_starts_in_time_writing_raw_files(slow_mount: tuple[Path, Path],
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """The read-speed probe's reads never return: the tier starts after the measurement's deadline with
    compression none, and says so."""
    mnt, ctl = slow_mount
    caplog.set_level(logging.INFO, logger="vllm.kvformat")
    with Deployment([kvf(mnt, compression="auto", read_deadline_s=30.0)], n_layers=3) as dep:
        ops = dep.tier().ops
        c = ops.compression
        assert (c.codec, c.mode, c.read_gbps) == ("none", "auto", None), c
        assert "did not finish within 2 s" in c.reason and "writing uncompressed files" in c.reason
        assert _startup(caplog, ops) == "none"
        ctl.write_text("")  # the probe's read returns; the chunks' reads never hung
        _round_trip(dep, mnt, "none", "auto hung")


def test_sglang_backend_decides_on_its_writer_rank(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """SGLang's backend parses the same TierConfig: its storage writer measures and decides, a reader rank (which
    never stores) measures nothing."""
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="SGLang is installed by tools/setup.sh")
    from sglang_harness import attach, host_pool

    caplog.set_level(logging.INFO, logger="kvformat.sglang")
    w = attach(host_pool("page_first"), tmp_path, compression="auto")
    r = attach(host_pool("page_first"), tmp_path, tp=2, rank=1, compression="auto")
    try:
        assert w.ops is not None
        _check_choice(w.ops)
        assert _startup(caplog, w.ops) == w.ops.compression.codec
        assert r.ops is None and r.cache.compression.codec == "none" and "reader rank" in r.cache.compression.reason
    finally:
        r.close()
        w.close()
