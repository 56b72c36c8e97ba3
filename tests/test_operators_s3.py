"""An unusable S3 root fails vLLM's start-up naming the parameter to fix (issue 21 item 2): a bucket typo (``root``),
an endpoint nobody listens on (``storage_options.endpoint_url``), and wrong credentials (``storage_options``) on a
moto server that checks them (IAM on, as AWS does). With ``start_degraded`` the tier starts, counts what it could
not store and serves misses. A namespace file deleted under a running tier stops its stores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from typing import Iterator

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM is installed by tools/setup.sh")

from vllm_harness import Deployment, kvformat_tier, make_keys, make_payload, wait_for  # noqa: E402

from kvformat.errors import RootUnusableError  # noqa: E402
from s3_server import ACCESS_KEY, SECRET_KEY, S3Server, free_port, s3_bucket, s3_env, s3_server  # noqa: E402,F401

N_LAYERS = 3
OPTS = {"timeout_s": 3, "max_retries": 1}


def s3tier(url: str, **kw: object) -> dict:
    return kvformat_tier(url, read_threads=2, write_threads=2, shared_interval_s=0.1, **kw)


@pytest.fixture(scope="module")
def iam_server() -> Iterator[tuple[S3Server, dict[str, str], str]]:
    """A moto server that authenticates requests (after the first three, which create a user and its key)."""
    srv = S3Server()
    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="3")
    srv.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(srv.port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{srv.endpoint}/moto-api/", timeout=1).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        import boto3

        iam = boto3.client("iam", endpoint_url=srv.endpoint, aws_access_key_id="x", aws_secret_access_key="y",
                           region_name="us-east-1")
        iam.create_user(UserName="kvf")
        iam.put_user_policy(UserName="kvf", PolicyName="all", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
        k = iam.create_access_key(UserName="kvf")["AccessKey"]
        creds = {"key": k["AccessKeyId"], "secret": k["SecretAccessKey"]}
        boto3.client("s3", endpoint_url=srv.endpoint, aws_access_key_id=creds["key"],
                     aws_secret_access_key=creds["secret"], region_name="us-east-1").create_bucket(Bucket="kvf-iam")
        yield srv, creds, "kvf-iam"
    finally:
        srv.stop()


def test_bucket_typo_names_root(s3_bucket: str) -> None:  # noqa: F811
    with pytest.raises(RootUnusableError, match=r"^root: s3://kvf-no-such-bucket-\w+/x: the bucket") as e:
        Deployment([s3tier(f"s3://kvf-no-such-bucket-{s3_bucket[4:]}/x", storage_options=OPTS)], n_layers=N_LAYERS)
    assert e.value.field == "root" and isinstance(e.value.cause, FileNotFoundError)


def test_endpoint_down_names_endpoint_url_and_degraded_start(s3_env: S3Server) -> None:  # noqa: F811
    dead = f"http://127.0.0.1:{free_port()}"
    opts = {**OPTS, "endpoint_url": dead}
    with pytest.raises(RootUnusableError, match=r"^storage_options.endpoint_url: the storage endpoint") as e:
        Deployment([s3tier("s3://kvf-any/x", storage_options=opts)], n_layers=N_LAYERS)
    assert isinstance(e.value.cause, (ConnectionError, TimeoutError)), repr(e.value.cause)
    with Deployment([s3tier("s3://kvf-any/x", storage_options=opts, start_degraded=True)], n_layers=N_LAYERS) as dep:
        tier = dep.tier()
        keys = make_keys(2, "dead endpoint")
        items = {k: make_payload(k.hex(), dep.slot_bytes) for k in keys}
        dep.store(items)
        c = tier.counters()
        assert c["root_healthy"] == 0 and c["files_written"] == 0 and c["store_failures:root_degraded"] == 2
        dep.evict_primary()
        assert dep.load(keys) == {k: None for k in keys}


def test_wrong_credentials_name_storage_options(iam_server: tuple[S3Server, dict[str, str], str]) -> None:
    srv, creds, bucket = iam_server
    good = {**OPTS, "endpoint_url": srv.endpoint, **creds}
    for bad, what in (({**good, "secret": "not-the-secret"}, "signature"), ({**good, "key": "AKIANOSUCHKEY0000000"},
                                                                             "Access Key Id")):
        with pytest.raises(RootUnusableError, match=r"^storage_options: access to s3://kvf-iam/x was denied") as e:
            Deployment([s3tier(f"s3://{bucket}/x", storage_options=bad)], n_layers=N_LAYERS)
        assert isinstance(e.value.cause, PermissionError) and what in str(e.value), str(e.value)
        assert bad["secret"] not in str(e.value) and creds["secret"] not in str(e.value)  # never shown
    with Deployment([s3tier(f"s3://{bucket}/x", storage_options=good)], n_layers=N_LAYERS) as dep:
        keys = make_keys(2, "good credentials")
        items = {k: make_payload(k.hex(), dep.slot_bytes) for k in keys}
        dep.store(items)
        dep.evict_primary()
        assert dep.load(keys) == items


def test_namespace_deleted_under_a_running_tier_stops_stores(s3_bucket: str) -> None:  # noqa: F811
    import boto3

    with Deployment([s3tier(f"s3://{s3_bucket}/x", storage_options=OPTS)], n_layers=N_LAYERS) as dep:
        tier = dep.tier()
        ns = tier.namespace
        client = boto3.client("s3", region_name="us-east-1")  # endpoint and credentials from the environment
        client.delete_object(Bucket=s3_bucket, Key=f"x/{ns}/namespace.json")  # the prefix was wiped
        wait_for(lambda: not tier.counters()["root_healthy"], 10)  # asserted with the counters below
        keys = make_keys(2, "wiped")
        dep.store({k: make_payload(k.hex(), dep.slot_bytes) for k in keys})
        c = tier.counters()
        assert c["root_healthy"] == 0 and c["files_written"] == 0 and c["store_failures:root_lost"] == 2, c
