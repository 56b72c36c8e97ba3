"""Engines on several client mounts of one shared root, with faults; writes the JSONL history tools/dfs_history.py
checks. Used by tools/dfs_check.sh (MooseFS from tools/dfs_up.sh).

    python tools/dfs_run.py --mounts M0 M1 M2 --dfs-dir D --history H.jsonl [--rounds R] [--faults F,...]

Engines: two on the first mount, one on each other mount. The sampler (this process, reading the root through the
first mount with os only) records the bytes of .kvf files and the lease holder every 0.1 s. Faults, in order,
while the engines run: ``kill`` (kill -9 of the engine holding the lease), ``cs`` (chunkserver stop, then start),
``master`` (master restart), ``umount`` (the last mount torn away with umount -l: a host vanishing; its engine
goes on against a dead mount). Every fault is a record with its start and end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
CHILD = os.path.join(TESTS, "dfs_child.py")
FILE = 4 * 16 * 576 * 2 + 4096  # one chunk file of the child's deployment (as tests/shared_root.py)
MAX = 20 * FILE
ALLOWANCE = 3 * FILE
INTERVAL = 0.2


def usage(root: str) -> int:
    n = 0
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in (".quarantine", ".kvformat")]
        for f in files:
            if f.endswith(".kvf"):
                try:
                    n += os.stat(os.path.join(d, f)).st_size
                except OSError:
                    pass
    return n


def lease(root: str) -> tuple[int | None, int | None, str | None]:
    ctl = os.path.join(root, ".kvformat")
    try:
        gens = sorted(g for g in os.listdir(os.path.join(ctl, "lease")) if g.isdigit())
        owner = json.load(open(os.path.join(ctl, "lease", gens[-1]))) if gens else {}
        with open(os.path.join(ctl, "state.json"), "rb") as f:
            st = hashlib.sha256(f.read()).hexdigest()[:16]
    except (OSError, ValueError, IndexError):
        return None, None, None
    return (int(gens[-1]) if gens else None), owner.get("pid"), st


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mounts", nargs="+", required=True)
    ap.add_argument("--dfs-dir", required=True)
    ap.add_argument("--history", required=True)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--faults", default="kill,cs,master,umount")
    ap.add_argument("--sub", default="kvroot")
    a = ap.parse_args()
    faults = [f for f in a.faults.split(",") if f]
    hist = open(a.history, "w", buffering=1)
    lock = threading.Lock()

    def rec(**kw: object) -> None:
        with lock:
            hist.write(json.dumps(kw) + "\n")

    roots = [os.path.join(m, a.sub) for m in a.mounts]
    os.makedirs(roots[0], exist_ok=True)
    go = os.path.join("/tmp", f"kvf-dfs-go-{os.getpid()}")
    for p in (go, go + ".store", go + ".final"):
        if os.path.exists(p):
            os.unlink(p)
    placement = [roots[0]] + roots
    names = [f"e{i}" for i in range(len(placement))]
    rec(op="config", bound=MAX, chunk=FILE, engines=names, mounts=a.mounts, rounds=a.rounds, start=time.time())
    procs = {}
    for i, (n, r) in enumerate(zip(names, placement)):
        cfg = {"root": r, "go": go, "seed": i, "rounds": a.rounds, "keys": 40, "pause": INTERVAL, "engine": n,
               "engines": names, "history": a.history + f".{n}",
               "tier": {"max_bytes": MAX, "shared_allowance": ALLOWANCE, "shared_interval_s": INTERVAL}}
        procs[n] = subprocess.Popen([sys.executable, CHILD, ROOT, TESTS, json.dumps(cfg)], stdout=subprocess.PIPE,
                                    stderr=open(a.history + f".{n}.err", "w"), text=True)
    pids = {}
    for n, p in procs.items():
        line = p.stdout.readline() if p.stdout else ""
        if not line.startswith("{"):
            print(f"engine {n} did not start: {line!r}", file=sys.stderr)
            return 1
        pids[n] = json.loads(line)["pid"]
        rec(op="engine", engine=n, pid=pids[n], start=time.time())
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            t = time.time()
            g, pid, st = lease(roots[0])
            rec(op="sample", t=t, usage=usage(roots[0]), lease_gen=g, lease_pid=pid, state=st)
            time.sleep(0.1)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    open(go, "w").close()
    cfgs = {"master": os.path.join(a.dfs_dir, "cfg", "mfsmaster.cfg"),
            "cs": os.path.join(a.dfs_dir, "cfg", "mfschunkserver.cfg")}
    netns = ["nsenter", f"--net=/var/run/netns/{os.environ.get('KVF_DFS_NS', 'kvfdfs')}"]
    killed: set[str] = set()
    before = None
    for f in faults:
        time.sleep(4)
        before = lease(roots[0])[2]  # the state the checker compares the take-over after this fault with
        t0 = time.time()
        target = None
        if f == "kill":
            _, pid, _ = lease(roots[0])
            target = next((n for n, p in pids.items() if p == pid), None)
            if target is not None:
                os.kill(pids[target], signal.SIGKILL)
                killed.add(target)
        elif f == "cs":
            subprocess.run(netns + ["mfschunkserver", "-c", cfgs["cs"], "stop"], capture_output=True)
            time.sleep(2)
            subprocess.run(netns + ["mfschunkserver", "-c", cfgs["cs"], "start"], capture_output=True)
        elif f == "master":
            subprocess.run(netns + ["mfsmaster", "-c", cfgs["master"], "restart"], capture_output=True)
        elif f == "umount":
            subprocess.run(["umount", "-l", a.mounts[-1]], capture_output=True)
            target = names[-1]
        rec(op="fault", kind=f, target=target, target_pid=pids.get(target or ""), start=t0, end=time.time())
    # The checker reads each fault's take-over from the samples after it. When the faults outlast the rounds (a
    # chunkserver that takes minutes to come back) the engines would be released at once and the history end
    # before a take-over after the last fault could be seen: hold them (the gates below) until the state moves
    # on from the one before that fault, or 30 s (the checker's limit) have passed. A state that cannot be read (a
    # lease file half written by the engine taking over, a listing during a rename) has not moved on: CI's run at
    # 098ede3 stopped holding on such a read 0.2 s into a take-over and the history ended before its first state.
    return finish_run(a.history, names, killed, procs, go, stop, th, rec, hist,
                      lambda: bool(faults) and lease(roots[0])[2] in (before, None))


def finish_run(history: str, names: list[str], killed: set[str], procs: dict[str, Any], go: str,
               stop: threading.Event, sampler: threading.Thread, rec: Callable[..., None], hist: Any,
               unsettled: Callable[[], bool]) -> int:
    """The end of a fault run (this one's and tools/rgw_run.py's): hold the engines while ``unsettled()`` (for
    30 s at most, the checker's limit), release them through the two gates, reap them (a wedged one is killed and
    named), and append every engine's history to the run's. Returns the driver's exit status (0)."""
    settle = time.time() + 30
    while time.time() < settle and unsettled():
        time.sleep(0.2)
    deadline = time.time() + 300
    wedged = []
    # Every engine writes "stored_final" once its rounds and final store are through: then the final loads start.
    live = [n for n in names if n not in killed]
    for step, opens in (('"rounds_done"', ".store"), ('"stored_final"', ".final")):
        while time.time() < deadline:
            done = [n for n in live if any(step in ln for ln in _lines(history + f".{n}"))
                    or procs[n].poll() is not None]
            if len(done) == len(live):
                break
            time.sleep(0.2)
        open(go + opens, "w").close()
    for n in live:
        try:
            procs[n].wait(timeout=max(5, deadline - time.time()))
        except subprocess.TimeoutExpired:
            wedged.append(n)
            procs[n].kill()
    for n in killed:
        procs[n].wait()
    stop.set()
    sampler.join()
    rec(op="end", start=time.time(), wedged=wedged, killed=sorted(killed),
        exits={n: procs[n].returncode for n in names})
    hist.close()
    with open(history, "a") as out:  # one history: the run's records, then each engine's
        for n in names:
            for ln in _lines(history + f".{n}"):
                out.write(ln if ln.endswith("\n") else ln + "\n")
    for p in (go, go + ".store", go + ".final"):
        os.unlink(p)
    return 0


def _lines(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.readlines()
    except OSError:
        return []


if __name__ == "__main__":
    sys.exit(main())
