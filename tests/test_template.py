"""Header templates (spec §11.1): checking a header by comparison gives the outcome of the full decode, for every
single-bit flip of a DeepSeek-V3 header, with the native check and its pure-Python fallback; the writer's patched
header is byte-identical to a full encoding; the tier's loads and stores take both paths."""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import pytest

import kvformat as K
from kvformat.errors import ChecksumError, KVFormatError
from kvformat.format import _native, _template
from kvformat.format._block import check_expected, encode_block
from kvformat.format._header import decode_header, encode_header
from kvformat.format._spec import Provenance
from kvformat.format._template import HeaderEncoder, HeaderTemplates

V3 = K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V3", "bfloat16",
                               [f"model.layers.{i}.self_attn.attn" for i in range(61)], 64, 576)
PAYLOAD = os.urandom(V3.payload_bytes)
RNG = random.Random(2525)
IMPLS = ["native", "python"] if _native.HAVE_NATIVE else ["python"]


def _key() -> K.BlockKey:
    return K.BlockKey(bytes(RNG.getrandbits(8) for _ in range(32)).hex())


def _header(key: K.BlockKey, created: int = 1_790_000_000, **prov: Any) -> bytes:
    hdr, _, _ = encode_block(PAYLOAD, V3, key, provenance=Provenance(created=created, **prov))
    return hdr


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "python":
        monkeypatch.setattr(_native, "header_match", _native._py_header_match)
    return str(request.param)


def _full(region: bytes, key: K.BlockKey, verify: bool) -> Any:
    """The reference outcome: steps 1-3 of spec §11 (decode, then F-9.1/F-9.2)."""
    try:
        hdr = decode_header(region, file_bytes=len(region) + V3.payload_bytes, verify=verify)
        check_expected(hdr, V3, key)
        return hdr
    except KVFormatError as e:
        return (type(e), getattr(e, "region", None), getattr(e, "field", None))


FROM_TEMPLATE: list[int] = [0]  # outcomes the comparison decided (a header, or its F-5.1 error)


def _fast(t: HeaderTemplates, region: bytes, key: K.BlockKey, verify: bool) -> Any:
    try:
        got = t.match(memoryview(region), len(region) + V3.payload_bytes, key, verify)
    except KVFormatError as e:
        FROM_TEMPLATE[0] += 1
        return (type(e), getattr(e, "region", None), getattr(e, "field", None))
    FROM_TEMPLATE[0] += got is not None
    return _full(region, key, verify) if got is None else got


def _learned(*regions_keys: tuple[bytes, K.BlockKey]) -> HeaderTemplates:
    t = HeaderTemplates(V3)
    for region, key in regions_keys:
        t.learn(region, _full(region, key, True))
    return t


def test_a_header_of_the_same_deployment_is_checked_by_comparison(impl: str) -> None:
    k0, k1 = _key(), _key()
    t = _learned((_header(k0), k0))
    for region, key in ((_header(k1, created=1_790_000_999), k1), (_header(k0), k0)):
        got = t.match(memoryview(region), len(region) + V3.payload_bytes, key, True)
        assert got is not None and got == _full(region, key, True)  # every field, key and checksums included
    assert t.matched == 2
    # another writer's provenance is outside the values: parsed, never matched
    other = _header(k1, tp=4, row="per_worker")
    assert t.match(memoryview(other), len(other) + V3.payload_bytes, k1, True) is None
    # the wrong file length (F-3.4), the wrong key (F-9.2), another group: parsed, never matched
    region = _header(k1)
    assert t.match(memoryview(region), len(region) + V3.payload_bytes + 1, k1, True) is None
    assert t.match(memoryview(region), len(region) + V3.payload_bytes, k0, True) is None
    assert t.match(memoryview(region), len(region) + V3.payload_bytes, K.BlockKey(k1.hash, 1), True) is None


@pytest.mark.parametrize("verify", [True, False])
def test_every_bit_flip_of_a_header_gives_the_full_decodes_outcome(impl: str, verify: bool) -> None:
    """Single-bit flips of a DeepSeek-V3 header region (8 KiB): every bit of the first 2 KiB (the metadata, where
    the four per-file values are) and every 7th bit after. The template path returns the header, or raises the
    error, that the full decode does."""
    k0, k1 = _key(), _key()
    t = _learned((_header(k0), k0))
    base = _header(k1, created=1_790_000_123)
    assert _fast(t, base, k1, verify) == _full(base, k1, verify)
    assert max(s for s, _ in (t._items[0].key, t._items[0].dxxh3, t._items[0].created)) < 2048
    bits = [b for b in range(len(base) * 8) if b < 16384 or b % 7 == 0]
    before = FROM_TEMPLATE[0]
    buf = bytearray(base)
    for bit in bits:
        buf[bit >> 3] ^= 1 << (bit & 7)
        region = bytes(buf)
        buf[bit >> 3] ^= 1 << (bit & 7)
        assert _fast(t, region, k1, verify) == _full(region, k1, verify), bit
    # flips inside the values (a hex digit for a hex digit) matched the template: then failed F-5.1 when
    # verifying, or were accepted as the values they now hold without verification. The comparison decided
    # those outcomes, not the parse.
    assert FROM_TEMPLATE[0] - before > 50


