"""compression="auto" (issue 45): the rule as a pure function on numbers from both sides of it, the setting's
parsing, and the two measurements it is fed (the planes decode on a synthetic chunk, a root's read through its
store), each on real buffers and a real root. The tiers' start-up on real roots: tests/test_auto_compression.py."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

import kvformat as K
from kvformat.cache import (
    CompressionChoice, TierConfig, auto_compression, choose_compression, expected_ratio, measure_decode,
)
from kvformat.cache._measure import synthetic_payload
from kvformat.errors import SchemaError
from kvformat.storage import LocalStore, measure_read

NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(3)]


# -- the rule --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("read_gbps,decode_gbps,ratio,codec", [
    (0.31, 1.4, 1.44, "planes"),  # a network root: 0.31 GB/s is below 1.4 x (1 - 1/1.44) = 0.428 GB/s
    (0.42, 1.4, 1.44, "planes"),
    (0.44, 1.4, 1.44, "none"),  # just above the break-even speed
    (3.6, 1.4, 1.44, "none"),  # a local NVMe disk
    (0.5, 1.0, 2.0, "planes"),  # exactly even: 1/(2 x 0.5) + 1/1 == 1/0.5; "not slower" compresses
    (0.05, 0.9, 1.0, "none"),  # nothing saved: any decode is a loss, however slow the root
    (0.05, 0.9, 0.95, "none"),
    (0.01, 0.14, 1.15, "planes"),  # fp8 on a loaded machine, a very slow root
    (0.03, 0.14, 1.15, "none"),
])
def test_the_rule_on_both_sides(read_gbps: float, decode_gbps: float, ratio: float, codec: str) -> None:
    c = choose_compression(read_gbps, decode_gbps, ratio)
    assert (c.codec, c.mode) == (codec, "auto")
    assert (c.read_gbps, c.decode_gbps, c.ratio) == (read_gbps, decode_gbps, ratio)
    # The reason restates the rule's comparison: planes' load time relative to a raw load.
    factor = float(c.reason.rsplit("takes ", 1)[1].split("x", 1)[0])
    exact = (1 / (ratio * read_gbps) + 1 / decode_gbps) * read_gbps
    assert math.isclose(factor, exact, abs_tol=0.006) and (factor <= 1.0) == (codec == "planes"), c.reason


def test_the_reason_names_the_numbers_as_the_start_up_line_shows_them() -> None:
    c = choose_compression(0.31, 1.4, 1.44, ratio_source="expected for bfloat16")
    assert c.describe() == ("planes (auto: root reads 0.31 GB/s, planes decodes 1.4 GB/s verified, ratio 1.44 "
                            "(expected for bfloat16): a planes load takes 0.92x a raw one)")
    assert c.gauges() == {"root_read_gbps": 0.31, "codec_decode_gbps": 1.4}
    fixed = CompressionChoice("zstd")
    assert (fixed.describe(), fixed.mode, fixed.gauges()) == ("zstd", "fixed", {})


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_number_that_is_no_measurement_chooses_none_and_says_which(bad: float) -> None:
    for args, name in (((bad, 1.4, 1.44), "root read speed"), ((0.1, bad, 1.44), "decode speed"),
                       ((0.1, 1.4, bad), "ratio")):
        c = choose_compression(*args)
        assert (c.codec, c.mode) == ("none", "auto") and name in c.reason and "uncompressed" in c.reason, c.reason


def test_expected_ratios_are_the_benchmarks() -> None:
    assert (expected_ratio("bfloat16"), expected_ratio("float32"), expected_ratio("fp8_e4m3"),
            expected_ratio("fp8_ds_mla")) == (1.44, 1.18, 1.15, 1.15)
    assert expected_ratio("float16") is None  # not measured: the synthetic chunk's ratio is used


# -- the setting -----------------------------------------------------------------------------------------------


def test_auto_is_a_compression_setting_with_planes_level(tmp_path: Path) -> None:
    cfg = TierConfig.parse(str(tmp_path), compression="auto")
    assert (cfg.compression, cfg.compression_level) == ("auto", 1)
    assert TierConfig.parse(str(tmp_path)).compression == "none"  # opt-in: docs/vllm.md says why
    with pytest.raises(SchemaError, match="sealed files are not compressed"):
        TierConfig.parse(str(tmp_path), compression="auto", seal="authenticate", seal_key="env:KVF_TEST_NO_KEY")
    with pytest.raises(SchemaError, match="compression: expected one of none, zstd, planes, auto"):
        TierConfig.parse(str(tmp_path), compression="fast")


# -- the measurements ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype,width", [("bfloat16", 576), ("float32", 576), ("fp8_e4m3", 576),
                                            ("fp8_e5m2", 576), ("fp8_ds_mla", 656), ("float16", 576)])
def test_the_decode_is_timed_on_a_chunk_that_round_trips(kv_dtype: str, width: int) -> None:
    layout = K.CanonicalLayout.uniform("test/auto", kv_dtype, NAMES, 16, width, blocks_per_chunk=2)
    pay = synthetic_payload(layout)
    assert len(pay) == layout.payload_bytes and pay == synthetic_payload(layout) != synthetic_payload(layout, 1)
    gbps, ratio = measure_decode(layout, budget_s=0.01)
    assert gbps > 0 and 1.0 < ratio < 2.0, (gbps, ratio)  # KV-shaped: compressible, never as much as zeros


def test_the_decode_chunk_is_capped_at_a_few_mb() -> None:
    big = K.CanonicalLayout.uniform("test/auto", "bfloat16", [f"l{i}" for i in range(61)], 64, 576, blocks_per_chunk=4)
    assert big.payload_bytes > 16 << 20
    gbps, ratio = measure_decode(big, budget_s=0.01)  # 61 x 4 x 64 x 1152 bytes: only the first layers are coded
    assert gbps > 0 and 1.3 < ratio < 1.6


def test_the_read_is_measured_through_the_store_and_leaves_nothing(tmp_path: Path) -> None:
    store = LocalStore(str(tmp_path))
    speed = measure_read(store, 300_000, budget_s=0.01, max_reads=2)
    assert speed.gbps > 0 and 1 <= speed.reads <= 2 and speed.nbytes == 300_000
    assert speed.cold  # a local path: each read came past the page cache
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_auto_on_a_failing_root_chooses_none_and_says_why(tmp_path: Path) -> None:
    root = tmp_path / "ro"
    root.mkdir()
    store = LocalStore(str(root))
    layout = K.CanonicalLayout.uniform("test/auto", "bfloat16", NAMES, 16, 576)
    os.chmod(root, 0o500)
    try:
        if os.access(root, os.W_OK):  # root ignores the mode: a file where the probe's directory goes instead
            os.chmod(root, 0o700)
            (root / ".kvformat").write_text("not a directory")
        c = auto_compression(store, layout)
    finally:
        os.chmod(root, 0o700)
    assert (c.codec, c.mode) == ("none", "auto") and c.reason.startswith("auto: measuring the root failed"), c
    assert c.decode_gbps is not None and c.read_gbps is None  # the decode was measured, the root was not


def test_a_remote_root_is_read_through_its_own_requests() -> None:
    """A URL root: the probe is written and read back with the store's batched requests (its deadlines), nothing
    to drop from a page cache, and nothing left behind."""
    import uuid

    from kvformat.storage import open_store

    store = open_store(f"memory://kvf-auto-{uuid.uuid4().hex[:8]}/root")
    speed = measure_read(store, 200_000, budget_s=0.01, max_reads=2)
    assert speed.gbps > 0 and 1 <= speed.reads <= 2 and not speed.cold
    fs, path = store.fsspec_location(".kvformat")
    assert fs.find(path) == []  # the probe object was deleted (listings skip .kvformat/, so ask fsspec)
