#!/usr/bin/env python
"""Fuzz kvformat's readers with mutated files (issue 7).

Every case is a valid file mutated so that it is no longer valid. Each case goes through
``kvformat.decode(bytes, out=dst)``, ``kvformat.read_into(path, dst)`` (plus ``read_header``) and
must end in a :class:`~kvformat.KVFormatError` subclass (or, for the rare mutation that changes
nothing a reader can see, e.g. a checksum-recomputed zstd bit flip that decodes to the same bytes, be
accepted with exactly the original layout, key and payload: "equivalent"): never another exception type, never a
hang (a per-case timer), never more memory than the limits allow (``--mem-limit-mb`` caps the
address space; a sample of cases is measured with tracemalloc), and ``dst`` is either untouched
(still the sentinel) or explicitly zeroed.

Two kinds of mutation:

- raw: bit flips, byte runs, truncation at every region boundary, length-field values, splices,
  trailing/inserted bytes. The header checksum (``kvf.hxxh3``) catches most of these early.
- adversarial: the header checksum (and, where the point is to reach the codec, the data
  checksum) is recomputed after mutating, so the JSON parser, the schema checks, the tiling
  checks and the zstd decoder all see hostile input: JSON bombs (deep nesting, giant strings,
  duplicate keys), wrong types, overlapping/out-of-range offsets, swapped layouts, a valid header
  over another block's payload, truncated or size-lying zstd frames, plane-coded files (§6.2) whose plane
  table or planes lie.

Usage::

    .venv/bin/python tools/fuzz.py --cases 2000 --seed 1          # what CI runs (tests/test_fuzz.py)
    KVFORMAT_SLOW=1 .venv/bin/python tools/fuzz.py --seed 7 --jobs 2   # 100,000 cases (the slow-mode test)

Prints a JSON summary (``--json PATH`` also writes it); exit status 1 if any case failed.
Failing inputs are saved under ``--save-failures DIR`` for replay (``--replay FILE``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import signal
import struct
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import xxhash  # noqa: E402
import zstandard  # noqa: E402

import kvformat as K  # noqa: E402
from kvformat.format._header import _hxxh3_pos  # noqa: E402
from kvformat.format._consts import ALIGNMENT, HEX64_LEN, HEX64_ZERO, MAX_HEADER_BYTES  # noqa: E402

SENTINEL = 0xA5
_U64 = struct.Struct("<Q")


class Hang(BaseException):
    """Raised by the per-case timer; a BaseException so no library ``except Exception`` hides it."""


@dataclass
class Seed:
    name: str
    layout: K.CanonicalLayout
    key: K.BlockKey
    payload: bytes
    file: bytes
    codec: str
    keys: Any = None  # sealed seeds (spec §12): the keyring every reader is given

    @property
    def hdr_end(self) -> int:
        return 8 + _U64.unpack_from(self.file, 0)[0]

    @property
    def json_end(self) -> int:
        return len(self.file[:self.hdr_end].rstrip(b" "))


def _payload(rng: random.Random, n: int, compressible: bool) -> bytes:
    if not compressible:
        return rng.randbytes(n)
    # Runs of repeated values: zstd shrinks it, so the compressed seeds really go through the codec.
    out = bytearray()
    while len(out) < n:
        out += bytes([rng.randrange(256)]) * rng.randrange(1, 64) + rng.randbytes(rng.randrange(0, 8))
    return bytes(out[:n])


def make_seeds(seed: int = 0) -> list[Seed]:
    """Valid files of several layouts, sizes and every codec; payload sizes all differ (see swaps)."""
    rng = random.Random(seed)
    specs = [
        ("mla3", K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V2-Lite", "bfloat16",
                                           [f"model.layers.{i}.self_attn.attn" for i in range(3)], 16, 64)),
        ("mla2x2", K.CanonicalLayout.uniform("org/m", "float16", ["a", "b"], 8, 40, blocks_per_chunk=2)),
        ("fp8", K.CanonicalLayout.uniform("org/fp8", "fp8_ds_mla", ["l0"], 4, 656)),
        # 300 layers: the header spans more than the first 8 KiB read (FIRST_READ)
        ("wide", K.CanonicalLayout.uniform("org/wide", "bfloat16", [f"layer.{i}" for i in range(300)], 1, 2)),
        # sealed (spec §12): the tag and, for encrypt, the in-place decryption are on every reader's path
        ("auth", K.CanonicalLayout.uniform("org/sealed", "bfloat16", ["a", "b"], 8, 36, seal="authenticate")),
        ("enc", K.CanonicalLayout.uniform("org/sealed", "bfloat16", ["a", "b"], 8, 44, seal="encrypt")),
    ]
    keys = K.Keyring.of([rng.randbytes(32)])
    seeds = []
    for name, lay in specs:
        for codec in ("none",) if lay.seal else ("none", "zstd", "planes"):
            key = K.BlockKey(rng.randbytes(32).hex())
            pay = _payload(rng, lay.payload_bytes, codec != "none")
            ring = keys if lay.seal else None
            hdr, data = K.encode(pay, lay, key, codec=codec, provenance=K.Provenance(writer="fuzz", created=1),
                                 keys=ring)
            seeds.append(Seed(f"{name}.{codec}", lay, key, pay, bytes(hdr) + bytes(data), codec, ring))
    sizes = [s.layout.payload_bytes for s in seeds if s.codec == "none"]
    assert len(set(sizes)) == len(sizes), sizes
    return seeds


# -- helpers to rebuild files after a mutation -------------------------------------------------------

def fix_hxxh3(buf: bytes) -> bytes:
    """Recompute the header checksum as a writer would; unchanged when the prefix is too broken."""
    if len(buf) < 8:
        return buf
    end = 8 + _U64.unpack_from(buf, 0)[0]
    if end > len(buf):
        return buf
    try:
        pos = _hxxh3_pos(buf[:end])
    except K.KVFormatError:
        return buf
    region = bytearray(buf[:end])
    region[pos:pos + HEX64_LEN] = HEX64_ZERO
    region[pos:pos + HEX64_LEN] = xxhash.xxh3_64_hexdigest(bytes(region)).encode()
    return bytes(region) + buf[end:]


class Pairs(list):  # type: ignore[type-arg]
    """A JSON object written from (key, value) pairs: lets a case repeat keys."""


class Raw(bytes):
    """Bytes spliced into the JSON text as they are (deep nesting, invalid UTF-8 …)."""


def dumps(obj: Any) -> bytes:
    if isinstance(obj, Raw):
        return bytes(obj)
    if isinstance(obj, Pairs):
        return b"{" + b",".join(dumps(k) + b":" + dumps(v) for k, v in obj) + b"}"
    if isinstance(obj, dict):
        return dumps(Pairs(obj.items()))
    if isinstance(obj, list):
        return b"[" + b",".join(dumps(x) for x in obj) + b"]"
    return json.dumps(obj, ensure_ascii=False).encode()


def assemble(doc: Any, data: bytes, *, fix: bool = True, pad: bytes = b" ", n: int | None = None) -> bytes:
    body = dumps(doc)
    total = -(-(8 + len(body)) // ALIGNMENT) * ALIGNMENT
    npad = total - 8 - len(body)
    padding = (pad * (npad // max(1, len(pad)) + 1))[:npad]
    buf = _U64.pack(total - 8 if n is None else n) + body + padding + data
    return fix_hxxh3(buf) if fix else buf


def parse(seed: Seed) -> tuple[dict[str, Any], bytes]:
    return json.loads(seed.file[8:seed.json_end]), seed.file[seed.hdr_end:]


def _with_data(doc: dict[str, Any], data: bytes) -> dict[str, Any]:
    """Point a compressed header at new stored bytes (size and data checksum), so the codec sees them."""
    name = "kvf.planes" if "kvf.planes" in doc else "kvf.zstd"
    doc[name] = {"dtype": "U8", "shape": [len(data)], "data_offsets": [0, len(data)]}
    doc["__metadata__"]["kvf.dxxh3"] = xxhash.xxh3_64_hexdigest(data)
    return doc


def _boundaries(seed: Seed) -> list[int]:
    f = seed.file
    hx = f.find(b'"kvf.hxxh3":"') + 13
    marks = {0, 1, 7, 8, 9, 8 + 10, 8 + 29, hx, hx + 8, hx + 16, seed.json_end - 1, seed.json_end,
             (seed.json_end + seed.hdr_end) // 2, seed.hdr_end - 1, seed.hdr_end, seed.hdr_end + 1,
             (seed.hdr_end + len(f)) // 2, len(f) - 1}
    for key in (b'"kvf.codec"', b'"kvf.dxxh3"', b'"kvf.key"', b'"kvf.layers"', b'"data_offsets"', b'"shape"'):
        i = f.find(key)
        if i > 0:
            marks.update({i, i + len(key)})
    if seed.codec == "zstd":  # inside the frame header, the first block, the end
        marks.update(seed.hdr_end + d for d in (4, 5, 6, 9, 12, 20))
    if seed.codec == "planes":  # each plane's start and end, inside each frame's header
        pos = seed.hdr_end
        for _, n in json.loads(parse(seed)[0]["__metadata__"]["kvf.plane_table"]):
            marks.update(pos + d for d in (0, 4, 5, 6, 9, n - 1, n))
            pos += n
    return sorted(m for m in marks if 0 <= m < len(f))


# -- raw mutations ----------------------------------------------------------------------------------

def m_bitflip(rng: random.Random, s: Seed, seeds: list[Seed]) -> bytes:
    b = bytearray(s.file)
    hi = s.hdr_end if rng.random() < 0.6 else len(b)
    for _ in range(rng.choice((1, 1, 1, 2, 3, 8))):
        b[rng.randrange(hi)] ^= 1 << rng.randrange(8)
    return bytes(b)


def m_byterun(rng: random.Random, s: Seed, seeds: list[Seed]) -> bytes:
    b = bytearray(s.file)
    start = rng.choice((rng.randrange(len(b)), rng.randrange(s.hdr_end), rng.choice(_boundaries(s))))
    n = min(rng.choice((1, 2, 4, 8, 16, 64, 512)), len(b) - start)
    fill = rng.choice((b"\x00", b"\xff", b" ", b'"', b"{", b"[", b"9", b"\\", None))
    b[start:start + n] = rng.randbytes(n) if fill is None else fill * n
    return bytes(b)


def m_truncate(rng: random.Random, s: Seed, seeds: list[Seed]) -> bytes:
    cut = rng.choice(_boundaries(s)) + rng.choice((0, 0, 0, -1, 1, 3))
    return s.file[:max(0, min(cut, len(s.file) - 1))]


def m_length(rng: random.Random, s: Seed, seeds: list[Seed]) -> bytes:
    n = s.hdr_end - 8
    v = rng.choice((0, 1, 7, 8, ALIGNMENT - 8, n - ALIGNMENT, n - 1, n + 1, n + ALIGNMENT, len(s.file) - 8,
                    len(s.file), len(s.file) + ALIGNMENT - 8, MAX_HEADER_BYTES, MAX_HEADER_BYTES - 8,
                    MAX_HEADER_BYTES + ALIGNMENT - 8, 1 << 31, (1 << 63) - 8, (1 << 64) - 1, (1 << 64) - 8))
    v %= 1 << 64
    if v == n:
        v = 0
    b = _U64.pack(v) + s.file[8:]
    return fix_hxxh3(b) if rng.random() < 0.5 else b  # both: raw, and checksum made to fit the new N


def m_extend(rng: random.Random, s: Seed, seeds: list[Seed]) -> bytes:
    extra = rng.choice((b"\x00", b" ", rng.randbytes(rng.randrange(1, 64)), b"\x00" * ALIGNMENT))
    at = rng.choice((len(s.file), s.hdr_end, s.json_end, rng.randrange(len(s.file))))
    return s.file[:at] + extra + s.file[at:]


def m_splice(rng: random.Random, s: Seed, seeds: list[Seed]) -> bytes:
    o = rng.choice([x for x in seeds if x is not s])
    cut = rng.choice(_boundaries(s))
    return s.file[:cut] + o.file[cut:] if cut < len(o.file) else s.file[:cut]


def m_garbage(rng: random.Random, s: Seed, seeds: list[Seed]) -> bytes:
    return rng.choice((b"", b"\x00" * 8, s.file[:8], rng.randbytes(rng.randrange(1, 9000)),
                       s.file[8:], s.file[s.hdr_end:], b"\x00" * len(s.file)))


# -- adversarial mutations (checksums recomputed) -----------------------------------------------------

def _deep(rng: random.Random) -> Raw:
    depth = rng.choice((100, 1000, 5000, 50_000, 200_000))
    o, c = rng.choice(((b"[", b"]"), (b'{"a":', b"}")))
    return Raw(o * depth + b"0" + c * depth)


def _bad_value(rng: random.Random) -> Any:
    """A value no __metadata__ field accepts (every field is a non-empty, bounded, control-free string)."""
    return rng.choice((None, 1, -1, 1.5, True, [], {}, ["a"], {"a": "b"}, "x" * 300, "\u0001a",
                       "x" * rng.choice((10_000, 500_000)), _deep(rng), Raw(b'"\xff\xfe"'), Raw(b'"\\ud800"'),
                       Raw(b"1" * 5000), Raw(b"1e999"), Raw(b"NaN"), Raw(b"-Infinity")))


def a_meta_value(rng: random.Random, s: Seed, seeds: list[Seed]) -> bytes:
    doc, data = parse(s)
    keys = [k for k in doc["__metadata__"] if k not in ("kvformat", "kvf.hxxh3")]
    doc["__metadata__"][rng.choice(keys)] = _bad_value(rng)
    return assemble(doc, data)


def a_meta_delete(rng: random.Random, s: Seed, seeds: list[Seed]) -> bytes:
    doc, data = parse(s)
    keys = [k for k in doc["__metadata__"] if k not in ("kvformat", "kvf.hxxh3")]
    del doc["__metadata__"][rng.choice(keys)]
    return assemble(doc, data)


def a_dup_key(rng: random.Random, s: Seed, seeds: list[Seed]) -> bytes:
    doc, data = parse(s)
    meta = doc["__metadata__"]
    where = rng.randrange(3)
    if where == 0:  # a repeated metadata key, same or different value
        k = rng.choice([k for k in meta if k != "kvformat"])
        doc["__metadata__"] = Pairs(list(meta.items()) + [(k, rng.choice((meta[k], "x", "0")))])
    elif where == 1:  # a repeated tensor name
        name = rng.choice([k for k in doc if k != "__metadata__"])
        doc = Pairs(list(doc.items()) + [(name, doc[name])])
    else:  # a second __metadata__ or a repeated key inside a tensor entry
        if rng.random() < 0.5:
            doc = Pairs(list(doc.items()) + [("__metadata__", meta)])
        else:
            name = rng.choice([k for k in doc if k != "__metadata__"])
            doc[name] = Pairs(list(doc[name].items()) + [("dtype", doc[name]["dtype"])])
    return assemble(doc, data)


# A ~1 MB shape list of large dimensions: its product grows with every factor, so a parser that multiplies
# before it checks the list's length does quadratic work (10-16 s of GIL for one header, G-1.4).
LONG_SHAPE = [(1 << 62) + 1] * 50_000


def long_shape(s: Seed) -> bytes:
    """``s`` with its first tensor's shape replaced by LONG_SHAPE (header checksum recomputed)."""
    doc, data = parse(s)
    name = next(k for k in doc if k != "__metadata__")
    doc[name]["shape"] = [doc[name]["shape"][0], *LONG_SHAPE]
    return assemble(doc, data)


