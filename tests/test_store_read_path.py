"""The storage read/write path defect classes of issue 11, one test (or one group) per class.

Real parts only: real files on the local ext4, ``memory://``, the real moto S3 server on 127.0.0.1,
a real ``os.fork()``, the kernel's own I/O accounting (/proc/self/io) for O_DIRECT.
"""

from __future__ import annotations

import gc
import hashlib
import json
import mmap
import os
import select
import signal
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

import kvformat as K
from kvformat.format._block import decode
from kvformat import block_relpath
from kvformat.errors import KVFormatError, LayoutMismatchError
from kvformat.storage import LocalStore, Store, open_store
from kvformat.storage._fsspec import FsspecStore
from s3_server import S3Server, s3_bucket, s3_env, s3_server  # noqa: F401  (fixtures)

VECTORS = Path(__file__).resolve().parent.parent / "spec" / "vectors"
SENTINEL = 0x5A
OUT_BYTES = 1 << 20  # larger than every vector's payload: bytes past the payload must stay untouched

L = K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V2-Lite", "bfloat16",
                              [f"model.layers.{i}.self_attn.attn" for i in range(3)], 16, 576)


def _key(i: int) -> K.BlockKey:
    return K.BlockKey(hashlib.sha256(f"rp/{i}".encode()).hexdigest())


def _payload(i: int, n: int = L.payload_bytes) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)


def _plant(store: Store, rel: str, data: bytes) -> None:
    """Put raw bytes at ``rel`` without going through the store's write path."""
    if isinstance(store, LocalStore):
        p = Path(store.root) / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    else:
        assert isinstance(store, FsspecStore)
        store._fs.pipe_file(store._full(rel), data)
        store.forget()


# -- F-5.5 on every path, backend, codec and flag --------------------------------------------------
def _outcome(read: Callable[[bytearray], Any]) -> tuple[str, bytes]:
    out = bytearray([SENTINEL]) * OUT_BYTES
    try:
        read(out)
        kind = "ok"
    except KVFormatError as e:
        kind = type(e).__name__
    return kind, bytes(out)


def _assert_untouched_or_zeroed(out: bytes, what: str) -> None:
    """G-1.2: after an error ``out`` is untouched, or zero over a prefix (the payload) and untouched after."""
    z = len(out) - len(out.lstrip(b"\0"))
    assert out[z:] == bytes([SENTINEL]) * (len(out) - z), f"{what}: partly written bytes left in the destination"


def test_zero_on_failure_same_on_every_backend_codec_and_flag(tmp_path: Path, s3_bucket: str) -> None:
    """Every invalid vector (and every valid one), verify on and off, through the in-memory decoder, the
    local store (buffered and O_DIRECT) and the remote store (memory://, S3): the same error and the
    exact same destination bytes everywhere, and never partly written bytes after an error."""
    stores: dict[str, Store] = {
        "local": open_store(str(tmp_path / "buffered")),
        "local-o_direct": open_store(str(tmp_path / "direct"), o_direct="on"),
        "memory": open_store(f"memory://rp-{uuid.uuid4().hex[:10]}/root"),
        "s3": open_store(f"s3://{s3_bucket}/rp", timeout_s=20),
    }
    files = sorted(VECTORS.glob("invalid/*.kvf")) + sorted(VECTORS.glob("valid/*.kvf"))
    assert len(files) > 40
    for f in files:
        for st in stores.values():
            _plant(st, f"v/{f.name}", f.read_bytes())
    mmaps = []
    zero_filled = 0
    for f in files:
        exp = json.loads(f.with_suffix(".json").read_text())
        keys = K.Keyring.of(bytes.fromhex(k) for k in exp["keys"]) if exp.get("keys") else None  # sealed (§12)
        if f.parent.name != "invalid":
            exp = {}
        data = f.read_bytes()
        for verify in (True, False):
            got = {"decode": _outcome(lambda o: decode(data, o, verify=verify, keys=keys))}
            for name, st in stores.items():
                if name == "local-o_direct":  # O_DIRECT needs a page-aligned destination
                    mm = mmap.mmap(-1, OUT_BYTES)
                    mmaps.append(mm)

                    def read(o: bytearray, st: Store = st, mm: mmap.mmap = mm) -> None:
                        mm[:] = o
                        try:
                            st.read_into(f"v/{f.name}", memoryview(mm), verify=verify, keys=keys)
                        finally:
                            o[:] = mm[:]
                    got[name] = _outcome(read)
                else:
                    got[name] = _outcome(lambda o, st=st: st.read_into(f"v/{f.name}", o, verify=verify, keys=keys))
            kinds = {k: v[0] for k, v in got.items()}
            assert len(set(kinds.values())) == 1, f"{f.name} verify={verify}: {kinds}"
            # decode() may refuse before copying (its input is in memory); the stores read into out first.
            outs = {k: v[1] for k, v in got.items() if k != "decode"}
            assert len(set(outs.values())) == 1, f"{f.name} verify={verify}: destinations differ"
            kind, out = got["local"]
            if kind != "ok":
                for k, v in got.items():
                    _assert_untouched_or_zeroed(v[1], f"{k} {f.name} verify={verify}")
                if verify and exp.get("zero_filled"):
                    assert out[0] == 0
                    zero_filled += 1
            else:
                assert got["decode"][1] == out
            if f.name == "zstd-truncated-frame.kvf" and not verify:  # the case that left decoded bytes behind
                assert kind == "CodecError" and out[0] == 0 and got["decode"][1][0] == 0
    assert zero_filled >= 2
    for st in stores.values():
        st.close()


