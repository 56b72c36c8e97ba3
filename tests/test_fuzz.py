"""Fuzzed files (issue 7): every mutated file ends in a kvformat error, the destination stays clean.

The CI loop runs tools/fuzz.py in a child process (its address space capped, a per-case timer for
hangs); ``KVFORMAT_SLOW=1`` runs 100,000 cases. The regression tests below pin the core bugs the
fuzzer found, each with the smallest input that showed it.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvformat as K
from kvformat.errors import KVFormatError, LayoutMismatchError, SchemaError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import fuzz  # noqa: E402

SLOW = os.environ.get("KVFORMAT_SLOW") == "1"
SEEDS = fuzz.make_seeds(0)


def test_fuzz_loop(tmp_path):
    """≥ 2,000 cases (100,000 with KVFORMAT_SLOW=1): all rejected with a kvformat error, nothing else."""
    cases = 100_000 if SLOW else 2_000
    out = tmp_path / "summary.json"
    # The timeout only turns a hang of the whole loop into a failure; each case has its own 10 s timer.
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "fuzz.py"), "--cases", str(cases), "--seed", "7",
                        "--jobs", "2" if SLOW else "1", "--unverified", "0",  # verify=False: its own test below
                        "--mem-limit-mb", "512", "--json", str(out), "--save-failures", str(tmp_path / "failures"),
                        "--tmpdir", str(tmp_path)], capture_output=True, text=True, timeout=3600 if SLOW else 600)
    assert out.exists(), r.stderr[-3000:]
    summary = json.loads(out.read_text())
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}, sort_keys=True))
    assert summary["failures"] == [] and r.returncode == 0, summary["failures"][:5]
    # Rejected, or (rarely: a recomputed-checksum flip that decodes to the same bytes) identical in meaning.
    assert summary["cases"] == cases and summary["rejected"] + summary["equivalent"] == cases
    assert summary["equivalent"] <= cases // 1000
    assert set(summary["by_mutator"]) == set(fuzz.MUTATORS)  # every kind of mutation ran
    # Many different checks fired, from the length field to the codec.
    assert {"TruncatedError", "ChecksumError", "InvalidJSONError", "SchemaError", "CodecError", "HeaderError",
            "NotKVFormatError", "OversizedHeaderError", "UnsupportedVersionError"} <= set(summary["by_error"])
    # Memory stays within a small multiple of the header limit (1 MiB), whatever the input declares.
    assert summary["max_tracemalloc_peak"] < 32 << 20



def _fuzz(tmp_path, *args: str) -> dict:
    out = tmp_path / "summary.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "fuzz.py"), *args, "--json", str(out),
                        "--tmpdir", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert out.exists(), r.stderr[-3000:]
    return json.loads(out.read_text())


def test_fuzz_unverified_reads_through_both_backends(tmp_path):
    """verify=False on half the cases, every case also read through a LocalStore and an fsspec store:
    only kvformat errors, and a destination that is untouched or zeroed whenever a read fails (F-5.5
    on every path, backend, codec and flag)."""
    cases = 20_000 if SLOW else 800
    summary = _fuzz(tmp_path, "--cases", str(cases), "--seed", "11", "--unverified", "0.5", "--mem-limit-mb", "512")
    assert summary["failures"] == [], summary["failures"][:5]
    assert summary["unverified_cases"] >= cases // 4 and summary["cases"] == cases


def test_fuzz_metadata_files_through_the_cli(tmp_path):
    """Mutated namespace.json and legacy config.json (wrong types, nulls, zeros, lists for dicts, bytes):
    inspect, verify and compact --dry-run exit 0/1/2 with parseable --json, never a traceback or a hang."""
    summary = _fuzz(tmp_path, "--metadata", "--cases", "2000" if SLOW else "150", "--seed", "5", "--per-case-s", "20")
    assert summary["failures"] == [], summary["failures"][:5]
    assert summary["cases"] == (2000 if SLOW else 150)


def test_checker_catches_acceptance_and_leaks(tmp_path):
    """The fuzz checks can fail: a file meaning anything else than the original is 'accepted', a
    half-written destination is a leak; the unchanged original is 'Equivalent'."""
    s, other = SEEDS[0], SEEDS[1]  # same layout, another key and payload
    assert s.layout == other.layout and s.key != other.key
    p = tmp_path / "v.kvf"
    p.write_bytes(other.file)
    dst = bytearray(len(s.payload))
    with pytest.raises(fuzz.Failure, match="accepted"):
        fuzz.check_case(other.file, s, str(p), dst, expect=False, o_direct=False)
    p.write_bytes(s.file)
    assert fuzz.check_case(s.file, s, str(p), dst, expect=True, o_direct=False) == "Equivalent"
    leaked = bytearray([fuzz.SENTINEL]) * 64
    leaked[10] = 7
    with pytest.raises(fuzz.Failure, match="neither the sentinel nor zero"):
        fuzz._check_dst(leaked, "x")
    fuzz._check_dst(bytearray(64), "zeroed")
    fuzz._check_dst(bytearray([fuzz.SENTINEL]) * 64, "untouched")


def test_truncation_at_every_boundary(tmp_path):
    """Each seed cut at every region boundary (length field, prefix, hxxh3, JSON end, padding, data)."""
    p = str(tmp_path / "t.kvf")
    n = 0
    for s in SEEDS:
        dst = bytearray(len(s.payload))
        for cut in sorted(set(fuzz._boundaries(s)) | set(range(0, 40))):
            data = s.file[:cut]
            with open(p, "wb") as f:
                f.write(data)
            fuzz.check_case(data, s, p, dst, expect=False, o_direct=False)
            n += 1
    assert n > 200


@settings(max_examples=1000 if SLOW else 150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, len(SEEDS) - 1), st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 7)), min_size=1,
                                                 max_size=4), st.booleans())
def test_hypothesis_bitflips(i, flips, fix):
    """Bit flips anywhere: raw ones always raise a kvformat error; with the header checksum recomputed
    (a forger, G-1.5) the file may pass only if the layout and key still match and the payload is intact."""
    s = SEEDS[i]
    b = bytearray(s.file)
    for pos, bit in flips:
        b[pos % len(b)] ^= 1 << bit
    data = fuzz.fix_hxxh3(bytes(b)) if fix else bytes(b)
    if data == s.file:
        return
    dst = bytearray([fuzz.SENTINEL]) * len(s.payload)
    try:
        K.decode(data, out=dst, expect=s.layout, key=s.key)
    except KVFormatError:
        fuzz._check_dst(dst, "decode")
    else:  # e.g. a flip inside kvf.writer: informational only, the payload is the original one
        assert fix, "a raw bit flip was accepted"
        assert bytes(dst) == s.payload


# -- regressions for core bugs the fuzzer found ---------------------------------------------------------

def _doc(s: fuzz.Seed):
    return fuzz.parse(s)


def test_regression_unhashable_dtype():
    """A tensor dtype that is a JSON list/object raised TypeError (unhashable) from the tensor-table check."""
    s = SEEDS[0]
    doc, data = _doc(s)
    name = next(k for k in doc if k != "__metadata__")
    for bad in ([], {"a": 1}):
        doc[name]["dtype"] = bad
        with pytest.raises(SchemaError):
            K.decode(fuzz.assemble(doc, data), out=bytearray(len(s.payload)))


def test_regression_lone_surrogate():
    """A name holding a lone surrogate ("\\ud800" escape) raised UnicodeEncodeError from the name check."""
    s = SEEDS[0]
    doc, data = _doc(s)
    doc["__metadata__"]["kvf.model"] = fuzz.Raw(b'"\\ud800"')
    with pytest.raises(SchemaError):
        K.decode(fuzz.assemble(doc, data), out=bytearray(len(s.payload)))
    doc, data = _doc(s)
    name = next(k for k in doc if k != "__metadata__")
    doc = fuzz.Pairs([(fuzz.Raw(b'"\\udfff"') if k == name else k, v) for k, v in doc.items()])
    with pytest.raises(SchemaError):
        K.decode(fuzz.assemble(doc, data))


def test_regression_declared_payload_larger_than_destination(tmp_path):
    """A file declaring a bigger payload than ``out`` raised a bare ValueError; now LayoutMismatchError."""
    s = next(x for x in SEEDS if x.codec == "zstd")
    doc, frame = _doc(s)
    tpb = s.layout.tokens_per_block
    doc["__metadata__"]["kvf.layers"] = json.dumps([["x", "U8", [tpb, (1 << 31) // tpb]]])
    data = fuzz.assemble(fuzz._with_data(doc, frame), frame)
    dst = bytearray([fuzz.SENTINEL]) * len(s.payload)
    with pytest.raises(LayoutMismatchError) as e:
        K.decode(data, out=dst)
    assert e.value.field == "payload_bytes"
    p = tmp_path / "big.kvf"
    p.write_bytes(data)
    with pytest.raises(LayoutMismatchError):
        K.read_into(p, dst)
    fuzz._check_dst(dst, "read_into")
    assert isinstance(e.value, ValueError)  # callers catching ValueError keep working


def test_seeds_are_valid():
    """The fuzzer starts from files the reader accepts (else every 'rejection' would be trivial)."""
    for s in SEEDS:
        out = bytearray(len(s.payload))
        hdr, _ = K.decode(s.file, out=out, expect=s.layout, key=s.key, keys=s.keys)
        assert bytes(out) == s.payload and hdr.codec == s.codec
    assert {s.layout.seal for s in SEEDS} == {None, "authenticate", "encrypt"}  # sealed files are fuzzed too
    rng = random.Random(0)
    assert all(fuzz.MUTATORS[m](rng, SEEDS[1], SEEDS) != SEEDS[1].file for m in fuzz.ADV)
