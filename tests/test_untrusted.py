"""Untrusted trees (issue 7): ``inspect``, ``verify`` (with ``--quarantine``), ``compact`` and ``gc`` on
trees holding symlinks that point outside, FIFOs, device nodes and odd file names.

Every command runs as a real process under a timeout (a FIFO opened for reading would block it).
"Nothing outside is read" is observed three ways on an OUTSIDE directory next to the tree: its
FIFO is watched by a thread that would notice any reader opening it, its regular files have their
atime set behind their mtime (ext4/relatime then records any read), and its bytes, names and modes
are compared before and after. The reports must be parseable JSON that names what was skipped.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import stat
import subprocess
import sys
import threading
import time

import pytest

import kvformat as K
from kvformat import block_relpath
from kvformat.legacy import ROW_ALIGN, legacy_fields, legacy_paths, write_legacy_row
from kvformat.storage import LocalStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "deepseek-ai/DeepSeek-V2-Lite"
CLI = [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); from kvformat.cli import main; "
       "sys.exit(main(sys.argv[2:]))", ROOT]


def _layout() -> K.CanonicalLayout:
    return K.CanonicalLayout.uniform(MODEL, "bfloat16", [f"model.layers.{i}.self_attn.attn" for i in range(2)], 16, 576)


def _h(i: int) -> str:
    return hashlib.sha256(f"untrusted/{i}".encode()).hexdigest()


class Outside:
    """A directory beside the tree that nothing may read or write."""

    def __init__(self, path: str) -> None:
        self.path = path
        os.makedirs(path)
        self.fifo = os.path.join(path, "fifo")
        os.mkfifo(self.fifo)
        os.makedirs(os.path.join(path, "q"))
        self.opened: list[str] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._watch, daemon=True)

    def add(self, name: str, data: bytes) -> str:
        p = os.path.join(self.path, name)
        with open(p, "wb") as f:
            f.write(data)
        return p

    def seal(self) -> None:
        """Set every file's atime behind its mtime (relatime then records a read) and snapshot."""
        for p in self._files():
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                os.utime(p, ns=(st.st_mtime_ns - 10**12, st.st_mtime_ns), follow_symlinks=False)
        self.before = self.snapshot()
        self._t.start()

    def _files(self) -> list[str]:
        return sorted(os.path.join(d, n) for d, ds, ns in os.walk(self.path) for n in ns + ds)

    def snapshot(self) -> dict[str, tuple]:
        out = {}
        for p in self._files():
            st = os.lstat(p)
            data = b""
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:  # our own read: atime is taken from st before it
                    data = f.read()
            out[os.path.relpath(p, self.path)] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_atime_ns,
                                                   hashlib.sha256(data).hexdigest())
        for p in self._files():  # undo our own read's atime change
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                os.utime(p, ns=(st.st_mtime_ns - 10**12, st.st_mtime_ns), follow_symlinks=False)
        return out

    def _watch(self) -> None:
        # Opening a FIFO for writing without blocking succeeds only while a reader has it open.
        while not self._stop.is_set():
            try:
                fd = os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as e:
                if e.errno != errno.ENXIO:
                    raise
                time.sleep(0.001)
                continue
            self.opened.append(self.fifo)
            os.close(fd)  # the reader sees EOF and does not hang

    def check(self) -> None:
        self._stop.set()
        self._t.join()
        assert self.opened == [], "a command opened the outside FIFO"
        after = self.snapshot()
        assert after.keys() == self.before.keys(), set(after) ^ set(self.before)
        for k in after:
            assert after[k] == self.before[k], f"outside {k} changed or was read: {self.before[k]} -> {after[k]}"


def _mknod_ok(path: str) -> bool:
    try:
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero: endless bytes if anyone reads
        return True
    except (PermissionError, OSError):
        return False


def _odd_names() -> list[bytes]:
    return [b"new\nline.kvf", b"\xff\xfe-not-utf8.kvf", b"-rf.kvf", b" lead space.kvf", "ünïcode.kvf".encode(),
            b"a" * 251 + b".kvf", b"..kvf", b".kvf", b"*?[glob].kvf", b"back\\slash.kvf"]


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + args, capture_output=True, timeout=timeout)


# -- kvformat roots ---------------------------------------------------------------------------------

