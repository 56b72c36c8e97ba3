"""Writers killed with SIGKILL at random points (issue 7).

A real child process writes blocks (``Store.put_block``, and ``kvformat compact`` over a legacy
tree); the parent kills it after a random delay, then checks the root: every file under a final
name decodes and holds exactly the bytes written for its key (no partial file is ever visible),
only ``.kvf-tmp-*`` leftovers may remain, the next start (``Store.cleanup_temp``, compact's own
start-up sweep) or ``gc`` removes them, and a re-run converges to the tree a clean run produces.
``KVFORMAT_SLOW=1`` multiplies the kill points by ten.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

import kvformat as K
from kvformat.admin._gc import run_gc
from kvformat.format._write import TMP_PREFIX
from kvformat.legacy import ROW_ALIGN, legacy_fields, write_legacy_row
from kvformat.storage import LocalStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLOW = os.environ.get("KVFORMAT_SLOW") == "1"
KILLS = 500 if SLOW else 50
MODEL = "deepseek-ai/DeepSeek-V2-Lite"
N_KEYS = 24

# The child: the same layout, keys and payloads as below; each run writes the keys in its own order.
STORE_CHILD = r"""
import os, random, sys
sys.path.insert(0, sys.argv[1])
import kvformat as K
from kvformat.storage import open_store
root, order_seed, codec, fsync = sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5] == "1"
L = K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V2-Lite", "bfloat16",
                              [f"model.layers.{i}.self_attn.attn" for i in range(8)], 64, 576, blocks_per_chunk=2)
st = open_store(root)
st.ensure_namespace(L)
keys = list(range(int(sys.argv[6])))
random.Random(order_seed).shuffle(keys)
print("ready", flush=True)
written = 0
for i in keys:
    pay = random.Random(i).randbytes(L.payload_bytes)
    _, _, w = st.put_block(pay, L, K.BlockKey(f"{i:064x}"), codec=codec, fsync=fsync)
    written += w
print("done", written, flush=True)
"""


def _layout() -> K.CanonicalLayout:
    return K.CanonicalLayout.uniform(MODEL, "bfloat16", [f"model.layers.{i}.self_attn.attn" for i in range(8)], 64,
                                     576, blocks_per_chunk=2)


def _payload(i: int, n: int) -> bytes:
    return random.Random(i).randbytes(n)


def _run_child(args: list[str], kill_after: float | None, ok_rc: tuple[int, ...] = (0,)) -> tuple[int, str]:
    """Start the child; once it says 'ready', SIGKILL it after ``kill_after`` s (None: let it finish)."""
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.strip() == "ready", (line, p.stderr.read() if p.stderr else "")
    if kill_after is None:
        out, err = p.communicate(timeout=300)
        assert p.returncode in ok_rc, err[-3000:]
        return p.returncode, out
    try:
        p.wait(timeout=kill_after)  # it may finish first: then this kill point is "after the end"
    except subprocess.TimeoutExpired:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    p.communicate()
    return p.returncode, ""


def _walk(root: str) -> tuple[list[str], list[str], list[str]]:
    """(final .kvf files, temp files, anything else) under root."""
    finals, temps, other = [], [], []
    for d, _dirs, files in os.walk(root):
        for n in files:
            p = os.path.join(d, n)
            if n.startswith(TMP_PREFIX):
                temps.append(p)
            elif n.endswith(".kvf"):
                finals.append(p)
            else:
                other.append(p)
    return finals, temps, other


def _check_finals(root: str, expected: dict[str, bytes], layout: K.CanonicalLayout | None) -> int:
    """Every final file decodes completely and holds exactly the payload written for its key."""
    finals, _, other = _walk(root)
    for p in other:  # namespace.json is written through the same temp + rename: never torn
        assert os.path.basename(p) == "namespace.json", p
        json.loads(open(p).read())
    for p in finals:
        h = os.path.basename(p)[:-4]
        want = expected[h]
        out = bytearray(len(want))
        hdr = K.read_into(p, out, expect=layout, key=K.BlockKey(h))
        assert bytes(out) == want, p
        assert os.path.getsize(p) == hdr.file_bytes
    return len(finals)


def test_store_writer_sigkill(tmp_path):
    """≥ 50 SIGKILLs of a process storing blocks: never a partial file; leftovers cleaned; re-run converges."""
    L = _layout()
    root = str(tmp_path / "root")
    expected = {f"{i:064x}": _payload(i, L.payload_bytes) for i in range(N_KEYS)}
    base = [sys.executable, "-c", STORE_CHILD, ROOT, root]
    per_key = _calibrate(base + ["0", "none", "0", str(N_KEYS)]) / N_KEYS
    # Start each kill round from a partly filled root, so kills land in writes, skips and the rename.
    rng = random.Random(1234)
    stats = {"kills": 0, "finished_first": 0, "temp_leftovers": 0, "max_finals_seen": 0, "cleanups": 0,
             "gc_cleanups": 0}
    k = 0
    while (stats["kills"] < KILLS or not stats["temp_leftovers"]) and k < 3 * KILLS:
        k += 1
        finals = _walk(root)[0]
        if len(finals) == N_KEYS or k % 10 == 0:  # restart from an empty root when full, and now and then
            for p in finals:
                os.unlink(p)
            finals = []
        codec = rng.choice(("none", "zstd"))
        # Kill somewhere in the writes still to do (the rest are quick skips of existing files).
        delay = rng.uniform(0, per_key * (N_KEYS - len(finals)) * (2 if codec == "zstd" else 1))
        rc, _ = _run_child(base + [str(k + 1), codec, str(rng.randrange(2)), str(N_KEYS)], delay)
        stats["kills"] += rc == -signal.SIGKILL
        stats["finished_first"] += rc == 0
        n = _check_finals(root, expected, L)
        stats["max_finals_seen"] = max(stats["max_finals_seen"], n)
        temps = _walk(root)[1]
        stats["temp_leftovers"] += len(temps)
        if temps and k % 3 == 0:  # the next start: Store.cleanup_temp
            assert LocalStore(root).cleanup_temp() == len(temps)
            stats["cleanups"] += 1
        elif temps and k % 3 == 1:  # or gc, once the temp files are older than its grace period
            for t in temps:
                os.utime(t, (time.time() - 7200, time.time() - 7200))
            assert run_gc(LocalStore(root), 1 << 40).temp_removed == len(temps)
            stats["gc_cleanups"] += 1
        assert not (_walk(root)[1] and k % 3 in (0, 1))
    print(json.dumps(stats))
    assert stats["kills"] >= KILLS
    # Kills landed inside writes (a temp file left behind), not only between them: the test can fail.
    assert stats["temp_leftovers"] > 0
    # Re-run to the end: converges to every key, valid, no temp file; a further run writes nothing.
    LocalStore(root).cleanup_temp()
    _run_child(base + ["999", "none", "1", str(N_KEYS)], None)
    assert _check_finals(root, expected, L) == N_KEYS
    assert _walk(root)[1] == []
    _, out = _run_child(base + ["1000", "zstd", "0", str(N_KEYS)], None)
    assert out.split() == ["done", "0"]


# -- kvformat compact --------------------------------------------------------------------------------------

def _calibrate(args: list[str]) -> float:
    """Seconds from the child's 'ready' to its exit, for one full run."""
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    return time.monotonic() - t0


