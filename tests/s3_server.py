"""A real S3 API server for tests and benchmarks: moto's standalone server in a child process on 127.0.0.1, or
Ceph's RADOS gateway (tools/rgw_up.sh) when ``KVFORMAT_RGW_ENV`` names the env file rgw_up.sh wrote.

``S3Server`` starts ``python -m moto.server`` on a free loopback port and can be stopped and started
again on the same port (objects are lost: moto keeps them in memory), or paused with SIGSTOP (the
socket still accepts connections but nothing answers: a hung server) and resumed with SIGCONT
(objects kept). ``s3_server`` is a session fixture; ``s3_env`` points s3fs/botocore at it through
the environment, the way a deployment would configure credentials.

With ``KVFORMAT_RGW_ENV`` set, ``s3_server`` is an :class:`RGWServer` instead (the same methods: stop and start end
and restart the gateway process, pause and resume SIGSTOP/SIGCONT it; objects survive a restart, ``keeps_objects``)
and ``ACCESS_KEY``/``SECRET_KEY`` are the gateway user's keys, so every test on these fixtures runs on RGW
(tools/rgw_check.sh). A server a test starts itself (``S3Server()``) is moto either way.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from typing import Any, Iterator

import pytest



def rgw_env(path: str | None = None) -> dict[str, str] | None:
    """The KEY=VALUE lines of tools/rgw_up.sh's env file (``KVFORMAT_RGW_ENV``), or None when RGW is not configured."""
    path = path if path is not None else os.environ.get("KVFORMAT_RGW_ENV")
    if not path:
        return None
    with open(path) as f:
        return dict(ln.strip().split("=", 1) for ln in f if "=" in ln)


RGW = rgw_env()
ACCESS_KEY = RGW["KVF_RGW_ACCESS_KEY"] if RGW else "AKIAKVFTESTKEY000001"
# distinctive, so a leak into logs or errors is findable (rgw_up.sh makes its secret the same way)
SECRET_KEY = RGW["KVF_RGW_SECRET_KEY"] if RGW else "kvf-test-secret-Zq8uW3nR5tY7vB9x"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """moto's S3 server as a child process. ``endpoint`` is its URL."""

    keeps_objects = False  # moto holds objects in its memory: a restart loses them

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused = False

    def start(self, timeout: float = 30.0) -> None:
        env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.proc.returncode}")
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1).read()
                return
            except OSError:
                if time.monotonic() - t0 > timeout:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.paused:
            self.resume()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        """Stop, then start on the same port (objects and buckets are gone)."""
        self.stop()
        self.start()

    def pause(self) -> None:
        """SIGSTOP: connections are accepted by the kernel, requests never answered."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    def storage_options(self) -> dict[str, object]:
        """Explicit s3fs options for this server (the alternative to the environment)."""
        return {"endpoint_url": self.endpoint, "key": ACCESS_KEY, "secret": SECRET_KEY}

    def make_bucket(self, name: str | None = None) -> str:
        import boto3

        name = name or f"kvf-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                     region_name="us-east-1").create_bucket(Bucket=name)
        return name

    def __enter__(self) -> "S3Server":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class RGWServer(S3Server):
    """The radosgw process of tools/rgw_up.sh, driven like :class:`S3Server`: ``stop``/``start`` end and restart the
    gateway (the cluster and its objects stay), ``pause``/``resume`` SIGSTOP/SIGCONT it."""

    keeps_objects = True

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.endpoint = env["KVF_RGW_ENDPOINT"]
        self.port = int(self.endpoint.rsplit(":", 1)[1])
        self.paused = False

    @property
    def pid(self) -> int | None:
        try:
            with open(self.env["KVF_RGW_PIDFILE"]) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            return None
        return pid if _alive(pid) else None

    @property  # type: ignore[override]
    def proc(self) -> int | None:  # tests ask ``proc is None`` for "not running"
        return self.pid

    def start(self, timeout: float = 60.0) -> None:
        if self.pid is None:
            subprocess.run(["bash", self.env["KVF_RGW_START"]], check=True)
        t0 = time.monotonic()
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/", timeout=2).read()
                return
            except urllib.error.HTTPError:
                return  # an S3 error answer: the gateway serves
            except OSError:
                if time.monotonic() - t0 > timeout:
                    raise
                time.sleep(0.2)

    def stop(self) -> None:
        pid = self.pid
        if pid is None:
            return
        if self.paused:
            self.resume()
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
            while _alive(pid):
                time.sleep(0.05)

    def pause(self) -> None:
        pid = self.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        pid = self.pid
        assert pid is not None
        os.kill(pid, signal.SIGCONT)
        self.paused = False

    def client(self) -> Any:
        """A boto3 S3 client with the gateway user's keys (the tests' own view of the bucket, no kvformat code)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.env["KVF_RGW_ACCESS_KEY"],
                            aws_secret_access_key=self.env["KVF_RGW_SECRET_KEY"], region_name="us-east-1")

    def storage_options(self) -> dict[str, object]:
        return {"endpoint_url": self.endpoint, "key": self.env["KVF_RGW_ACCESS_KEY"],
                "secret": self.env["KVF_RGW_SECRET_KEY"]}

    def make_bucket(self, name: str | None = None) -> str:
        name = name or f"kvf-{uuid.uuid4().hex[:12]}"
        c = self.client()
        try:
            c.create_bucket(Bucket=name)
        except c.exceptions.BucketAlreadyOwnedByYou:
            pass  # the gateway kept it across a restart (moto's restart loses it: the tests create it again)
        return name


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    srv = RGWServer(RGW) if RGW else S3Server()
    srv.start()
    try:
        yield srv
    finally:
        if RGW:  # the gateway belongs to tools/rgw_up.sh: left serving for the steps after these tests
            if srv.paused:
                srv.resume()
            srv.start()
        else:
            srv.stop()


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The server, with credentials and endpoint in the environment (``AWS_ENDPOINT_URL`` …)."""
    if s3_server.proc is None:
        s3_server.start()
    if s3_server.paused:
        s3_server.resume()
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    return s3_server


@pytest.fixture
def s3_bucket(s3_env: S3Server) -> str:
    """A fresh bucket on the server."""
    return s3_env.make_bucket()
