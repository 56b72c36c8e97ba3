"""Two engines on one bounded ``s3://`` root on Ceph's RADOS gateway, with faults; writes the JSONL history that
tools/dfs_history.py checks (the MooseFS run's checker, unchanged). Used by tools/rgw_check.sh (RGW from
tools/rgw_up.sh).

    python tools/rgw_run.py --env /tmp/kvf-rgw/env --history H.jsonl [--rounds R] [--faults F,...]

Why not tools/dfs_run.py: it reads the root through a mount with ``os`` and its faults are MooseFS daemons. The
engines (tests/dfs_child.py, a real KVFormatTier each) and the record format are the same; here the sampler
(this process) reads the bucket with boto3 only: the bytes of ``.kvf`` objects under the root and the lease
holder, every 0.1 s. Faults, in order, while the engines run: ``gw`` (the gateway stopped with SIGTERM and
started again 2 s later: connections refused meanwhile, objects kept), ``pause`` (the gateway SIGSTOPped for 3 s:
requests hang), ``kill`` (kill -9 of the engine holding the lease). Every fault is a record with its start and
end.
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
import uuid
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from dfs_run import ALLOWANCE, CHILD, FILE, INTERVAL, MAX, ROOT, TESTS, finish_run  # noqa: E402
from s3_server import RGWServer, rgw_env  # noqa: E402


class Bucket:
    """The root as the S3 API shows it (boto3, no kvformat code): usage and the lease, for the sampler."""

    def __init__(self, srv: RGWServer, bucket: str, prefix: str) -> None:
        from botocore.config import Config

        self.bucket, self.prefix = bucket, prefix.rstrip("/") + "/"
        import boto3

        self.c = boto3.client("s3", endpoint_url=srv.endpoint, region_name="us-east-1",
                              aws_access_key_id=srv.env["KVF_RGW_ACCESS_KEY"],
                              aws_secret_access_key=srv.env["KVF_RGW_SECRET_KEY"],
                              config=Config(connect_timeout=1, read_timeout=2, retries={"max_attempts": 1}))

    def _keys(self, sub: str = "") -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for page in self.c.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix + sub):
            out += page.get("Contents", [])
        return out

    def usage(self) -> int | None:
        """Bytes of block objects under the root (quarantine and control records excluded), None if unreadable."""
        try:
            objs = self._keys()
        except Exception:  # noqa: BLE001 - the gateway is down during a fault: no sample, not a zero
            return None
        n = 0
        for o in objs:
            rel = o["Key"][len(self.prefix):]
            if rel.endswith(".kvf") and not rel.startswith((".quarantine/", ".kvformat/")) \
                    and not rel.rsplit("/", 1)[-1].startswith(".kvf-tmp-"):
                n += o["Size"]
        return n

    def lease(self) -> tuple[int | None, int | None, str | None]:
        try:
            gens = sorted((g for g in (o["Key"].rsplit("/", 1)[-1] for o in self._keys(".kvformat/lease/"))
                           if g.isdigit()), key=int)
            owner = json.loads(self._get(f".kvformat/lease/{gens[-1]}")) if gens else {}
            st = hashlib.sha256(self._get(".kvformat/state.json")).hexdigest()[:16]
        except Exception:  # noqa: BLE001 - not there yet, or the gateway is down
            return None, None, None
        return (int(gens[-1]) if gens else None), owner.get("pid"), st

    def _get(self, rel: str) -> bytes:
        body: bytes = self.c.get_object(Bucket=self.bucket, Key=self.prefix + rel)["Body"].read()
        return body


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", default=os.environ.get("KVFORMAT_RGW_ENV", "/tmp/kvf-rgw/env"))
    ap.add_argument("--history", required=True)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--faults", default="gw,pause,kill")
    ap.add_argument("--repo", default=ROOT, help="the kvformat checkout the engines import (default: this one)")
    a = ap.parse_args()
    env = rgw_env(a.env)
    assert env is not None
    srv = RGWServer(env)
    faults = [f for f in a.faults.split(",") if f]
    hist = open(a.history, "w", buffering=1)
    lock = threading.Lock()

    def rec(**kw: object) -> None:
        with lock:
            hist.write(json.dumps(kw) + "\n")

    prefix = f"kvroot-{uuid.uuid4().hex[:8]}"  # a fresh root per run in the one bucket
    root = f"s3://{env['KVF_RGW_BUCKET']}/{prefix}"
    view = Bucket(srv, env["KVF_RGW_BUCKET"], prefix)
    go = os.path.join("/tmp", f"kvf-rgw-go-{os.getpid()}")
    names = [f"e{i}" for i in range(a.engines)]
    rec(op="config", bound=MAX, chunk=FILE, engines=names, mounts=[root], rounds=a.rounds, start=time.time())
    # The engines read the endpoint and keys from the environment, as a deployment's s3fs would.
    child_env = dict(os.environ, AWS_ENDPOINT_URL=env["KVF_RGW_ENDPOINT"], AWS_ACCESS_KEY_ID=env["KVF_RGW_ACCESS_KEY"],
                     AWS_SECRET_ACCESS_KEY=env["KVF_RGW_SECRET_KEY"], AWS_DEFAULT_REGION="us-east-1")
    procs = {}
    for i, n in enumerate(names):
        cfg = {"root": root, "go": go, "seed": i, "rounds": a.rounds, "keys": 40, "pause": INTERVAL, "engine": n,
               "engines": names, "history": a.history + f".{n}",
               "tier": {"max_bytes": MAX, "shared_allowance": ALLOWANCE, "shared_interval_s": INTERVAL,
                        "storage_options": {"timeout_s": 5, "max_retries": 2}}}
        procs[n] = subprocess.Popen([sys.executable, CHILD, a.repo, TESTS, json.dumps(cfg)], stdout=subprocess.PIPE,
                                    stderr=open(a.history + f".{n}.err", "w"), text=True, env=child_env)
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
            u = view.usage()
            g, pid, st = view.lease()
            if u is not None:  # while the gateway is down there is nothing to sample
                rec(op="sample", t=t, usage=u, lease_gen=g, lease_pid=pid, state=st)
            time.sleep(0.1)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    open(go, "w").close()
    killed: set[str] = set()
    before = None
    for f in faults:
        time.sleep(4)
        before = view.lease()[2]
        t0 = time.time()
        target = None
        if f == "kill":
            _, pid, _ = view.lease()
            target = next((n for n, p in pids.items() if p == pid), None)
            if target is not None:
                os.kill(pids[target], signal.SIGKILL)
                killed.add(target)
        elif f == "gw":
            srv.stop()
            time.sleep(2)
            srv.start()
        elif f == "pause":
            srv.pause()
            time.sleep(3)
            srv.resume()
        rec(op="fault", kind=f, target=target, target_pid=pids.get(target or ""), start=t0, end=time.time())
    # As tools/dfs_run.py: the engines are held at the barriers below until the state moves on from the one before
    # the last fault (or 30 s, the checker's limit), so a take-over after it can be seen in the samples.
    return finish_run(a.history, names, killed, procs, go, stop, th, rec, hist,
                      lambda: bool(faults) and view.lease()[2] in (before, None))


if __name__ == "__main__":
    sys.exit(main())