def test_the_checksum_error_of_a_matching_header_is_the_full_decodes(impl: str) -> None:
    k0, k1 = _key(), _key()
    t = _learned((_header(k0), k0))
    region = bytearray(_header(k1))
    pos = region.index(b'"kvf.dxxh3":"') + len(b'"kvf.dxxh3":"')
    region[pos] = ord("1") if region[pos] != ord("1") else ord("2")  # a digit for a digit: matches, F-5.1 fails
    with pytest.raises(ChecksumError) as fast:
        t.match(memoryview(bytes(region)), len(region) + V3.payload_bytes, k1, True)
    with pytest.raises(ChecksumError) as full:
        decode_header(bytes(region), file_bytes=len(region) + V3.payload_bytes)
    assert fast.value.region == full.value.region == "header"
    assert (fast.value.expected, fast.value.actual) == (full.value.expected, full.value.actual)


def test_header_match_refuses_bad_spans(impl: str) -> None:
    region = _header(_key())
    spans = np.array([(10, 26, 0)], dtype=np.int64).tobytes()
    for bad, pos in ((np.array([(10, 26, 0), (5, 8, 0)], dtype=np.int64).tobytes(), 10),  # out of order
                     (np.array([(10, 26, 7)], dtype=np.int64).tobytes(), 10),  # unknown kind
                     (np.array([(10, len(region) + 1, 0)], dtype=np.int64).tobytes(), 10),  # past the end
                     (spans, 11),  # hxxh3_pos not a span
                     (spans[:-1], 10)):  # not int64 triples
        with pytest.raises(ValueError):
            _native.header_match(region, region, bad, pos, True)
    assert _native.header_match(region[:-1], region, spans, 10, False) == (1, 0)  # another length: no match


def test_the_encoder_writes_the_bytes_of_a_full_encoding() -> None:
    prov = Provenance(tp=8, row="replicated")
    enc = HeaderEncoder(V3, prov)
    for created in (1_790_000_000, 1_790_000_000, 1_790_000_001, 7):
        for key in (_key(), _key(), K.BlockKey("ab" * 8), _key()):
            got = enc.encode(key, created)
            want = encode_header(V3, key, Provenance(**{**prov.to_dict(), "created": created}), codec="none",
                                 data_bytes=V3.payload_bytes, data_xxh3="0" * 16, raw_xxh3="0" * 16)
            hx = want.index(b'"kvf.hxxh3":"') + 13  # the one field left stale (the fused write recomputes it)
            assert got[:hx] + got[hx + 16:] == want[:hx] + want[hx + 16:], (created, key)


def test_tier_loads_and_stores_take_the_template_paths(tmp_path: Any) -> None:
    """A store through the encoder, then loads through templates: the files decode in full to the same headers,
    every load after the first is matched, and a file of another writer (TP=4) is parsed, read and learned."""
    from vllm_harness import Deployment, kvformat_tier, make_keys, make_payload

    root = str(tmp_path / "root")
    with Deployment([kvformat_tier(root)], tp=8, replicated=True, n_layers=61, tokens_per_block=64, width=576,
                    model="deepseek-ai/DeepSeek-V3", num_chunks=8) as dep:
        keys = make_keys(5, "tmpl")
        items = {k: make_payload(k.hex(), dep.slot_bytes) for k in keys}
        dep.store(items)
        eng = dep.tier()._target(keys[0])[0]
        for dirpath, _, names in os.walk(root):  # every stored header is what a full encoding gives
            for n in names:
                if n.endswith(".kvf"):
                    hdr = K.read_header(os.path.join(dirpath, n))
                    assert hdr.key.hash == n[:-4] and hdr.provenance.tp == 8
        dep.evict_primary()
        assert dep.load(keys) == items
        # loads run on several threads: the first few may all parse before one of them has learned the header
        t = eng.templates
        assert t.matched >= 1 and t.parsed >= 1 and t.matched + t.parsed == len(keys), (t.matched, t.parsed)
    with Deployment([kvformat_tier(root)], tp=4, replicated=False, n_layers=61, tokens_per_block=64, width=576,
                    model="deepseek-ai/DeepSeek-V3", num_chunks=8) as dep4:
        k4 = make_keys(2, "tp4")
        items4 = {k: make_payload(k.hex(), dep4.slot_bytes) for k in k4}
        dep4.store(items4)
        dep4.evict_primary()
        assert dep4.load(keys + k4) == {**items, **items4}
        t4 = dep4.tier()._target(keys[0])[0].templates
        # TP=8's files and TP=4's own differ in provenance: each kind is parsed at least once, then matched
        assert t4.parsed >= 2 and t4.matched >= 1 and t4.matched + t4.parsed == len(keys) + len(k4), \
            (t4.matched, t4.parsed)


def test_template_module_is_byte_level() -> None:
    """I/O at the edges: the template code never opens files (its only imports are byte-level modules)."""
    src = open(_template.__file__).read()
    assert "open(" not in src and "import os" not in src