def _hostile_root(tmp_path, *, fifo_doc: bool = False, link_doc: bool = False) -> tuple[str, Outside, dict]:
    """A kvformat root with every hazard; ``fifo_doc``/``link_doc`` add a namespace whose namespace.json is a
    FIFO / a symlink outside, and whose only file is corrupt (so a reader falls back to namespace.json)."""
    L = _layout()
    out = Outside(str(tmp_path / "OUTSIDE"))
    root = str(tmp_path / "root")
    st = LocalStore(root)
    st.ensure_namespace(L)
    ns = L.namespace()
    pays = {}
    for i in range(4):
        pays[i] = random.Random(i).randbytes(L.payload_bytes)
        st.put_block(pays[i], L, K.BlockKey(_h(i)))
    good = os.path.join(root, block_relpath(L, K.BlockKey(_h(0))))
    with open(good, "rb") as f:
        good_bytes = f.read()
    # A corrupt file in the tree (verify must report it, --quarantine must keep it inside the root).
    bad = os.path.join(root, block_relpath(L, K.BlockKey(_h(1))))
    raw = bytearray(open(bad, "rb").read())
    raw[-1] ^= 1
    open(bad, "wb").write(raw)
    d = os.path.dirname(good)
    outside_kvf = out.add("outside.kvf", good_bytes)
    out.add("namespace.json", open(os.path.join(root, ns, "namespace.json"), "rb").read())
    os.symlink(outside_kvf, os.path.join(d, _h(10) + ".kvf"))  # a block name that points outside
    os.symlink(out.fifo, os.path.join(d, _h(11) + ".kvf"))  # ... at a FIFO
    os.symlink(out.path, os.path.join(root, ns, "zz"))  # a directory level that points outside
    os.mkfifo(os.path.join(d, _h(12) + ".kvf"))  # a FIFO in the tree with a block name
    devs = _mknod_ok(os.path.join(d, _h(13) + ".kvf"))
    for n in _odd_names():
        with open(os.path.join(os.fsencode(d), n), "wb") as f:
            f.write(good_bytes)
    # A second namespace: namespace.json is a FIFO and its only file is corrupt (its layout then comes
    # from namespace.json); a third: namespace.json points outside.
    for k, how in ((2, "fifo"),) * fifo_doc + ((3, "link"),) * link_doc:
        nsd = os.path.join(root, f"{MODEL.replace('/', '_')}-{k:016x}")
        os.makedirs(os.path.join(nsd, "aa", "bb"))
        if how == "fifo":
            os.mkfifo(os.path.join(nsd, "namespace.json"))
        else:
            os.symlink(os.path.join(out.path, "namespace.json"), os.path.join(nsd, "namespace.json"))
        h = _h(20 + k)
        os.makedirs(os.path.join(nsd, h[:2], h[2:4]), exist_ok=True)
        with open(os.path.join(nsd, h[:2], h[2:4], h + ".kvf"), "wb") as f:
            f.write(raw)  # corrupt, at its block path
    os.symlink(os.path.join(out.path, "q"), os.path.join(root, ".quarantine"))  # quarantine dir points outside
    return root, out, {"devs": devs, "pays": pays, "layout": L, "bad": bad}


def test_inspect_hostile_root(tmp_path):
    root, out, info = _hostile_root(tmp_path)
    out.seal()
    r = _run(["inspect", root, "--json", "--verify"])
    out.check()
    assert r.returncode in (0, 1), r.stderr.decode()[-2000:]
    rep = json.loads(r.stdout)
    files = sum(n["files"] for n in rep["namespaces"])
    # 4 real blocks; the 10 odd names (valid bytes, not at a block path a load would open) are listed as
    # ignored, never counted; no symlink, FIFO or device node is opened
    assert files == 4, rep
    assert sum("not a block path" in i["why"] for i in rep["ignored"]) >= len(_odd_names()), rep["ignored"]
    assert rep["totals"]["corrupt"] == 1


def test_verify_and_quarantine_hostile_root(tmp_path):
    root, out, info = _hostile_root(tmp_path)
    out.seal()
    r = _run(["verify", root, "--json"])
    assert r.returncode == 1, r.stderr.decode()[-2000:]
    rep = json.loads(r.stdout)
    assert len(rep["bad"]) == 1 and rep["bad"][0]["reason"] == "ChecksumError"
    # The quarantine directory is a symlink outside: nothing may be moved (or created) through it.
    r = _run(["verify", root, "--json", "--quarantine"])
    out.check()
    assert r.returncode == 2 and b"symlink" in r.stderr, (r.returncode, r.stderr.decode()[-2000:])
    assert os.path.islink(os.path.join(root, ".quarantine")) and os.path.isfile(info["bad"])


