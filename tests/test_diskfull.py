"""Full disks and write errors (issue 7): stores fail cleanly, nothing partial remains, loads keep
working, and writing recovers once space returns.

Two real ways to run out of space: ``RLIMIT_FSIZE`` in a child process (writes past the limit fail
with EFBIG, or the process dies of SIGXFSZ mid-write), and a small tmpfs mounted for the test (real
ENOSPC; needs root, else those tests skip and say why). The tier test drives vLLM's real manager
over a full tmpfs.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import uuid

import pytest
from tmpfs_mount import tmpfs

import kvformat as K
from kvformat.admin._gc import run_gc
from kvformat.format._write import TMP_PREFIX
from kvformat import block_relpath
from kvformat.storage import LocalStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _layout(n_layers: int = 8) -> K.CanonicalLayout:
    return K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V2-Lite", "bfloat16",
                                     [f"model.layers.{i}.self_attn.attn" for i in range(n_layers)], 64, 576)


def _pay(i: int, n: int) -> bytes:
    return random.Random(i).randbytes(n)


def _files(root: str) -> tuple[list[str], list[str]]:
    finals, temps = [], []
    for d, _, names in os.walk(root):
        for n in names:
            (temps if n.startswith(TMP_PREFIX) else finals if n.endswith(".kvf") else []).append(os.path.join(d, n))
    return finals, temps


FSIZE_CHILD = r"""
import errno, json, os, random, resource, signal, sys
sys.path.insert(0, sys.argv[1])
import kvformat as K
from kvformat import block_relpath
from kvformat.storage import open_store
root, limit, ignore = sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
# Ignored (CPython's default): a write past the limit fails with EFBIG. Default action: the process dies.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN if ignore else signal.SIG_DFL)
L = K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V2-Lite", "bfloat16",
                              [f"model.layers.{i}.self_attn.attn" for i in range(8)], 64, 576)
small = K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V2-Lite", "bfloat16", ["l0"], 64, 576)
st = open_store(root)
res = {}
st.put_block(random.Random(1).randbytes(small.payload_bytes), small, K.BlockKey("01" * 32))
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
print("limited", flush=True)
for codec in ("none", "zstd"):
    try:
        st.put_block(random.Random(2).randbytes(L.payload_bytes), L, K.BlockKey("02" * 32), codec=codec)
        res[codec] = "stored"
    except OSError as e:
        res[codec] = errno.errorcode.get(e.errno, str(e.errno))
# Loads keep working while writes fail.
out = bytearray(small.payload_bytes)
st.read_into(block_relpath(small, K.BlockKey("01" * 32)), out)
res["load_ok"] = bytes(out) == random.Random(1).randbytes(small.payload_bytes)
res["temps_after_failure"] = sum(n.startswith(".kvf-tmp-") for _, _, ns in os.walk(root) for n in ns)
# Space returns: the same store succeeds.
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
rel, n, wrote = st.put_block(random.Random(2).randbytes(L.payload_bytes), L, K.BlockKey("02" * 32))
res["recovered"] = wrote
print(json.dumps(res), flush=True)
"""


def test_rlimit_fsize_store_fails_cleanly_and_recovers(tmp_path):
    """EFBIG mid-write (RLIMIT_FSIZE below the file size): OSError passes through, no temp or final file."""
    L = _layout()
    root = str(tmp_path / "root")
    limit = L.payload_bytes // 2  # the header and part of the payload fit: the write fails half-way
    r = subprocess.run([sys.executable, "-c", FSIZE_CHILD, ROOT, root, str(limit), "1"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res == {"none": "EFBIG", "zstd": "EFBIG", "load_ok": True, "temps_after_failure": 0, "recovered": True}
    finals, temps = _files(root)
    assert len(finals) == 2 and temps == []
    out = bytearray(L.payload_bytes)
    K.read_into(finals[0] if "0202" in finals[0] else finals[1], out, expect=L)
    assert bytes(out) == _pay(2, L.payload_bytes)


def test_sigxfsz_kills_writer_midway_leftover_is_only_a_temp_file(tmp_path):
    """Default SIGXFSZ kills the writer inside the write: no final file, the temp file is cleaned up."""
    L = _layout()
    root = str(tmp_path / "root")
    r = subprocess.run([sys.executable, "-c", FSIZE_CHILD, ROOT, root, str(L.payload_bytes // 2), "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGXFSZ, (r.returncode, r.stderr[-2000:])
    assert "limited" in r.stdout
    finals, temps = _files(root)
    assert len(finals) == 1 and len(temps) == 1  # the small block, and the killed write's temp file
    assert os.path.getsize(temps[0]) == L.payload_bytes // 2  # it died mid-write
    assert LocalStore(root).cleanup_temp() == 1
    assert _files(root)[1] == []


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 3 MiB tmpfs mounted for the test (root only)."""
    with tmpfs(tmp_path / "mnt", "size=3m,mode=0755", "; the RLIMIT_FSIZE tests still run") as root:
        yield root


