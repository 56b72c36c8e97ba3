"""The CLI on ``s3://`` roots (moto on 127.0.0.1; endpoint and credentials from the environment)."""

from __future__ import annotations

import hashlib
import json
import time

import numpy as np
import pytest

import kvformat as K
from kvformat._cli import main
from kvformat.storage import open_store
from s3_server import S3Server, s3_bucket, s3_env, s3_server  # noqa: F401

L = K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V2-Lite", "bfloat16",
                              [f"model.layers.{i}.self_attn.attn" for i in range(3)], 16, 576)


def key(i: int) -> K.BlockKey:
    return K.BlockKey(hashlib.sha256(f"cli/{i}".encode()).hexdigest())


def test_gc_on_s3_evicts_least_recently_used(s3_bucket: str, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"s3://{s3_bucket}/cache"
    st = open_store(url)
    rels = []
    for i in range(3):
        rels.append(st.put_block(np.full(L.payload_bytes, i, dtype=np.uint8), L, key(i))[0])
        time.sleep(1.1)  # S3 LastModified has one-second resolution
    st.touch(rels[0])  # used again: now the newest
    size = st.read_header(rels[0]).file_bytes

    assert main(["gc", url, "--max-bytes", str(2 * size), "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [v["path"] for v in plan["evicted"]] == [rels[1]] and plan["deleted"] == 0
    assert len(list(st.list())) == 3

    assert main(["gc", url, "--max-bytes", str(2 * size), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["deleted"] == 1 and rep["freed_bytes"] == size and rep["bytes_after"] == 2 * size
    st.forget()
    assert {e.relpath for e in st.list()} == {rels[0], rels[2]}

    assert main(["gc", url, "--max-bytes", "1"]) == 0
    assert "evicted 2" in capsys.readouterr().out and not list(st.list())