def test_zero_on_failure_of_a_zstd_decode_with_verify_off(tmp_path: Path) -> None:
    """A frame cut short decodes part of the payload before failing: with verify off the decoded part
    must not stay in the destination, and every reader zeroes exactly the payload range."""
    data = (VECTORS / "invalid" / "zstd-truncated-frame.kvf").read_bytes()
    hdr = K.read_header(VECTORS / "invalid" / "zstd-truncated-frame.kvf", verify=False)
    p = tmp_path / "t.kvf"
    p.write_bytes(data)
    for reader in (lambda o: K.read_into(p, o, verify=False), lambda o: decode(data, o, verify=False),
                   lambda o: open_store(str(tmp_path)).read_into("t.kvf", o, verify=False)):
        out = bytearray([SENTINEL]) * (hdr.raw_bytes + 100)
        with pytest.raises(K.errors.CodecError):
            reader(out)
        assert out == bytes(hdr.raw_bytes) + bytes([SENTINEL]) * 100


# -- O_DIRECT through the validated descriptor -----------------------------------------------------
def _read_bytes_io() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise AssertionError("no read_bytes in /proc/self/io")


def test_o_direct_branch_reads_through_the_validated_descriptor(tmp_path: Path) -> None:
    """The O_DIRECT branch runs (the kernel counts the payload as read from the device although the
    file sits in the page cache, which a buffered read would have served) and reads the one file whose
    header was checked."""
    st = open_store(str(tmp_path / "root"), o_direct="on")
    assert isinstance(st, LocalStore) and st.supports_o_direct
    rel = st.put_block(_payload(1), L, _key(1))[0]
    out = mmap.mmap(-1, L.payload_bytes)
    st.read_into(rel, memoryview(out), expect=L, key=_key(1))  # page cache now warm either way
    aligned = L.payload_bytes - L.payload_bytes % 4096
    before_io, before = _read_bytes_io(), st.stats["o_direct_bytes"]
    st.read_into(rel, memoryview(out), expect=L, key=_key(1))
    assert st.stats["o_direct_bytes"] - before == aligned
    assert _read_bytes_io() - before_io >= aligned  # bypassed the page cache: O_DIRECT really ran
    assert bytes(out) == _payload(1).tobytes()
    buffered = open_store(str(tmp_path / "root"))
    buffered.read_into(rel, memoryview(out))
    assert buffered.stats["o_direct_bytes"] == 0