def test_enospc_on_a_full_tmpfs(small_tmpfs):
    """Real ENOSPC: the failing store leaves nothing, earlier blocks load, gc frees space, stores resume."""
    L = _layout()  # 589,824-byte payload: five fit in 3 MiB
    st = LocalStore(small_tmpfs)
    stored, failures = [], 0
    for i in range(12):
        try:
            st.put_block(_pay(i, L.payload_bytes), L, K.BlockKey(f"{i:064x}"))
            stored.append(i)
        except OSError as e:
            assert e.errno == errno.ENOSPC
            failures += 1
            assert _files(small_tmpfs)[1] == []  # the temp file of the failed write is gone
    assert failures >= 5 and len(stored) >= 3
    finals, temps = _files(small_tmpfs)
    assert len(finals) == len(stored) and temps == []
    out = bytearray(L.payload_bytes)
    for i in stored:  # every block stored before the disk filled still loads, intact
        K.read_into(os.path.join(small_tmpfs, block_relpath(L, K.BlockKey(f"{i:064x}"))), out, expect=L)
        assert bytes(out) == _pay(i, L.payload_bytes)
    rep = run_gc(st, L.payload_bytes * 2)  # space returns
    assert rep.deleted >= 1
    st.put_block(_pay(99, L.payload_bytes), L, K.BlockKey(f"{99:064x}"))
    assert len(_files(small_tmpfs)[0]) == len(stored) - rep.deleted + 1


def test_tier_on_a_full_tmpfs(small_tmpfs):
    """vLLM's manager + KVFormatTier over a full disk: store jobs fail (no partial file), loads keep
    working, failed keys are misses, and the tier stores again once space returns."""
    pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33 is installed by .ci/run")
    from vllm_harness import Deployment, kvformat_tier, make_keys, make_payload

    with Deployment([kvformat_tier(small_tmpfs, read_threads=2, write_threads=2, o_direct="off")], n_layers=8,
                    tokens_per_block=64, width=576, num_chunks=8, engine_id=f"kvft_df_{uuid.uuid4().hex[:8]}") as dep:
        keys = make_keys(10, "diskfull")
        items = {k: make_payload(k.hex(), dep.slot_bytes) for k in keys}
        dep.store(items)
        finals, temps = _files(small_tmpfs)
        assert temps == [] and 3 <= len(finals) < len(keys)  # some stores failed for lack of space
        for p in finals:
            K.read_header(p)  # every visible file is whole
        dep.evict_primary()
        got = dep.load(keys)
        hits = [k for k in keys if got[k] is not None]
        assert len(hits) == len(finals)
        assert all(got[k] == items[k] for k in hits)  # right bytes or a miss, never partial data
        # Space returns: delete the stored files behind the tier's back, then store the misses again.
        for p in finals:
            os.unlink(p)
        missing = [k for k in keys if got[k] is None][:3]
        dep.evict_primary()
        dep.store({k: items[k] for k in missing})
        dep.evict_primary()
        again = dep.load(missing)
        assert again == {k: items[k] for k in missing}