def _legacy_tree(root: str, n_files: int, n_layers: int = 6, tpb: int = 64, width: int = 576) -> dict[str, bytes]:
    """A vLLM fs-tier root (replicated MLA rows, one block per file), as vLLM's FileMapper names it."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(n_layers)]
    f = legacy_fields(MODEL, tokens_per_hash=tpb, blocks_per_file=1, dtype="bfloat16",
                      kv_cache_groups=[{"tokens_per_block": tpb, "layer_names": names}], tp=1, replicated=True)
    slot = n_layers * tpb * width * 2
    row = -(-slot // ROW_ALIGN) * ROW_ALIGN
    out = {}
    for i in range(n_files):
        h = f"{i + 1:064x}"
        p = _payload(10_000 + i, slot)
        path = write_legacy_row(root, f, h, p + b"\xa5" * (row - slot))
        os.utime(path, (1_700_000_000 + i, 1_700_000_000 + i))  # compact stamps this mtime into each output
        out[h] = p
    return out


COMPACT_CHILD = r"""
import os, sys, time
sys.path.insert(0, sys.argv[1])
# A slow disk: each fsync (compact runs with --fsync) takes 10 ms more, so random kills land inside
# writes (temp file open) on any machine, not mostly in interpreter start-up or between files.
_fsync = os.fsync
os.fsync = lambda fd: (time.sleep(0.01), _fsync(fd))[1]
from kvformat.cli import main
print("ready", flush=True)
sys.exit(main(sys.argv[2:]))
"""


def _tree_bytes(root: str) -> dict[str, bytes]:
    out = {}
    for p in _walk(root)[0]:
        with open(p, "rb") as f:
            out[os.path.relpath(p, root)] = f.read()
    return out


@pytest.mark.parametrize("delete_source", [False, True])
def test_compact_sigkill(tmp_path, delete_source):
    """``kvformat compact`` killed at random points: outputs whole or absent, no source lost, re-run converges."""
    n_kills = KILLS // 2  # two variants: 50 kill points per CI run in all
    src, dst, ref = str(tmp_path / "src"), str(tmp_path / "dst"), str(tmp_path / "ref")
    expected = _legacy_tree(src, 30)
    # --fsync with the child's slow fsync (COMPACT_CHILD) makes the write the longest part of each file.
    argv = [sys.executable, "-c", COMPACT_CHILD, ROOT, "compact", src, dst, "-q", "--json", "--fsync"]
    # The reference: one clean run of the same source into another root (no deletion).
    per_file = _calibrate([sys.executable, "-c", COMPACT_CHILD, ROOT, "compact", src, ref, "-q", "--json",
                           "--fsync"]) / len(expected)
    reference = _tree_bytes(ref)
    assert len(reference) == len(expected)
    rng = random.Random(99 + delete_source)
    stats = {"kills": 0, "finished_first": 0, "temp_leftovers": 0, "sources_deleted": 0, "rounds": 0}
    extra = ["--delete-source"] if delete_source else []
    # Kill points past the n_kills asked for only while no kill has landed inside a write yet (a loaded machine
    # shifts the calibrated timing): those aim at the first files, where a write is sure to be under way.
    while (stats["kills"] < n_kills or not stats["temp_leftovers"]) and stats["rounds"] < 6 * n_kills:
        stats["rounds"] += 1
        done = _walk(dst)[0]
        srcs = list(_walk_bins(src))
        if len(done) == len(expected) and (not delete_source or not srcs):  # all done: start over
            for p in done:
                os.unlink(p)
            if delete_source:
                _legacy_tree(src, 30)
                srcs = list(_walk_bins(src))  # the count below is per round: start from the tree just put back
            done = []
        span = len(expected) - len(done) + 2 if stats["rounds"] <= n_kills else 3
        delay = rng.uniform(0, per_file * span)
        rc, _ = _run_child(argv + extra + (["-j", "2"] if rng.random() < 0.5 else []), delay)
        stats["kills"] += rc == -signal.SIGKILL
        stats["finished_first"] += rc == 0
        _check_finals(dst, expected, None)
        stats["temp_leftovers"] += len(_walk(dst)[1])
        # No block is ever lost: each has its source or a valid output (checked above), or both.
        have = {os.path.basename(p)[:-4] for p in _walk(dst)[0]}
        srcs_left = {os.path.basename(p)[:-4] for p in _walk_bins(src)}
        assert have | srcs_left == set(expected), set(expected) - have - srcs_left
        stats["sources_deleted"] += len(srcs) - len(srcs_left)
    print(json.dumps(stats))
    assert stats["kills"] >= n_kills
    assert stats["temp_leftovers"] > 0  # some kills landed inside a write, not only between files
    assert stats["sources_deleted"] > 0 or not delete_source
    if delete_source:
        _legacy_tree(src, 30)  # put back any source already moved, so the final run has all to check
    # Re-run to the end: its start-up sweep removes the dead writers' temp files; same tree as a clean run.
    rc, out = _run_child(argv + extra, None)
    rep = json.loads(out)
    assert rep["failed"] == 0 and rc == 0, rep
    assert _walk(dst)[1] == []
    got = _tree_bytes(dst)
    assert got == reference  # byte-identical outputs: provenance is deterministic
    if delete_source:
        assert list(_walk_bins(src)) == []


def _walk_bins(root: str):
    for d, _dirs, files in os.walk(root):
        for n in files:
            if n.endswith(".bin"):
                yield os.path.join(d, n)


# -- the vLLM tier ---------------------------------------------------------------------------------------

# Importing vLLM takes seconds, so one "zygote" imports it once and forks a fresh tier writer per kill
# point; each writer builds a real Deployment (vLLM's manager + KVFormatTier) and stores every key.
ZYGOTE = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2])
from vllm_harness import Deployment, kvformat_tier, make_keys, make_payload, page_bytes_for
import kvformat as K
N, KW = int(sys.argv[3]), dict(n_layers=8, tokens_per_block=64, width=576, num_chunks=16)
SLOT = page_bytes_for(64, 576, "bfloat16") * 8
print("ready", flush=True)
for line in sys.stdin:
    cmd, root, tag = line.split()
    if cmd == "run":
        pid = os.fork()
        if pid == 0:
            try:
                with Deployment([kvformat_tier(root, read_threads=2, write_threads=4)], engine_id=f"kvft_crash_{tag}",
                                **KW) as dep:
                    keys = make_keys(N, "crash")
                    items = {k: make_payload(k.hex(), dep.slot_bytes) for k in keys}
                    dep.tier().wait_scanned(30)
                    # One write a line: under PYTHONUNBUFFERED print writes the word and its newline apart, and
                    # a kill between them glued "done" to the zygote's "exit" line.
                    os.write(1, f"go {os.getpid()}\n".encode())
                    dep.store(items)
                    os.write(1, b"stored\n")
                os.write(1, b"done\n")
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        try:
            os.unlink(f"/dev/shm/vllm_offload_kvft_crash_{tag}.mmap")  # a killed writer cannot remove its region
        except FileNotFoundError:
            pass
        print("exit", os.waitstatus_to_exitcode(status), flush=True)
    elif cmd == "check":  # every final file whole and holding its key's payload
        slot = SLOT
        want = {k[:-4].hex(): make_payload(k.hex(), slot) for k in make_keys(N, "crash")}
        finals = temps = 0
        for d, _, names in os.walk(root):
            for n in names:
                p = os.path.join(d, n)
                if n.startswith(".kvf-tmp-"):
                    temps += 1
                elif n.endswith(".kvf"):
                    out = bytearray(slot)
                    K.read_into(p, out, key=K.BlockKey(n[:-4]))
                    assert bytes(out) == want[n[:-4]], p
                    finals += 1
                else:
                    assert n == "namespace.json", p
                    json.load(open(p))
        assert not os.path.exists(os.path.join(root, ".quarantine")), "a crash left a file the tier found corrupt"
        print("checked", finals, temps, flush=True)
"""


