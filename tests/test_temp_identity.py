"""Temp files carry an identity unique across hosts, boots and PID namespaces, and the start-up sweep removes only
temps that are provably dead (issue 21 item 6). Real PID namespaces (``unshare --pid --fork``, as root), real
processes on both sides: a writer still running in another namespace with the same hostname keeps its temp file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvformat.format._write import TMP_PREFIX, host_tag, temp_name, temp_writer_gone
from kvformat.storage import LocalStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Creates one temp file named by the writer's own identity in argv[2] and keeps running until argv[3] exists.
WRITER = r"""
import os, sys, time
sys.path.insert(0, sys.argv[1])
from kvformat.format._write import temp_name
p = os.path.join(sys.argv[2], temp_name())
open(p, "wb").write(b"in flight")
print(os.path.basename(p), flush=True)
while not os.path.exists(sys.argv[3]):
    time.sleep(0.01)
"""
# The start-up sweep of a tier (cache/_scan.py): temps older than an hour, or whose writer is provably gone.
SWEEP = r"""
import sys
sys.path.insert(0, sys.argv[1])
from kvformat.storage import LocalStore
print(LocalStore(sys.argv[2]).cleanup_temp(older_than_s=3600, dead_writers=True), flush=True)
"""


def _unshare() -> list[str]:
    exe = shutil.which("unshare")
    if exe is None:
        pytest.skip("unshare(1) is not installed: PID namespaces cannot be made here")
    probe = subprocess.run([exe, "--pid", "--fork", "--mount-proc", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a PID namespace here ({probe.stderr.strip()[:200]})")
    return [exe, "--pid", "--fork", "--mount-proc"]


def _temps(d: Path) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.startswith(TMP_PREFIX))


def test_sweep_in_another_pid_namespace_keeps_a_live_writers_temp(tmp_path: Path) -> None:
    ns = _unshare()
    d, stop = tmp_path / "ns", tmp_path / "stop"
    d.mkdir()
    writer = subprocess.Popen([sys.executable, "-c", WRITER, ROOT, str(d), str(stop)], stdout=subprocess.PIPE,
                              text=True)
    try:
        name = writer.stdout.readline().strip() if writer.stdout else ""
        assert name.startswith(TMP_PREFIX)
        # A second engine in its own PID namespace, same hostname (host networking): the writer's pid means
        # nothing there (the namespace holds a handful of processes), so it must not call the writer dead.
        r = subprocess.run(ns + [sys.executable, "-c", SWEEP, ROOT, str(d)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.strip() == "0" and _temps(d) == [name]
    finally:
        stop.touch()
        writer.wait(30)


def test_sweep_here_keeps_the_temp_of_a_writer_in_another_pid_namespace(tmp_path: Path) -> None:
    ns = _unshare()
    d, stop = tmp_path / "ns", tmp_path / "stop"
    d.mkdir()
    # The writer is a small pid in its namespace (2 or 3): a pid that, seen from here, is some other process or
    # none at all. Both ways the sweep here must leave the file alone.
    writer = subprocess.Popen(ns + [sys.executable, "-c", WRITER, ROOT, str(d), str(stop)], stdout=subprocess.PIPE,
                              text=True)
    try:
        name = writer.stdout.readline().strip() if writer.stdout else ""
        assert name.startswith(TMP_PREFIX) and int(name[len(TMP_PREFIX):].split("-")[0]) < 100, name
        assert name.rsplit("-", 1)[1] != host_tag()  # another namespace: another identity
        assert not temp_writer_gone(name)
        assert LocalStore(str(d)).cleanup_temp(older_than_s=3600, dead_writers=True) == 0
        assert _temps(d) == [name]
    finally:
        stop.touch()
        writer.wait(30)


def test_sweep_removes_only_provably_dead_temps(tmp_path: Path) -> None:
    d, stop = tmp_path / "ns", tmp_path / "stop"
    d.mkdir()
    stop.touch()
    # A writer of this namespace that exited: gone for sure.
    r = subprocess.run([sys.executable, "-c", WRITER, ROOT, str(d), str(stop)], capture_output=True, text=True,
                       timeout=60)
    dead = r.stdout.strip()
    # A live writer of this namespace (this process), an old temp of another host, a fresh one of another host,
    # and a name without an identity (an older kvformat): only the age rule can remove the last three.
    live = temp_name()
    (d / live).write_bytes(b"x")
    old_foreign = f"{TMP_PREFIX}4242-deadbeef-0123456789ab"
    fresh_foreign = f"{TMP_PREFIX}4243-deadbeef-0123456789ab"
    untagged = f"{TMP_PREFIX}4244-cafe"
    for n in (old_foreign, fresh_foreign, untagged):
        (d / n).write_bytes(b"x")
    two_hours_ago = time.time() - 7200
    os.utime(d / old_foreign, (two_hours_ago, two_hours_ago))
    assert temp_writer_gone(dead) and not temp_writer_gone(live) and not temp_writer_gone(fresh_foreign)
    assert LocalStore(str(d)).cleanup_temp(older_than_s=3600, dead_writers=True) == 2
    assert _temps(d) == sorted([live, fresh_foreign, untagged])


def test_temp_names_are_unique_and_carry_the_identity() -> None:
    names = {temp_name() for _ in range(2000)}
    assert len(names) == 2000
    parts = [n[len(TMP_PREFIX):].split("-") for n in names]
    assert {(int(pid), tag) for pid, _, tag in parts} == {(os.getpid(), host_tag())} and len(host_tag()) == 12
    # <unique>: this process's 8-hex salt, then a hex counter
    assert len({u[:8] for _, u, _ in parts}) == 1 and all(len(u) > 8 and int(u, 16) >= 0 for _, u, _ in parts)


def test_a_forked_writer_draws_its_own_salt() -> None:
    mine = temp_name()[len(TMP_PREFIX):].split("-")[1][:8]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: same counter state, new pid, and it must not reuse the parent's salt
        os.close(r)
        os.write(w, temp_name().encode())
        os._exit(0)
    os.close(w)
    child = os.read(r, 200).decode()
    os.close(r)
    os.waitpid(pid, 0)
    cpid, unique, _ = child[len(TMP_PREFIX):].split("-")
    assert int(cpid) == pid and unique[:8] != mine