def test_o_direct_header_and_payload_come_from_one_file(tmp_path: Path) -> None:
    """Files renamed over the path while it is read: every read returns a header and a payload of the
    same file (verify off, so nothing but the descriptor keeps them together)."""
    st = open_store(str(tmp_path / "root"), o_direct="on")
    rel = st.put_block(_payload(10), L, _key(10))[0]
    srcs = []
    for i in (10, 11):
        h, d = K.encode(_payload(i), L, _key(i))
        q = tmp_path / f"src{i}.kvf"
        q.write_bytes(h + bytes(d))
        srcs.append(q)
    dst = Path(st.root) / rel
    stop = threading.Event()

    def swapper() -> None:
        n = 0
        while not stop.is_set():
            tmp = dst.with_name(f".kvf-tmp-swap-{n}")
            os.link(srcs[n % 2], tmp)
            os.replace(tmp, dst)
            n += 1

    t = threading.Thread(target=swapper)
    t.start()
    out = mmap.mmap(-1, L.payload_bytes)
    try:
        for _ in range(300):
            hdr = st.read_into(rel, memoryview(out), verify=False)
            i = 10 if hdr.key == _key(10) else 11
            assert bytes(out) == _payload(i).tobytes(), "header of one file, payload of another"
    finally:
        stop.set()
        t.join()


def test_o_direct_fifo_at_the_path_never_blocks(tmp_path: Path) -> None:
    st = open_store(str(tmp_path / "root"), o_direct="on")
    (Path(st.root) / "ns").mkdir()
    os.mkfifo(Path(st.root) / "ns" / "f.kvf")
    with pytest.raises(K.errors.NotKVFormatError):
        st.read_into("ns/f.kvf", memoryview(mmap.mmap(-1, L.payload_bytes)))


# -- a timed-out remote put never reads the caller's buffer again ----------------------------------
def test_timed_out_put_never_reads_the_row_again(s3_env: S3Server) -> None:
    bucket = s3_env.make_bucket()
    st = open_store(f"s3://{bucket}/tp", timeout_s=1.5, max_retries=0, max_in_flight=1)
    assert isinstance(st, FsspecStore) and st.asynchronous
    for attempt in range(5):  # the session exists, so the paused server is what times out (a loaded
        try:                  # machine may miss the short deadline on this first, healthy PUT)
            st.put("warm.kvf", [b"x"])
            break
        except TimeoutError:
            if attempt == 4:
                raise
    rows = [_payload(20 + i) for i in range(4)]
    refs = [weakref.ref(r) for r in rows]
    kept = bytearray(rows[0].tobytes())
    items = [(f"ns/{i}.kvf", [K.encode(r, L, _key(20 + i))[0], r]) for i, r in enumerate(rows)]
    items.append(("ns/kept.kvf", [kept]))
    s3_env.pause()
    try:
        res = st.put_many(items)
        assert all(isinstance(r, TimeoutError) for r in res)
        del items, rows
        gc.collect()
        assert all(w() is None for w in refs), "the store still holds the caller's rows after returning"
        kept[:] = bytes(len(kept))  # vLLM reuses the slot
    finally:
        s3_env.resume()
    time.sleep(2.0)  # anything still queued on the loop would run now
    st.forget()
    try:
        stored = st.read_bytes("ns/kept.kvf")
    except FileNotFoundError:
        stored = None
    assert stored in (None, _payload(20).tobytes()), "a timed-out put uploaded bytes read after it returned"
    st.close()


