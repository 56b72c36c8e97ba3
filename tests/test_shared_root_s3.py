"""One max_bytes for an S3 root two engine processes share (issue 21 item 1), through vLLM's real tiering manager
and moto's S3 server on 127.0.0.1; usage sampled from the server's listing. Helpers: tests/shared_root.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from s3_server import s3_bucket, s3_env, s3_server  # noqa: F401
from shared_root import MAX, TESTS, Sampler, check, finish, start


def test_two_engines_one_bound_s3_root(s3_bucket: str, s3_env) -> None:  # noqa: F811
    pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM is installed by tools/setup.sh")
    import boto3

    from s3_server import ACCESS_KEY, SECRET_KEY

    root, go = f"s3://{s3_bucket}/shared", os.path.join(str(Path(TESTS).parent), f".go-{s3_bucket}")
    client = boto3.client("s3", endpoint_url=s3_env.endpoint, aws_access_key_id=ACCESS_KEY,
                          aws_secret_access_key=SECRET_KEY, region_name="us-east-1")

    def used() -> int:
        n = 0
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=s3_bucket, Prefix="shared/"):
            n += sum(o["Size"] for o in page.get("Contents", ()) if o["Key"].endswith(".kvf"))
        return n

    try:
        procs = start(root, go, 2, 15, {"storage_options": {"timeout_s": 10}})
        sampler = Sampler(used, 0.02)
        open(go, "w").close()
        results = finish(procs)
        sampler.stop()
    finally:
        if os.path.exists(go):
            os.unlink(go)
    total = check(results)
    print(json.dumps({"max_bytes": MAX, "peak": sampler.peak, "samples": sampler.samples, **total}))
    assert sampler.samples > 20
    assert sampler.peak <= MAX, (sampler.peak, MAX)