def test_tier_writer_sigkill(tmp_path):
    """A process running vLLM's manager with KVFormatTier is SIGKILLed while it stores: no partial file,
    the next tier start removes stale temp files, a re-run converges to every key."""
    pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33 is installed by .ci/run")
    n, kills_wanted = 32, (20 if not SLOW else 200)
    root = str(tmp_path / "root")
    z = subprocess.Popen([sys.executable, "-c", ZYGOTE, ROOT, os.path.join(ROOT, "tests"), str(n)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
    assert z.stdin is not None and z.stdout is not None

    def say(cmd: str, tag: str) -> None:
        z.stdin.write(f"{cmd} {root} {tag}\n")
        z.stdin.flush()

    def expect(word: str) -> list[str]:
        line = z.stdout.readline().split()
        assert line and line[0] == word, (line, z.stderr.read()[-3000:] if z.poll() is not None else "")
        return line[1:]

    try:
        assert z.stdout.readline().strip() == "ready", z.stderr.read()[-3000:]
        say("run", "cal")
        expect("go")
        t0 = time.monotonic()
        expect("stored")
        full = time.monotonic() - t0  # the store phase only: kills aim inside it
        expect("done")
        assert expect("exit") == ["0"]
        rng = random.Random(7)
        stats = {"kills": 0, "finished_first": 0, "temp_leftovers": 0, "rounds": 0}
        while (stats["kills"] < kills_wanted or not stats["temp_leftovers"]) and stats["rounds"] < 3 * kills_wanted:
            stats["rounds"] += 1
            finals = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".kvf")]
            if len(finals) == n or rng.random() < 0.3:
                for p in finals:
                    os.unlink(p)
                finals = []
            say("run", f"k{stats['rounds']}")
            pid = int(expect("go")[0])
            time.sleep(rng.uniform(0, full * (n - len(finals)) / n))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            line = z.stdout.readline().split()
            while line and line[0] in ("stored", "done"):
                stats["finished_first"] += line[0] == "stored"
                line = z.stdout.readline().split()
            assert line and line[0] == "exit", line
            stats["kills"] += int(line[1]) == -signal.SIGKILL
            say("check", f"c{stats['rounds']}")
            _finals, temps = map(int, expect("checked"))
            stats["temp_leftovers"] += temps
        print(json.dumps({**stats, "store_s": round(full, 3)}))
        assert stats["kills"] >= kills_wanted
        assert stats["temp_leftovers"] > 0  # some kills landed inside a write
        # The next start removes the killed writers' temp files at once (their pids are gone), whatever their age.
        say("run", "final")
        expect("go")
        expect("stored")
        expect("done")
        assert expect("exit") == ["0"]
        say("check", "final")
        assert list(map(int, expect("checked"))) == [n, 0]  # converged: every key, no leftovers
    finally:
        z.stdin.close()
        z.wait(timeout=60)


def test_cleanup_temp_removes_dead_writers_files_and_keeps_live_ones(tmp_path):
    """A temp file whose writer process is gone goes at once; a live writer's (or another host's) stays."""
    from kvformat.format._write import temp_name

    store = LocalStore(str(tmp_path))
    d = tmp_path / "ns" / "ab" / "cd"
    d.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "from kvformat.format._write import temp_name; print(temp_name())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    live = temp_name()
    other_host = dead.rsplit("-", 1)[0] + "-00000000"
    for name in (dead, live, other_host):
        (d / name).write_bytes(b"partial")
    assert store.cleanup_temp(older_than_s=3600.0) == 0  # all young: the age rule alone removes nothing
    assert store.cleanup_temp(older_than_s=3600.0, dead_writers=True) == 1
    assert sorted(p.name for p in d.iterdir()) == sorted([live, other_host])
