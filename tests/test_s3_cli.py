"""The CLI on ``s3://`` roots (moto on 127.0.0.1; endpoint and credentials from the environment)."""

from __future__ import annotations

import hashlib
import json
import time

import numpy as np
import pytest

import kvformat as K
from kvformat.cli import main
from kvformat.storage import open_store
from s3_server import S3Server, s3_bucket, s3_env, s3_server  # noqa: F401

L = K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V2-Lite", "bfloat16",
                              [f"model.layers.{i}.self_attn.attn" for i in range(3)], 16, 576)


def key(i: int) -> K.BlockKey:
    return K.BlockKey(hashlib.sha256(f"cli/{i}".encode()).hexdigest())


def test_gc_on_s3_evicts_least_recently_used(s3_bucket: str, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"s3://{s3_bucket}/cache"
    st = open_store(url)
    st.ensure_namespace(L)  # as the tier does at start-up: gc works on kvformat roots only
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
    assert "deleted 2 least recently used files" in capsys.readouterr().out and not list(st.list())


def _corrupt(server: S3Server, bucket: str, k: str) -> None:
    """Flip the last payload byte of an object in place, through the S3 API (no kvformat code)."""
    import boto3

    from s3_server import ACCESS_KEY, SECRET_KEY

    c = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=ACCESS_KEY,
                     aws_secret_access_key=SECRET_KEY, region_name="us-east-1")
    raw = bytearray(c.get_object(Bucket=bucket, Key=k)["Body"].read())
    raw[-1] ^= 1
    c.put_object(Bucket=bucket, Key=k, Body=bytes(raw))


def _fill(url: str, n: int) -> list[str]:
    st = open_store(url)
    st.ensure_namespace(L)
    return [st.put_block(np.full(L.payload_bytes, i, dtype=np.uint8), L, key(i))[0] for i in range(n)]


def test_inspect_json_on_s3_root_matches_schema(s3_bucket: str, capsys: pytest.CaptureFixture[str]) -> None:
    from kvformat.cli._schema import INSPECT_SCHEMA, validate

    url = f"s3://{s3_bucket}/cache"
    rels = _fill(url, 4)
    L2 = K.CanonicalLayout.uniform("meta-llama/Llama-3.1-8B", "bfloat16", ["l0", "l1"], 16, 8 * 128 * 2)
    open_store(url).ensure_namespace(L2)  # a namespace with no files yet still shows up

    assert main(["inspect", url, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert validate(d, INSPECT_SCHEMA) == [], validate(d, INSPECT_SCHEMA)
    assert d["kind"] == "kvformat_root" and d["path"] == url and d["verified_data"] is False
    by = {n["namespace"]: n for n in d["namespaces"]}
    assert set(by) == {L.namespace(), L2.namespace()}
    n = by[L.namespace()]
    size = open_store(url).read_header(rels[0]).file_bytes
    assert (n["files"], n["bytes"], n["model"], n["layers"], n["tp_sizes"], n["corrupt"]) == \
        (4, 4 * size, L.model, 3, [1], 0)
    assert by[L2.namespace()]["files"] == 0 and by[L2.namespace()]["model"] == L2.model  # from namespace.json
    assert d["totals"] == {"namespaces": 2, "files": 4, "bytes": 4 * size, "corrupt": 0}

    # One object URL: the file view, data checked.
    assert main(["inspect", f"{url}/{rels[2]}", "--json"]) == 0
    f = json.loads(capsys.readouterr().out)
    assert validate(f, INSPECT_SCHEMA) == [] and f["kind"] == "file" and f["checksum"] == {"header": "ok", "data": "ok"}
    assert f["header"]["key"]["hash"] == key(2).hash and len(f["layers"]) == 3

    assert main(["inspect", url]) == 0  # the table for people
    assert L.namespace() in capsys.readouterr().out


def test_verify_on_s3_finds_and_quarantines_a_corrupt_object(s3_env: S3Server, s3_bucket: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    url = f"s3://{s3_bucket}/cache"
    rels = _fill(url, 5)
    assert main(["verify", url, "--json"]) == 0  # clean root
    clean = json.loads(capsys.readouterr().out)
    assert clean["checked"] == 5 and clean["bad"] == [] and clean["exit_code"] == 0

    _corrupt(s3_env, s3_bucket, f"cache/{rels[3]}")
    # Header-only inspect cannot see a payload flip; --verify and verify do.
    assert main(["inspect", url, "--json"]) == 0
    capsys.readouterr()
    assert main(["inspect", url, "--json", "--verify"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["totals"]["corrupt"] == 1 and d["namespaces"][0]["bad_files"][0]["path"] == rels[3]
    assert main(["inspect", f"{url}/{rels[3]}"]) == 1
    assert "data BAD" in capsys.readouterr().out

    assert main(["verify", f"{url}/{L.namespace()}", "--json"]) == 1  # a namespace URL
    ns = json.loads(capsys.readouterr().out)
    assert ns["checked"] == 5 and [b["path"] for b in ns["bad"]] == [f"{url}/{rels[3]}"]

    assert main(["verify", url, "--quarantine", "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["checked"] == 5 and [(b["path"], b["reason"]) for b in rep["bad"]] == [(f"{url}/{rels[3]}",
                                                                                       "ChecksumError")]
    assert rep["quarantined"] == [f"{url}/.quarantine/{rels[3]}.ChecksumError"]
    st = open_store(url)
    assert {e.relpath for e in st.list()} == set(rels) - {rels[3]}
    assert st.exists(f".quarantine/{rels[3]}.ChecksumError")

    assert main(["verify", url]) == 0  # the rest is intact
    assert "checked 4 files: 0 bad" in capsys.readouterr().out


def test_verify_on_s3_single_object_and_missing_object(s3_env: S3Server, s3_bucket: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    url = f"s3://{s3_bucket}/cache"
    rels = _fill(url, 2)
    assert main(["verify", f"{url}/{rels[0]}"]) == 0
    assert "checked 1 files: 0 bad" in capsys.readouterr().out
    _corrupt(s3_env, s3_bucket, f"cache/{rels[0]}")
    assert main(["verify", f"{url}/{rels[0]}", "--quarantine", "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["quarantined"] == [f"{url}/.quarantine/{rels[0]}.ChecksumError"]  # under the root, not the object's dir
    assert main(["verify", f"{url}/{rels[0]}"]) == 2  # gone: an I/O error, not "all good"
    assert f"{url}/{rels[0]}: no such object" in capsys.readouterr().err
    assert main(["inspect", f"{url}/{rels[0]}"]) == 2
