"""A real S3 API server for tests and benchmarks: moto's standalone server in a child process on 127.0.0.1.

``S3Server`` starts ``python -m moto.server`` on a free loopback port and can be stopped and started
again on the same port (objects are lost: moto keeps them in memory), or paused with SIGSTOP (the
socket still accepts connections but nothing answers: a hung server) and resumed with SIGCONT
(objects kept). ``s3_server`` is a session fixture; ``s3_env`` points s3fs/botocore at it through
the environment, the way a deployment would configure credentials.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from typing import Iterator

import pytest

ACCESS_KEY = "AKIAKVFTESTKEY000001"
SECRET_KEY = "kvf-test-secret-Zq8uW3nR5tY7vB9x"  # distinctive, so a leak into logs or errors is findable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """moto's S3 server as a child process. ``endpoint`` is its URL."""

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


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    srv = S3Server()
    srv.start()
    try:
        yield srv
    finally:
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