def test_store_quarantine_refuses_symlinked_quarantine_dir(tmp_path):
    """Regression: LocalStore.quarantine moved a bad file through a planted ``.quarantine`` symlink (out of
    the root) and created directories there; now ELOOP, the file stays. Without the symlink it still works."""
    L = _layout()
    root, outside = str(tmp_path / "root"), str(tmp_path / "out")
    os.makedirs(outside)
    st = LocalStore(root)
    rels = [st.put_block(random.Random(i).randbytes(L.payload_bytes), L, K.BlockKey(_h(i)))[0] for i in range(2)]
    os.symlink(outside, os.path.join(root, ".quarantine"))
    with pytest.raises(OSError) as e:
        st.quarantine(rels[0], "ChecksumError")
    assert e.value.errno == errno.ELOOP
    assert os.listdir(outside) == [] and st.exists(rels[0])
    os.unlink(os.path.join(root, ".quarantine"))
    os.makedirs(os.path.join(root, ".quarantine", L.namespace()))
    os.symlink(outside, os.path.join(root, ".quarantine", L.namespace(), rels[1].split("/")[1]))  # deeper
    with pytest.raises(OSError):
        st.quarantine(rels[1], "ChecksumError")
    assert os.listdir(outside) == []
    moved = st.quarantine(rels[0], "ChecksumError")
    assert moved == f".quarantine/{rels[0]}.ChecksumError" and os.path.isfile(os.path.join(root, moved))


def test_gc_hostile_root(tmp_path):
    root, out, info = _hostile_root(tmp_path)
    tmp = os.path.join(os.path.dirname(info["bad"]), ".kvf-tmp-1-deadbeef")
    os.symlink(os.path.join(out.path, "outside.kvf"), tmp)  # a "temp file" that is a symlink outside
    os.utime(tmp, (1, 1), follow_symlinks=False)
    out.seal()
    r = _run(["gc", root, "--max-bytes", "0", "--json"])
    out.check()  # the outside target of every symlink survives; the links themselves may go
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    rep = json.loads(r.stdout)
    # --max-bytes 0 means no limit (as the tier's max_bytes: 0): nothing is evicted, the odd names
    # (not block paths) are never candidates; a real bound evicts the 4 blocks only
    assert rep["deleted"] == 0, rep
    r = _run(["gc", root, "--max-bytes", "1", "--json"])
    out.check()
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert json.loads(r.stdout)["deleted"] == 4
    assert all(os.path.exists(os.path.join(out.path, n)) for n in ("outside.kvf", "fifo", "q"))


# -- legacy trees (compact, inspect) ---------------------------------------------------------------