def a_json_bomb(rng: random.Random, s: Seed, seeds: list[Seed]) -> bytes:
    doc, data = parse(s)
    bomb = rng.choice((_deep(rng), "x" * rng.choice((100_000, 900_000)), [0] * 100_000,
                       {f"k{i}": i for i in range(20_000)}, LONG_SHAPE))
    where = rng.randrange(4)
    if where == 0:  # an unknown key may hold any string (newer minor): only a non-string bomb is invalid there
        meta = doc["__metadata__"]
        if isinstance(bomb, str):
            meta[rng.choice([k for k in meta if k not in ("kvformat", "kvf.hxxh3")])] = bomb
        else:
            meta["kvf.bomb"] = bomb
    elif where == 1:
        doc["bomb"] = bomb
    elif where == 2:
        name = rng.choice([k for k in doc if k != "__metadata__"])
        doc[name][rng.choice(("shape", "data_offsets", "dtype"))] = bomb
    else:  # a giant key or tensor name
        doc[Raw(dumps("n" * rng.choice((300, 100_000))))] = {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
    return assemble(doc, data)


def a_tensors(rng: random.Random, s: Seed, seeds: list[Seed]) -> bytes:
    """Tensor tables that do not tile the data: overlaps, holes, out of range, wrong types/shapes."""
    doc, data = parse(s)
    names = [k for k in doc if k != "__metadata__"]
    name = rng.choice(names)
    t = doc[name]
    a, b = t["data_offsets"]
    kind = rng.randrange(12)
    if kind == 0:
        t["data_offsets"] = [a + 1, b + 1]
    elif kind == 1:
        t["data_offsets"] = [max(0, a - 2), b - 2]
    elif kind == 2:
        t["data_offsets"] = [a, b + rng.choice((1, 4096, 1 << 40, 1 << 70))]
    elif kind == 3:
        t["data_offsets"] = [-1, b - a - 1]
    elif kind == 4:
        t["data_offsets"] = rng.choice(([a], [a, b, b], [float(a), float(b)], [str(a), str(b)], None, [True, b]))
    elif kind == 5:
        t["shape"] = rng.choice(([], [-1] + t["shape"][1:], [t["shape"][0] * 2] + t["shape"][1:], [1 << 62, 1 << 62],
                                 t["shape"] + [1, 0], [0], [1.0] * len(t["shape"]), "16"))
    elif kind == 6:
        t["dtype"] = rng.choice(("F128", "", "bf16", None, 2, "U8\u0000"))
    elif kind == 7:  # an extra tensor (beyond or over the data)
        doc["kvf.extra" if rng.random() < 0.5 else "extra"] = {"dtype": "U8", "shape": [8],
                                                                "data_offsets": rng.choice(([b, b + 8], [0, 8], [len(data), len(data) + 8]))}
    elif kind == 8:
        del doc[name]
    elif kind == 9:  # too many tensors
        for i in range(rng.choice((1025, 3000))):
            doc[f"t{i}"] = {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
    elif kind == 10:
        doc[name] = rng.choice(([], "x", None, {"dtype": "U8"}, {**t, "extra": 1}))
    else:  # two tensors swap their ranges (overlap-free but names point at other bytes; sizes must differ to fail)
        others = [n for n in names if n != name and doc[n]["shape"] != t["shape"]]
        if others:
            o = doc[rng.choice(others)]
            t["data_offsets"], o["data_offsets"] = o["data_offsets"], t["data_offsets"]
        else:
            t["data_offsets"] = [b, a]
    return assemble(doc, data)


def a_swap(rng: random.Random, s: Seed, seeds: list[Seed]) -> bytes:
    """Headers and payloads of two different valid files combined."""
    o = rng.choice([x for x in seeds if x is not s])
    kind = rng.randrange(4)
    if kind == 0:  # a valid header over another block's payload
        return s.file[:s.hdr_end] + o.file[o.hdr_end:]
    if kind == 1:  # same layout, another block's payload (and size): only the data checksum can tell
        other = _payload(rng, len(s.payload), s.codec != "none")
        hdr, data = K.encode(other, s.layout, s.key, codec=s.codec, keys=s.keys)
        return s.file[:s.hdr_end] + bytes(data)
    sd, sdata = parse(s)
    od, odata = parse(o)
    if kind == 2:  # metadata of one file, tensor table of the other (checksum fixed)
        doc = {"__metadata__": sd["__metadata__"], **{k: v for k, v in od.items() if k != "__metadata__"}}
        return assemble(doc, rng.choice((sdata, odata)))
    # layout fields of the other file over this file's tensors and data. Not kv_dtype: it is a label
    # (packed dtypes are U8), and not kvf.layers on an uncompressed file: it is only read when compressed.
    sm, om = sd["__metadata__"], od["__metadata__"]
    differ = [k for k in ("kvf.tokens_per_block", "kvf.blocks_per_chunk", "kvf.codec") + (("kvf.layers",) if s.codec != "none" else ())
              if k in om and om[k] != sm.get(k)]
    if differ:
        k = rng.choice(differ)
        sm[k] = om[k]
    else:
        sm["kvf.codec"] = "none" if s.codec == "zstd" else "zstd"
    return assemble(sd, sdata)


def _fcs_pos(frame: bytes) -> tuple[int, int]:
    fhd = frame[4]
    single = (fhd >> 5) & 1
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3]
    return pos, ((1 if single else 0), 2, 4, 8)[fhd >> 6]


def a_zstd(rng: random.Random, s: Seed, seeds: list[Seed]) -> bytes:
    """Compressed frames that are truncated, lie about their size, or decode to the wrong bytes.

    The data checksum is recomputed each time, so the codec itself has to catch them.
    """
    if s.codec != "zstd":
        s = rng.choice([x for x in seeds if x.codec == "zstd"])
    doc, frame = parse(s)
    n = len(s.payload)
    z = zstandard.ZstdCompressor(level=3, write_content_size=True)
    kind = rng.randrange(11)
    if kind == 0:
        new = frame[:rng.choice((0, 1, 4, 5, 6, len(frame) // 2, len(frame) - 1, len(frame) - 3))]
    elif kind == 1:  # declares fewer or more bytes than the layout needs
        new = z.compress(s.payload[:n - rng.choice((1, 7, n // 2))] if rng.random() < 0.5 else s.payload + b"\x00" * rng.choice((1, 4096)))
    elif kind == 2:  # declares exactly the layout's size but holds less or more
        inner = s.payload[:n - rng.choice((1, 100))] if rng.random() < 0.5 else s.payload + b"\x00" * 100
        b = bytearray(z.compress(inner))
        pos, size = _fcs_pos(bytes(b))
        val = n - 256 if size == 2 else n
        if size and val < 1 << (8 * size):
            b[pos:pos + size] = val.to_bytes(size, "little")
        new = bytes(b)
    elif kind == 3:  # the frame header claims an enormous size
        b = bytearray(frame)
        pos, size = _fcs_pos(frame)
        if size:
            b[pos:pos + size] = b"\xff" * size
        new = bytes(b)
    elif kind == 4:  # no content size in the frame header
        new = zstandard.ZstdCompressor(level=3, write_content_size=False).compress(s.payload)
    elif kind == 5:  # right size, wrong content: only raw_xxh3 can tell
        new = z.compress(_payload(rng, n, True))
    elif kind == 6:  # bit flips inside the compressed blocks
        b = bytearray(frame)
        for _ in range(rng.choice((1, 2, 8))):
            b[rng.randrange(6, len(b))] ^= 1 << rng.randrange(8)
        new = bytes(b)
    elif kind == 7:  # trailing bytes, or a second frame
        new = frame + rng.choice((b"\x00", frame, rng.randbytes(16)))
    elif kind == 8:  # a skippable frame, or not zstd at all
        new = rng.choice((bytes.fromhex("502a4d18") + (8).to_bytes(4, "little") + b"12345678" + frame,
                          rng.randbytes(len(frame)), s.payload))
    elif kind == 9:  # kvf.layers claims another (possibly huge) decoded size
        meta = doc["__metadata__"]
        tpb = s.layout.tokens_per_block
        meta["kvf.layers"] = json.dumps(rng.choice((
            [["x", "U8", [tpb, (1 << 32) // tpb]]], [["x", "U8", [tpb, 1]]], [["x", "F64", [tpb, 4096, 4096]]],
            [["x", "U8", [tpb, 0]]], [["x", "U8", [tpb + 1, 8]]], [], "x", [["x", "U8"]], [[1, 2, 3]])))
        new = frame
    else:  # wrong level / checksums that do not parse
        doc["__metadata__"][rng.choice(("kvf.level", "kvf.raw_xxh3"))] = rng.choice(("23", "-1", "ZZ", "0" * 17, "0x1"))
        new = frame
    if new == frame and kind not in (9, 10):
        new = frame[:-1]
    return assemble(_with_data(doc, new), new)


def a_planes(rng: random.Random, s: Seed, seeds: list[Seed]) -> bytes:
    """Plane-coded files (spec §6.2) whose plane table or planes lie: sizes, methods, plane count, frames cut,
    swapped, lying about their size or decoding to other bytes. The data checksum is recomputed each time, so
    the table check and the codec themselves have to catch them."""
    if s.codec != "planes":
        s = rng.choice([x for x in seeds if x.codec == "planes"])
    doc, data = parse(s)
    meta = doc["__metadata__"]
    table = json.loads(meta["kvf.plane_table"])
    parts, pos = [], 0
    for _, n in table:
        parts.append(data[pos:pos + n])
        pos += n
    w, n = len(table), len(s.payload)
    i = rng.randrange(w)
    z = zstandard.ZstdCompressor(level=1, write_content_size=True)
    kind = rng.randrange(9)
    if kind == 0:  # one plane cut, extended or emptied, its size in the table kept or followed
        parts[i] = rng.choice((parts[i][:len(parts[i]) // 2], parts[i][:-1], parts[i] + b"\0", b""))
        if rng.random() < 0.7:
            table[i][1] = len(parts[i])
    elif kind == 1:  # a method relabelled (raw <-> zstd), or one the spec does not name
        table[i][0] = rng.choice(("zstd" if table[i][0] == "raw" else "raw", "lz4", "", 1, None))
    elif kind == 2:  # another plane count: planes merged, split or dropped
        table = rng.choice((table[:-1], table + [["raw", 0]], [["raw", n]], [["zstd", len(data)]],
                            [["raw", n // 8]] * 8, [["raw", 1]] * 9, []))
    elif kind == 3:  # a frame that declares another plane size, or holds another one under the right size
        body = s.payload[i::w]
        new = z.compress(rng.choice((body[:-1], body + b"\0", body[: len(body) // 2])))
        if rng.random() < 0.5 and len(new) > 6:
            b = bytearray(new)
            p, size = _fcs_pos(new)
            val = len(body)
            if size and val < 1 << (8 * size):
                b[p:p + size] = val.to_bytes(size, "little")
            new = bytes(b)
        parts[i], table[i] = new, ["zstd", len(new)]
    elif kind == 4:  # planes in another order (same sizes): only kvf.raw_xxh3 can tell
        order = list(range(w))
        rng.shuffle(order)
        parts, table = [parts[j] for j in order], [table[j] for j in order]
    elif kind == 5:  # the right sizes, other bytes in one plane
        body = _payload(rng, n // w, True)
        parts[i] = z.compress(body) if table[i][0] == "zstd" else body
        table[i][1] = len(parts[i])
    elif kind == 6:  # bit flips inside one stored plane
        b = bytearray(parts[i])
        for _ in range(rng.choice((1, 2, 8))):
            if b:
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        parts[i] = bytes(b)
    elif kind == 7:  # a table that is not the spec's syntax
        meta["kvf.plane_table"] = rng.choice(("", "[", "{}", "[[\"raw\"]]", '[["raw", -1]]', '[["raw", 1.5]]',
                                              '[["raw", true]]', "[" * 5000, '[["raw", "%d"]]' % n,
                                              json.dumps([["raw", n // w]] * w + [["raw", 0]] * 8)))
        return assemble(_with_data(doc, data), data)
    else:  # the plane table dropped, or put on another codec
        if rng.random() < 0.5:
            del meta["kvf.plane_table"]
        else:
            meta["kvf.codec"] = rng.choice(("zstd", "none"))
        return assemble(_with_data(doc, data), data)
    meta["kvf.plane_table"] = json.dumps(table, separators=(",", ":"))  # as written: a no-op stays the same file
    new = b"".join(parts)
    return assemble(_with_data(doc, new), new)


def a_padding(rng: random.Random, s: Seed, seeds: list[Seed]) -> bytes:
    """Non-space padding, padding inside the JSON, JSON that is not one object."""
    doc, data = parse(s)
    kind = rng.randrange(5)
    if kind == 0:
        return assemble(doc, data, pad=rng.choice((b"\x00", b"\t", b"\n", b"x", b" \x00")))
    if kind == 1:
        body = dumps(doc)
        return assemble(Raw(body + rng.choice((b",", b"}", b" {}", b"[", b"\x00", b" 1"))), data)
    if kind == 2:
        body = dumps(doc)
        return assemble(Raw(body[:-rng.choice((1, 2, 10))]), data)
    if kind == 3:  # header region shorter/longer than the JSON + a page, checksum fixed for the new N
        b = assemble(doc, data, fix=False)
        n = _U64.unpack_from(b, 0)[0]
        return fix_hxxh3(_U64.pack(max(0, n + rng.choice((-ALIGNMENT, ALIGNMENT)))) + b[8:])
    return assemble(Raw(b'{"__metadata__":{"kvformat":"1.0","kvf.hxxh3":"' + b"0" * 16 + b'"}}'), data)


def a_version(rng: random.Random, s: Seed, seeds: list[Seed]) -> bytes:
    body, data = s.file[8:s.json_end], s.file[s.hdr_end:]
    v = rng.choice((b"2.0", b"0.9", b"1", b"1.x", b"99999.0", b"", b"1.0.0", b"\xff.0", b"-1.0"))
    return assemble(Raw(body.replace(b'"kvformat":"1.0"', b'"kvformat":"' + v + b'"', 1)), data)


RAW: dict[str, Callable[..., bytes]] = {
    "bitflip": m_bitflip, "byterun": m_byterun, "truncate": m_truncate, "length": m_length,
    "extend": m_extend, "splice": m_splice, "garbage": m_garbage,
}
ADV: dict[str, Callable[..., bytes]] = {
    "meta_value": a_meta_value, "meta_delete": a_meta_delete, "dup_key": a_dup_key, "json_bomb": a_json_bomb,
    "tensors": a_tensors, "swap": a_swap, "zstd": a_zstd, "planes": a_planes, "padding": a_padding,
    "version": a_version,
}
MUTATORS = {**RAW, **ADV}


def systematic(seeds: list[Seed]) -> list[tuple[str, bytes]]:
    """Deterministic cases run first: truncation at every region boundary, every pair swap, a 1 MB shape list."""
    out = []
    for s in seeds:
        out.append(("json_bomb", long_shape(s)))
        for cut in _boundaries(s):
            out.append(("truncate", s.file[:cut]))
        for o in seeds:
            if o is not s:
                out.append(("swap", s.file[:s.hdr_end] + o.file[o.hdr_end:]))
    return out


# -- the checks ----------------------------------------------------------------------------------------

class Failure(Exception):
    pass


def _check_dst(dst: bytearray, where: str) -> None:
    # Untouched (all sentinel) or explicitly invalidated (zero-filled); anything else is leaked bytes.
    if dst.translate(None, bytes((SENTINEL, 0))):
        raise Failure(f"{where}: destination holds bytes that are neither the sentinel nor zero")


def check_case(data: bytes, seed: Seed, path: str, dst: bytearray, *, expect: bool, o_direct: bool,
               verify: bool = True, stores: tuple[tuple[str, Any, str], ...] = ()) -> str:
    """Run one input through every reader; returns the error class name or raises Failure.

    A mutated file may only be accepted when it still means exactly the original: same layout, same
    key, and the reader put exactly the original payload into ``dst`` (e.g. a checksum-recomputed flip
    of a zstd bit that decodes to the same bytes, G-1.5). That returns "Equivalent"; any other accepted
    input is a failure.

    ``verify=False`` (checksums off): a reader may accept a file whose bytes it does not check, but it
    must still raise only kvformat errors and leave ``dst`` untouched or zeroed when it raises (F-5.5
    holds on every path and flag). ``stores``: (name, Store, relpath) triples holding the same bytes;
    each is read through ``Store.read_into`` too (the local and the fsspec backend).
    """
    reasons = []
    kw: dict[str, Any] = {"expect": seed.layout, "key": seed.key} if expect else {}
    kw["keys"] = seed.keys
    readers = ["decode", "read_into", "read_header"] + [f"store:{name}" for name, _, _ in stores]
    by_name = {f"store:{name}": (st, rel) for name, st, rel in stores}
    for where in readers:
        dst[:] = bytes((SENTINEL,)) * len(dst) if len(dst) < 4096 else _SENT[:len(dst)]
        try:
            if where == "decode":
                hdr, _ = K.decode(data, out=dst, verify=verify, **kw)
            elif where == "read_into":
                hdr = K.read_into(path, dst, o_direct=o_direct, verify=verify, **kw)
            elif where == "read_header":
                K.read_header(path, verify=verify)
                reasons.append("-")
                continue
            else:
                st, rel = by_name[where]
                hdr = st.read_into(rel, memoryview(dst), verify=verify, **kw)
        except K.KVFormatError as e:
            _check_dst(dst, where)
            reasons.append(type(e).__name__)
            continue
        except Hang:
            raise Failure(f"{where}: hang (per-case timer fired)") from None
        except Exception as e:  # the bug this tool exists to find
            raise Failure(f"{where}: {type(e).__name__}: {str(e)[:300]}") from None
        if not verify:
            reasons.append("Unverified")  # accepted unchecked bytes: allowed with checksums off
            continue
        if hdr.layout != seed.layout or hdr.key != seed.key or dst[:len(seed.payload)] != seed.payload:
            raise Failure(f"{where}: accepted an invalid file")
        reasons.append("Equivalent")
    if verify:
        for i, where in enumerate(readers):
            if where == "read_header" or i == 0:
                continue
            if reasons[i] != reasons[0] and "Equivalent" not in (reasons[0], reasons[i]):
                raise Failure(f"decode raised {reasons[0]}, {where} raised {reasons[i]}")
    return reasons[0]


_SENT = bytearray((SENTINEL,)) * (1 << 20)


def _stores(d: str) -> tuple[tuple[str, Any, str], ...]:
    """The same case through both backends: a LocalStore over ``d`` and an fsspec memory:// store."""
    from kvformat.storage import open_store

    out: list[tuple[str, Any, str]] = [("local", open_store(d), "case.kvf")]
    try:
        out.append(("fsspec", open_store(f"memory://kvf-fuzz-{os.getpid()}"), "case.kvf"))
    except ImportError:  # fsspec is a core dependency; without it only the local backend runs
        pass
    return tuple(out)


def run(cases: int, seed: int = 1, *, per_case_s: float = 10.0, tracemalloc_every: int = 97,
        save_failures: str | None = None, tmpdir: str | None = None, unverified: float = 0.25,
        backends: bool = True) -> dict[str, Any]:
    """Run ``cases`` cases; returns the summary (see module docstring).

    ``unverified``: the share of cases read with ``verify=False``; ``backends``: also read every case
    through a LocalStore and an fsspec (memory://) store.
    """
    rng = random.Random(seed)
    seeds = make_seeds(seed)
    dst = bytearray(max(len(s.payload) for s in seeds) + 64)
    summary: dict[str, Any] = {"cases": 0, "rejected": 0, "equivalent": 0, "skipped_unchanged": 0, "failures": [],
                               "by_error": {}, "by_mutator": {}, "max_tracemalloc_peak": 0,
                               "max_peak_over_input": 0.0, "max_case_s": 0.0, "seed": seed, "unverified_cases": 0}
    valid = {s.file for s in seeds}
    queue = systematic(seeds)
    names = list(MUTATORS)
    weights = [3 if n in ADV else 2 for n in names]
    old = signal.signal(signal.SIGALRM, _on_alarm)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvf-fuzz-", dir=tmpdir) as d:
        path = os.path.join(d, "case.kvf")
        stores = _stores(d) if backends else ()
        while summary["cases"] < cases:
            s = rng.choice(seeds)
            if queue:
                mname, data = queue.pop()
            else:
                mname = rng.choices(names, weights)[0]
                if mname in ("zstd", "planes") and s.codec != mname:  # the checks must know which file was mutated
                    s = rng.choice([x for x in seeds if x.codec == mname])
                data = MUTATORS[mname](rng, s, seeds)
            if data in valid:
                summary["skipped_unchanged"] += 1
                continue
            with open(path, "wb") as f:
                f.write(data)
            for name, st, rel in stores:
                if name != "local":  # the local store's file is case.kvf itself
                    st.put(rel, [data], overwrite=True)
            summary["cases"] += 1
            measure = tracemalloc_every and summary["cases"] % tracemalloc_every == 0
            if measure:
                tracemalloc.start()
            c0 = time.perf_counter()
            signal.setitimer(signal.ITIMER_REAL, per_case_s)
            try:
                verify = rng.random() >= unverified
                reason = check_case(data, s, path, dst, expect=rng.random() < 0.5, o_direct=rng.random() < 0.25,
                                    verify=verify, stores=stores)
                if not verify:
                    summary["unverified_cases"] += 1
                summary["equivalent" if reason in ("Equivalent", "Unverified") else "rejected"] += 1
                summary["by_error"][reason] = summary["by_error"].get(reason, 0) + 1
            except Failure as e:
                _record(summary, mname, s, data, str(e), save_failures)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                summary["max_case_s"] = max(summary["max_case_s"], time.perf_counter() - c0)
                if measure:
                    peak = tracemalloc.get_traced_memory()[1]
                    tracemalloc.stop()
                    summary["max_tracemalloc_peak"] = max(summary["max_tracemalloc_peak"], peak)
                    summary["max_peak_over_input"] = max(summary["max_peak_over_input"], peak / max(1, len(data)))
            summary["by_mutator"][mname] = summary["by_mutator"].get(mname, 0) + 1
    signal.signal(signal.SIGALRM, old)
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    summary["max_case_s"] = round(summary["max_case_s"], 3)
    summary["ru_maxrss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    summary["n_failures"] = len(summary["failures"])
    summary["failures"] = summary["failures"][:20]
    return summary


# -- metadata files: namespace.json and a legacy config.json, through the CLI -----------------------------

def _meta_trees(d: str) -> list[tuple[str, str, list[list[str]]]]:
    """(root, metadata file, CLI commands) for a kvformat namespace and a legacy vLLM fs-tier tree."""
    from kvformat import legacy
    from kvformat.format._paths import NAMESPACE_FILE
    from kvformat.storage import open_store

    lay = K.CanonicalLayout.uniform("org/meta", "bfloat16", ["l0", "l1"], 4, 8)
    kroot = os.path.join(d, "kvf")
    st = open_store(kroot)
    ns = st.ensure_namespace(lay)
    st.put_block(bytes(lay.payload_bytes), lay, K.BlockKey("ab" * 32))
    lroot = os.path.join(d, "legacy")
    fields = legacy.legacy_fields("org/meta", tokens_per_hash=4, blocks_per_file=1, dtype="bfloat16",
                                  kv_cache_groups=[{"tokens_per_block": 4, "layer_names": ["l0", "l1"]}], tp=2)
    legacy.write_legacy_row(lroot, fields, "cd" * 32, bytes(2 * lay.payload_bytes))
    cfg, _ = legacy.legacy_paths(lroot, fields, "cd" * 32)
    out = os.path.join(d, "out")
    return [(kroot, os.path.join(kroot, ns, NAMESPACE_FILE),
             [["inspect", kroot, "--json"], ["verify", kroot, "--json"]]),
            (lroot, cfg, [["inspect", lroot, "--json"], ["verify", lroot, "--json"],
                          ["compact", lroot, out, "--dry-run", "--json"]])]


_BAD_VALUES: list[Any] = ["", "x", None, 0, -1, 1 << 70, 1.5, True, [], {}, [1, 2], {"a": 1}, "\u0000", "é" * 300]


def _mutate_json(rng: random.Random, doc: Any) -> bytes:
    """One hostile edit of a metadata document: a wrong-typed value, a deleted or renamed key, or raw bytes."""
    kind = rng.random()
    text = json.dumps(doc).encode()
    if kind < 0.15:  # byte level: truncation, a flipped byte, invalid UTF-8, an empty file
        i = rng.randrange(len(text))
        return rng.choice([text[:i], text[:i] + bytes([text[i] ^ (1 << rng.randrange(8))]) + text[i + 1:],
                           text[:i] + b"\xff\xfe" + text[i:], b"", b"[]", b"null", b"{" * 5000])
    doc = json.loads(text)
    # walk to a random container
    node, parent, key = doc, None, None
    for _ in range(rng.randrange(4)):
        if isinstance(node, dict) and node:
            parent, key = node, rng.choice(list(node))
        elif isinstance(node, list) and node:
            parent, key = node, rng.randrange(len(node))
        else:
            break
        node = parent[key]
    if parent is None:
        return json.dumps(rng.choice(_BAD_VALUES)).encode() if kind < 0.2 else json.dumps(
            {k: rng.choice(_BAD_VALUES) if rng.random() < 0.3 else v for k, v in doc.items()}
            if isinstance(doc, dict) else doc).encode()
    if kind < 0.8:
        parent[key] = rng.choice(_BAD_VALUES)
    elif isinstance(parent, dict):
        if rng.random() < 0.5:
            del parent[key]
        else:
            parent[str(key) + "_x"] = parent.pop(key)
    else:
        parent.insert(key, rng.choice(_BAD_VALUES))
    return json.dumps(doc, allow_nan=True).encode()


def run_metadata(cases: int, seed: int = 1, *, tmpdir: str | None = None, per_case_s: float = 10.0) -> dict[str, Any]:
    """Mutated namespace.json / legacy config.json under every read-only CLI command.

    The rule (issue 11): metadata is untrusted input. ``main()`` returns one of the documented exit codes
    (0 ok, 1 bad files, 2 usage or I/O error), its ``--json`` output parses, and no exception escapes.
    """
    from kvformat.cli import main as cli

    rng = random.Random(seed)
    summary: dict[str, Any] = {"cases": 0, "failures": [], "by_exit": {}, "seed": seed}
    with tempfile.TemporaryDirectory(prefix="kvf-fuzz-meta-", dir=tmpdir) as d:
        trees = _meta_trees(d)
        originals = [json.loads(open(f, "rb").read()) for _, f, _ in trees]
        while summary["cases"] < cases:
            i = rng.randrange(len(trees))
            root, f, cmds = trees[i]
            data = _mutate_json(rng, originals[i])
            with open(f, "wb") as fh:
                fh.write(data)
            summary["cases"] += 1
            for argv in cmds:
                rc, msg = _cli_case(cli, argv, per_case_s)
                if msg:
                    _meta_failure(summary, argv, data, msg)
                else:
                    summary["by_exit"][str(rc)] = summary["by_exit"].get(str(rc), 0) + 1
            shutil.rmtree(os.path.join(d, "out"), ignore_errors=True)
    summary["n_failures"] = len(summary["failures"])
    summary["failures"] = summary["failures"][:20]
    return summary


def _cli_case(cli: Callable[[list[str]], int], argv: list[str], per_case_s: float) -> tuple[int, str]:
    """Run one CLI command in a forked child (a hang or a crash cannot take the fuzzer down).

    Returns (exit code, failure message or ""). The child dies by SIGALRM after ``per_case_s``.
    """
    import contextlib
    import io

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(max(1, int(per_case_s)))
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = cli(argv)
            msg = "" if rc in (0, 1, 2) else f"exit code {rc!r}"
            if not msg and out.getvalue().strip():
                json.loads(out.getvalue())
        except BaseException as e:  # noqa: BLE001 - a traceback is the failure this mode looks for
            rc, msg = -1, f"{type(e).__name__}: {str(e)[:200]}"
        os.write(w, json.dumps([rc, msg]).encode())
        os._exit(0)
    os.close(w)
    chunks = []
    while True:
        b = os.read(r, 65536)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return -1, f"hang (over {per_case_s:g} s)" if sig == signal.SIGALRM else f"killed by signal {sig}"
    try:
        rc, msg = json.loads(b"".join(chunks))
    except ValueError:
        return -1, "the child died without a result"
    return int(rc), str(msg)


def _meta_failure(summary: dict[str, Any], argv: list[str], data: bytes, msg: str) -> None:
    summary["failures"].append({"command": argv[0], "file": os.path.basename(argv[1]), "error": msg,
                                "input": data[:300].decode("utf-8", "replace")})


def _on_alarm(signum: int, frame: Any) -> None:
    raise Hang()


def _record(summary: dict[str, Any], mname: str, s: Seed, data: bytes, msg: str, save: str | None) -> None:
    digest = xxhash.xxh3_64_hexdigest(data)
    entry = {"mutator": mname, "seed": s.name, "input_xxh3": digest, "len": len(data), "error": msg}
    if save:
        os.makedirs(save, exist_ok=True)
        with open(os.path.join(save, f"{digest}.{s.name}.bin"), "wb") as f:
            f.write(data)
    summary["failures"].append(entry)


def limit_memory(mb: int) -> None:
    """Cap the address space at the current size + ``mb`` MiB: an unbounded allocation becomes MemoryError."""
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + (mb << 20), resource.RLIM_INFINITY))


def _run_jobs(args: argparse.Namespace) -> dict[str, Any]:
    """Split the cases over worker processes (each with its own seed and memory cap); merge their summaries."""
    import subprocess

    procs, outs = [], []
    with tempfile.TemporaryDirectory(prefix="kvf-fuzz-jobs-") as d:
        for i in range(args.jobs):
            n = args.cases // args.jobs + (i < args.cases % args.jobs)
            out = os.path.join(d, f"{i}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--cases", str(n), "--seed", str(args.seed * 100 + i),
                   "--per-case-s", str(args.per_case_s), "--mem-limit-mb", str(args.mem_limit_mb), "--json", out,
                   "--unverified", str(args.unverified)] + (["--no-backends"] if args.no_backends else [])
            cmd += ["--save-failures", args.save_failures] if args.save_failures else []
            cmd += ["--tmpdir", args.tmpdir] if args.tmpdir else []
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
            outs.append(out)
        for pr in procs:
            pr.wait()
        parts = [json.load(open(o)) for o in outs if os.path.exists(o)]
    merged: dict[str, Any] = {"seed": [x["seed"] for x in parts], "jobs": args.jobs, "failures": [],
                              "workers_without_summary": args.jobs - len(parts)}
    for x in parts:
        for k, v in x.items():
            if k in ("seed",):
                continue
            if k == "failures":
                merged[k] += v
            elif isinstance(v, dict):
                m = merged.setdefault(k, {})
                for kk, vv in v.items():
                    m[kk] = m.get(kk, 0) + vv
            elif k.startswith("max_") or k in ("seconds", "ru_maxrss_mb"):
                merged[k] = max(merged.get(k, 0), v)
            else:
                merged[k] = merged.get(k, 0) + v
    if merged["workers_without_summary"]:  # a worker died (a crash the fuzzer exists to find)
        merged["n_failures"] = merged.get("n_failures", 0) + merged["workers_without_summary"]
    return merged


def main(argv: list[str] | None = None) -> int:
    slow = os.environ.get("KVFORMAT_SLOW") == "1"
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", type=int, default=100_000 if slow else 2_000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--per-case-s", type=float, default=10.0, help="a case running longer counts as a hang")
    p.add_argument("--mem-limit-mb", type=int, default=512, help="address space allowed above start-up (0: none)")
    p.add_argument("--json", help="also write the summary here")
    p.add_argument("--save-failures", help="directory for failing inputs")
    p.add_argument("--tmpdir", help="where case files are written (default: the system temp dir)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (seeds SEED*100+i), summaries merged")
    p.add_argument("--unverified", type=float, default=0.25, help="share of cases read with verify=False")
    p.add_argument("--no-backends", action="store_true", help="skip the LocalStore/fsspec Store reads")
    p.add_argument("--metadata", action="store_true",
                   help="fuzz namespace.json and a legacy config.json through the CLI instead of block files")
    args = p.parse_args(argv)
    if args.metadata:
        summary = run_metadata(args.cases, args.seed, tmpdir=args.tmpdir, per_case_s=args.per_case_s)
        text = json.dumps(summary, indent=2, sort_keys=True)
        print(text)
        if args.json:
            with open(args.json, "w") as f:
                f.write(text + "\n")
        return 1 if summary["n_failures"] else 0
    if args.jobs > 1:
        summary = _run_jobs(args)
    else:
        if args.mem_limit_mb:
            limit_memory(args.mem_limit_mb)
        summary = run(args.cases, args.seed, per_case_s=args.per_case_s, save_failures=args.save_failures,
                      tmpdir=args.tmpdir, unverified=args.unverified, backends=not args.no_backends)
    text = json.dumps(summary, indent=2, sort_keys=True)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    ok = not summary.get("n_failures") and summary.get("rejected", 0) + summary.get("equivalent", 0) == args.cases
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