# -- close() and fork ------------------------------------------------------------------------------
def _in_child(fn: Callable[[], bytes], within: float = 30.0) -> bytes:
    """Run ``fn`` in a forked child; its result through a pipe. Fails (and kills it) if it hangs."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            msg = b"ok:" + fn()
        except BaseException as e:  # noqa: BLE001  (reported to the parent)
            msg = f"error:{type(e).__name__}: {e}".encode()
        os.write(w, msg)
        os._exit(0)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], within)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError("the store hung in the forked child")
        chunks = []
        while True:
            b = os.read(r, 1 << 20)
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks)
    finally:
        os.close(r)
        os.waitpid(pid, 0)


@pytest.mark.parametrize("kind", ["memory", "s3"])
def test_store_built_before_fork_works_in_the_child(kind: str, request: pytest.FixtureRequest) -> None:
    if kind == "s3":
        bucket = request.getfixturevalue("s3_bucket")
        st = open_store(f"s3://{bucket}/fork", timeout_s=10)
    else:
        st = open_store(f"memory://fork-{uuid.uuid4().hex[:10]}/root", timeout_s=10)
    rel = st.put_block(_payload(30), L, _key(30))[0]  # loop thread and connections now exist

    def child() -> bytes:
        out = bytearray(L.payload_bytes)
        st.read_into(rel, out, expect=L, key=_key(30))
        st.put_block(_payload(31), L, _key(31))
        return bytes(out[:64])

    got = _in_child(child)
    assert got == b"ok:" + _payload(30).tobytes()[:64], got[:200]
    assert st.read_header(rel).key == _key(30)  # the parent's store still works after the child's rebuild
    if kind == "s3":  # the child's write reached the server
        assert st.read_header(block_relpath(L, _key(31))).key == _key(31)
    st.close()


def test_close_releases_and_refuses_later_calls(s3_bucket: str, tmp_path: Path) -> None:
    st = open_store(f"s3://{s3_bucket}/close")
    assert isinstance(st, FsspecStore)
    rel = st.put_block(_payload(40), L, _key(40))[0]
    assert st._fs._s3 is not None  # a client session is open
    with st:
        assert st.read_header(rel).key == _key(40)
    assert st.closed and st._fs._s3 is None
    st.close()  # idempotent
    for call in (lambda: st.read_header(rel), lambda: st.read_into(rel, bytearray(L.payload_bytes)),
                 lambda: st.put("x.kvf", [b"x"]), lambda: st.exists(rel), lambda: list(st.list())):
        with pytest.raises(ValueError, match="closed"):
            call()
    local = open_store(str(tmp_path))
    local.close()
    with pytest.raises(ValueError, match="closed"):
        local.read_header(rel)


# -- save_file checks each layer; load_file of mixed dtypes ----------------------------------------
def test_save_file_checks_each_layer_dtype_shape_and_size(tmp_path: Path) -> None:
    names = [l.name for l in L.layers]
    good = {n: torch.zeros(1, 16, 576, dtype=torch.bfloat16) for n in names}
    K.save_file(good, tmp_path / "ok.kvf", L, _key(50))
    bad_cases = {
        "fp16 tensors for a bf16 layout": ({**good, names[1]: good[names[1]].to(torch.float16)}, "dtype"),
        "a two-page layer and an empty one": ({**good, names[0]: torch.zeros(2, 16, 576, dtype=torch.bfloat16),
                                               names[2]: torch.zeros(0, 16, 576, dtype=torch.bfloat16)}, "shape"),
        "right size, wrong shape": ({**good, names[1]: torch.zeros(1, 576, 16, dtype=torch.bfloat16)}, "shape"),
        "a missing layer": ({n: good[n] for n in names[:2]}, names[2]),
        "an unknown layer": ({**good, "model.layers.9.self_attn.attn": good[names[0]]}, "layers"),
    }
    for what, (tensors, field) in bad_cases.items():
        with pytest.raises(LayoutMismatchError) as e:
            K.save_file(tensors, tmp_path / "bad.kvf", L, _key(50))
        assert field in e.value.field, what
        assert not (tmp_path / "bad.kvf").exists(), what
    with pytest.raises(LayoutMismatchError) as e:
        K.save_file({**good, names[1]: good[names[1]].to(torch.float16)}, tmp_path / "bad.kvf", L, _key(50))
    assert names[1] in e.value.field  # the error names the layer


def test_load_file_of_mixed_dtypes(tmp_path: Path) -> None:
    M = K.CanonicalLayout("m/mixed", "fp8_ds_mla", 3, 2, 3,
                          (K.LayerSpec("a", "U8", (3, 5)), K.LayerSpec("b", "F32", (3, 2)),
                           K.LayerSpec("c", "BF16", (3, 1)), K.LayerSpec("d", "F64", (3, 1))))
    t = {"a": torch.arange(30, dtype=torch.uint8).reshape(2, 3, 5), "b": torch.randn(2, 3, 2),
         "c": torch.randn(2, 3, 1).to(torch.bfloat16), "d": torch.randn(2, 3, 1, dtype=torch.float64)}
    K.save_file(t, tmp_path / "m.kvf", M, _key(60))
    back = K.load_file(tmp_path / "m.kvf", expect=M)
    assert list(back) == ["a", "b", "c", "d"]
    assert all(back[k].dtype == t[k].dtype and torch.equal(back[k], t[k]) for k in t)