def _legacy(tmp_path, *, link_cfg: bool = False) -> tuple[str, Outside, dict[str, bytes]]:
    """A legacy root with every hazard; ``link_cfg`` adds a namespace whose config.json points outside."""
    out = Outside(str(tmp_path / "OUTSIDE"))
    src = str(tmp_path / "src")
    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    f = legacy_fields(MODEL, tokens_per_hash=16, blocks_per_file=1, dtype="bfloat16",
                      kv_cache_groups=[{"tokens_per_block": 16, "layer_names": names}], tp=1, replicated=True)
    slot = 2 * 16 * 576 * 2
    row = -(-slot // ROW_ALIGN) * ROW_ALIGN
    pays = {}
    for i in range(3):
        pays[_h(i)] = random.Random(i).randbytes(slot)
        write_legacy_row(src, f, _h(i), pays[_h(i)] + b"\xa5" * (row - slot))
    some = legacy_paths(src, f, _h(0))[1]
    d = os.path.dirname(some)
    row_out = out.add("row.bin", random.Random(9).randbytes(row))
    for k, target in ((30, row_out), (31, out.fifo)):  # block names that point outside
        h = _h(k)
        p = legacy_paths(src, f, h)[1]
        os.makedirs(os.path.dirname(p), exist_ok=True)
        os.symlink(target, p)
    h = _h(32)
    p = legacy_paths(src, f, h)[1]
    os.makedirs(os.path.dirname(p), exist_ok=True)
    os.mkfifo(p)  # a FIFO with a block name
    p = legacy_paths(src, f, _h(33))[1]
    os.makedirs(os.path.dirname(p), exist_ok=True)
    _mknod_ok(p)  # a device node with a block name
    # A directory level that points outside (holding a block-named row).
    h = _h(34)
    lvl = os.path.dirname(os.path.dirname(legacy_paths(src, f, h)[1]))
    os.makedirs(os.path.join(out.path, "lvl", f"{h[3:5]}_g0"))
    out.add(os.path.join("lvl", f"{h[3:5]}_g0", h + ".bin"), random.Random(8).randbytes(row))
    os.symlink(os.path.join(out.path, "lvl"), lvl)
    for n in _odd_names():
        with open(os.path.join(os.fsencode(d), n[:-4] + b".bin"), "wb") as fh:
            fh.write(b"\x00" * row)
    # A second namespace whose config.json points outside, and a third whose config.json is a FIFO.
    cfg_out = out.add("config.json", json.dumps({**f, "model_name": "other/model"}).encode())
    for k, how in ((2, "link"),) * link_cfg + ((3, "fifo"),):
        base = os.path.join(src, f"other_model_{k:012x}")
        os.makedirs(base)
        if how == "link":
            os.symlink(cfg_out, os.path.join(base, "config.json"))
        else:
            os.mkfifo(os.path.join(base, "config.json"))
    return src, out, pays


def test_compact_hostile_legacy_tree(tmp_path):
    src, out, pays = _legacy(tmp_path)
    dst = str(tmp_path / "dst")
    out.seal()
    r = _run(["compact", src, dst, "--json", "-q"])
    out.check()
    assert r.returncode in (0, 1), r.stderr.decode()[-2000:]
    rep = json.loads(r.stdout)
    assert rep["converted"] == len(pays) and rep["failed"] == 0, rep
    ignored = json.dumps(rep)
    for why in ("symlink leaves the source root", "not a regular file", "not a vLLM block file name"):
        assert why in ignored, why
    written = [os.path.join(dd, n) for dd, _, ns in os.walk(dst) for n in ns if n.endswith(".kvf")]
    assert len(written) == len(pays)
    for p in written:
        assert not os.path.islink(p)
        o = bytearray(len(next(iter(pays.values()))))
        K.read_into(p, o)
        assert bytes(o) == pays[os.path.basename(p)[:-4]]


def test_inspect_and_verify_hostile_legacy_tree(tmp_path):
    src, out, pays = _legacy(tmp_path)
    out.seal()
    r1 = _run(["inspect", src, "--json", "--verify"])
    r2 = _run(["verify", src, "--json"])
    out.check()
    for r in (r1, r2):
        assert r.returncode in (0, 1, 2), r.stderr.decode()[-2000:]
        assert b"Traceback" not in r.stderr, r.stderr.decode()[-3000:]
    json.loads(r1.stdout)


def test_fifo_and_device_given_directly(tmp_path):
    """A FIFO or a device node named on the command line: a clear error, no hang."""
    fifo = str(tmp_path / "x.kvf")
    os.mkfifo(fifo)
    paths = [fifo]
    if _mknod_ok(str(tmp_path / "zero.kvf")):
        paths.append(str(tmp_path / "zero.kvf"))
    for p in paths:
        for cmd in (["inspect", p], ["verify", p]):
            r = _run(cmd, timeout=60)
            assert r.returncode == 2, (cmd, r.returncode, r.stdout[-500:], r.stderr[-500:])
            assert p.encode() in r.stderr and b"Traceback" not in r.stderr


# -- namespace.json / config.json planted as a FIFO or a symlink outside: reported, never opened ----------

def test_verify_namespace_json_fifo_does_not_hang(tmp_path):
    """A namespace.json that is a FIFO, in a namespace whose only file is corrupt: verify must not block."""
    root, out, _ = _hostile_root(tmp_path, fifo_doc=True)
    out.seal()
    r = _run(["verify", root, "--json"], timeout=10)
    out.check()
    rep = json.loads(r.stdout)
    assert r.returncode == 1 and len(rep["bad"]) == 2
    whys = [i["why"] for i in rep["ignored"] if "namespace.json" in i["why"]]
    assert whys == ["namespace.json is not a regular file: not read"], rep["ignored"]


def test_verify_namespace_json_symlink_outside_is_not_read(tmp_path):
    root, out, _ = _hostile_root(tmp_path, link_doc=True)
    out.seal()
    r = _run(["verify", root, "--json"], timeout=60)
    out.check()
    assert r.returncode == 1
    whys = [i["why"] for i in json.loads(r.stdout)["ignored"] if "namespace.json" in i["why"]]
    assert whys == ["namespace.json is a symlink (not followed): not read"]


def test_compact_config_json_symlink_outside_is_not_read(tmp_path):
    src, out, pays = _legacy(tmp_path, link_cfg=True)
    out.seal()
    r = _run(["compact", src, str(tmp_path / "dst"), "--json", "-q"], timeout=60)
    out.check()
    assert r.returncode in (0, 1)
    why = {os.path.basename(os.path.dirname(i["path"])): i["why"] for i in json.loads(r.stdout)["ignored_paths"]
           if i["path"].endswith("config.json")}
    assert why == {"other_model_000000000002": "config.json is a symlink (not followed): namespace skipped",
                   "other_model_000000000003": "config.json is not a regular file: namespace skipped"}, why


# -- FIFOs where a reader expects a block file --------------------------------------------------------

FIFO_CHILD = r"""
import os, sys
sys.path.insert(0, sys.argv[1])
import kvformat as K
from kvformat.errors import NotKVFormatError
from kvformat.storage import LocalStore
p = sys.argv[2]
for call in (lambda: K.read_header(p), lambda: K.read_into(p, bytearray(64)), lambda: K.open_block(p),
             lambda: LocalStore(os.path.dirname(p)).read_into(os.path.basename(p), bytearray(64))):
    try:
        call()
    except NotKVFormatError as e:
        assert "not a regular file" in str(e) and e.path == p, e
    else:
        raise SystemExit("accepted a FIFO")
print("ok")
"""


def test_regression_read_of_a_fifo_does_not_block(tmp_path):
    """Regression: read_header/read_into opened a FIFO planted under a block name and blocked forever.
    Now NotKVFormatError ("not a regular file"); a device node too; a directory stays an OS error."""
    fifo = str(tmp_path / (_h(0) + ".kvf"))
    os.mkfifo(fifo)
    r = subprocess.run([sys.executable, "-c", FIFO_CHILD, ROOT, fifo], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
    dev = str(tmp_path / "zero.kvf")
    if _mknod_ok(dev):
        with pytest.raises(K.KVFormatError):
            K.read_into(dev, bytearray(64))
    with pytest.raises(IsADirectoryError):
        K.read_header(tmp_path)


def test_tier_serves_a_planted_fifo_as_a_miss(tmp_path):
    """A FIFO planted where the tier expects a block file: a miss, no hung read thread. (A symlinked block
    file is followed, like any path given to the API: symlinks in a tier's own root are the operator's.)"""
    pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33 is installed by .ci/run")
    from vllm_harness import Deployment, kvformat_tier, make_keys, make_payload

    root = str(tmp_path / "root")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    fifo = None
    try:
        with Deployment([kvformat_tier(root, read_threads=2, write_threads=2)], n_layers=2, num_chunks=8,
                        engine_id=f"kvft_untrusted_{os.getpid()}") as dep:
            keys = make_keys(4, "fifo")
            items = {k: make_payload(k.hex(), dep.slot_bytes) for k in keys}
            dep.store(items)
            files = sorted(os.path.join(d, n) for d, _, ns in os.walk(root) for n in ns if n.endswith(".kvf"))
            by_key = {os.path.basename(p)[:-4]: p for p in files}
            fifo = by_key[keys[0][:-4].hex()]
            os.unlink(fifo)
            os.mkfifo(fifo)
            link = by_key[keys[1][:-4].hex()]
            os.replace(link, elsewhere / "moved.kvf")
            os.symlink(elsewhere / "moved.kvf", link)
            dep.evict_primary()
            got = dep.load(keys, timeout=30)
            assert got[keys[0]] is None  # the FIFO: a miss, not a hang
            assert got[keys[1]] == items[keys[1]]
            assert got[keys[2]] == items[keys[2]] and got[keys[3]] == items[keys[3]]
            assert dep.tier().counters()["quarantined:NotKVFormatError"] == 1
    finally:
        if fifo and os.path.exists(fifo) and stat.S_ISFIFO(os.lstat(fifo).st_mode):
            try:  # release a reader blocked on it, should one exist
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
