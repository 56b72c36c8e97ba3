"""``kvformat inspect / verify / gc`` and the CLI's exit codes and ``--json`` schema."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvformat as K
from kvformat.cli import main
from kvformat.cli._schema import INSPECT_SCHEMA, validate
from kvformat.admin._gc import plan_gc
from kvformat.storage import open_store

from legacy_trees import MODEL, build, layer_names



def _layout(bpc: int = 1) -> K.CanonicalLayout:
    return K.CanonicalLayout.uniform(MODEL, "bfloat16", layer_names(4), 16, 576, blocks_per_chunk=bpc)


def _root(tmp_path, n: int = 6, codec: str = "none", tp: int = 2) -> tuple[str, list[str]]:
    store = open_store(str(tmp_path / "kv"))
    L = _layout()
    store.ensure_namespace(L)
    rels = []
    for i in range(n):
        pay = np.random.default_rng(i).integers(0, 256, L.payload_bytes, dtype=np.uint8)
        pay[: L.payload_bytes // 2] = 0  # compressible half, so zstd has a ratio to show
        rel, _, _ = store.put_block(pay, L, K.BlockKey(f"{i:02x}" * 32), codec=codec,
                                    provenance=K.Provenance(tp=tp, row="per_worker", writer="test", created=1_700_000_000 + i))
        os.utime(os.path.join(store.root, rel), (1_700_000_000 + i, 1_700_000_000 + i))
        rels.append(rel)
    return store.root, rels


def _run_json(argv, capsys) -> tuple[int, dict]:
    rc = main(argv + ["--json"])
    return rc, json.loads(capsys.readouterr().out)


def _flip(path: str, offset_from_end: int = 1) -> None:
    raw = bytearray(open(path, "rb").read())
    raw[-offset_from_end] ^= 0x40
    open(path, "wb").write(raw)


# -- inspect -------------------------------------------------------------------------------------------
def test_inspect_file_text(tmp_path, capsys):
    root, rels = _root(tmp_path, codec="zstd")
    path = os.path.join(root, rels[0])
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    for needle in (f"key         {'00' * 32}:0", "model       deepseek-ai/DeepSeek-V2-Lite", "codec       zstd",
                   "checksum    header ok, data ok", "provenance  tp=2 pp=1", "row=per_worker", "writer=test"):
        assert needle in out, needle
    table_rows = [l for l in out.splitlines() if re.match(r"^\d+\s+model\.layers\.", l)]
    assert len(table_rows) == 4 and "BF16" in table_rows[0] and "1x16x576" in table_rows[0]
    assert re.search(r"ratio (\d+\.\d\d)", out) and float(re.search(r"ratio (\d+\.\d\d)", out).group(1)) > 1.2


def test_inspect_file_no_verify_and_corrupt(tmp_path, capsys):
    root, rels = _root(tmp_path)
    path = os.path.join(root, rels[1])
    _flip(path)
    rc, d = _run_json(["inspect", "--no-verify", path], capsys)
    assert rc == 0 and d["checksum"] == {"header": "ok", "data": "skipped"}
    rc, d = _run_json(["inspect", path], capsys)
    assert rc == 1 and d["checksum"]["data"] == "bad" and d["error"]["reason"] == "ChecksumError"
    rc = main(["inspect", path])
    assert rc == 1 and "data BAD" in capsys.readouterr().out


def test_inspect_root_table_and_json(tmp_path, capsys):
    root, rels = _root(tmp_path, n=5)
    open(os.path.join(root, rels[0]), "r+b").write(b"garbage!")  # header destroyed
    os.utime(os.path.join(root, rels[0]), (1_700_000_000, 1_700_000_000))
    assert main(["inspect", root]) == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    hdr = next(i for i, l in enumerate(lines) if l.startswith("namespace"))
    cols = lines[hdr].split()
    assert cols == ["namespace", "model", "dtype", "tok/blk", "files", "bytes", "tp", "ratio", "corrupt", "oldest",
                    "newest"]
    row = lines[hdr + 2]
    assert _layout().namespace() in row and " 5 " in row and "2023-11-14" in row
    assert lines[hdr + 1].startswith("---")
    rc, d = _run_json(["inspect", root], capsys)
    (ns,) = d["namespaces"]
    assert rc == 1 and ns["files"] == 5 and ns["corrupt"] == 1 and ns["tp_sizes"] == [2]
    assert ns["oldest"] == 1_700_000_000 and ns["newest"] == 1_700_000_004 and ns["tokens_per_block"] == 16
    assert ns["bad_files"][0]["path"] == rels[0]
    rc, d = _run_json(["inspect", os.path.join(root, rels[0].split("/")[0])], capsys)  # a namespace directory
    assert rc == 1 and [n["namespace"] for n in d["namespaces"]] == [_layout().namespace()]
    assert d["namespaces"][0]["files"] == 5 and d["namespaces"][0]["model"] == MODEL


def test_inspect_root_verify_counts_data_corruption(tmp_path, capsys):
    root, rels = _root(tmp_path, n=4)
    _flip(os.path.join(root, rels[2]))
    rc, d = _run_json(["inspect", root], capsys)
    assert rc == 0 and d["namespaces"][0]["corrupt"] == 0 and not d["verified_data"]  # headers only by default
    rc, d = _run_json(["inspect", "--verify", root], capsys)
    assert rc == 1 and d["namespaces"][0]["corrupt"] == 1 and d["verified_data"]


def test_inspect_legacy_root(tmp_path, capsys):
    t = build(str(tmp_path / "legacy"), tp=8, n_files=3, n_layers=27)
    rc = main(["inspect", t.root])
    out = capsys.readouterr().out
    assert rc == 0 and "legacy vLLM fs-tier root" in out and "per_worker" in out and "saves" in out
    rc, d = _run_json(["inspect", t.root], capsys)
    (ns,) = d["namespaces"]
    assert ns["tp_sizes"] == [8] and ns["files"] == 3 and ns["legacy"]["padding"] == t.row_bytes - 8 * t.slot_bytes
    assert ns["legacy"]["digest_ok"] and ns["legacy"]["compacted_bytes"] == 3 * (4096 + t.slot_bytes)


def test_inspect_legacy_file(tmp_path, capsys):
    t = build(str(tmp_path / "legacy"), tp=4, n_files=2)
    h = sorted(t.paths)[0]
    assert main(["inspect", t.paths[h]]) == 0
    out = capsys.readouterr().out
    assert f"key         {h}:0" in out and "per_worker: 4 slot(s)" in out and "replicas    identical" in out
    rc, d = _run_json(["inspect", t.paths[h]], capsys)
    assert rc == 0 and d["row"]["slot_offsets"] == [i * t.slot_bytes for i in range(4)]
    assert d["compacts_to"].endswith(f"/{h[:2]}/{h[2:4]}/{h}.kvf")
    p = t.payloads[h]
    open(t.paths[h], "wb").write(t.row(p, [p, p, p, bytes(len(p))]))
    rc, d = _run_json(["inspect", t.paths[h]], capsys)
    assert rc == 1 and d["replicas"] == "differ" and d["error"]["reason"] == "ReplicaMismatchError"
    rc, d = _run_json(["inspect", "--no-verify", t.paths[h]], capsys)
    assert rc == 0 and d["replicas"] == "skipped"


def test_inspect_json_schema_documented_and_followed(tmp_path, capsys):
    root, rels = _root(tmp_path, n=3)
    t = build(str(tmp_path / "legacy"), tp=2, n_files=2)
    outputs = []
    for argv in (["inspect", os.path.join(root, rels[0])], ["inspect", "--no-verify", os.path.join(root, rels[0])],
                 ["inspect", root], ["inspect", "--verify", root], ["inspect", t.root]):
        _rc, d = _run_json(argv, capsys)
        outputs.append(d)
    open(os.path.join(root, rels[1]), "r+b").write(b"xx")
    outputs.append(_run_json(["inspect", os.path.join(root, rels[1])], capsys)[1])
    outputs.append(_run_json(["inspect", next(iter(t.paths.values()))], capsys)[1])
    assert {d["kind"] for d in outputs} == {"file", "kvformat_root", "legacy_root", "legacy_file"}
    for d in outputs:
        assert validate(d, INSPECT_SCHEMA) == [], (d["kind"], validate(d, INSPECT_SCHEMA))
    assert validate({"kind": "file", "path": 3}, INSPECT_SCHEMA)  # the validator can fail
    bad = json.loads(json.dumps(outputs[2]))
    del bad["namespaces"][0]["corrupt"]
    assert validate(bad, INSPECT_SCHEMA)
    # the published file (docs/schema/, generated) is checked against real output in tests/test_cli_schema.py


# -- verify --------------------------------------------------------------------------------------------
def test_verify_exit_codes_and_quarantine(tmp_path, capsys):
    root, rels = _root(tmp_path, n=4)
    assert main(["verify", root]) == 0
    assert "checked 4 files: 0 bad" in capsys.readouterr().out
    _flip(os.path.join(root, rels[3]))
    assert main(["verify", os.path.join(root, rels[0])]) == 0
    assert main(["verify", os.path.join(root, rels[3])]) == 1
    capsys.readouterr()
    rc, d = _run_json(["verify", root], capsys)
    assert rc == 1 and d["checked"] == 4 and [b["reason"] for b in d["bad"]] == ["ChecksumError"]
    rc, d = _run_json(["verify", "--quarantine", root], capsys)
    assert rc == 1 and len(d["quarantined"]) == 1
    q = d["quarantined"][0]
    assert os.path.exists(q) and q.endswith(".ChecksumError") and f"{os.sep}.quarantine{os.sep}" in q
    assert not os.path.exists(os.path.join(root, rels[3]))
    assert main(["verify", root]) == 0  # quarantined files are out of the root's listing
    ns_dir = os.path.join(root, rels[0].split("/")[0])
    _flip(os.path.join(root, rels[2]))
    assert main(["verify", "--quarantine", ns_dir]) == 1  # a namespace directory works too
    assert os.path.exists(os.path.join(root, ".quarantine", rels[2] + ".ChecksumError"))
    assert main(["verify", str(tmp_path / "nope")]) == 2


def test_verify_legacy_root_checks_replicas(tmp_path, capsys):
    t = build(str(tmp_path / "legacy"), tp=2, n_files=3)
    assert main(["verify", t.root]) == 0
    h = sorted(t.paths)[1]
    p = t.payloads[h]
    open(t.paths[h], "wb").write(t.row(p, [p, bytes(len(p))]))
    capsys.readouterr()
    rc, d = _run_json(["verify", t.root], capsys)
    assert rc == 1 and d["bad"][0]["reason"] == "ReplicaMismatchError" and d["bad"][0]["path"] == t.paths[h]
    assert main(["verify", t.paths[h]]) == 1 and main(["verify", t.paths[sorted(t.paths)[0]]]) == 0
    assert main(["verify", "--quarantine", t.paths[h]]) == 2


# -- gc ------------------------------------------------------------------------------------------------
def test_gc_evicts_least_recently_used(tmp_path, capsys):
    root, rels = _root(tmp_path, n=6)
    size = os.path.getsize(os.path.join(root, rels[0]))
    os.utime(os.path.join(root, rels[0]), (1_800_000_000, 1_800_000_000))  # rels[0] was used recently
    rc, d = _run_json(["gc", root, "--max-bytes", str(3 * size), "--dry-run"], capsys)
    assert rc == 0 and [e["path"] for e in d["evicted"]] == rels[1:4] and d["deleted"] == 0
    assert all(os.path.exists(os.path.join(root, r)) for r in rels)
    tmp = os.path.join(root, rels[0].split("/")[0], ".kvf-tmp-1-dead")
    open(tmp, "wb").write(b"x")
    os.utime(tmp, (1_600_000_000, 1_600_000_000))
    rc, d = _run_json(["gc", root, "--max-bytes", str(3 * size)], capsys)
    assert rc == 0 and d["deleted"] == 3 and d["bytes_after"] == 3 * size and d["temp_removed"] == 1
    left = sorted(e.relpath for e in open_store(root).list())
    assert left == sorted([rels[0], rels[4], rels[5]])
    assert main(["gc", root, "--max-bytes", "1GiB"]) == 0
    assert "deleted 0 least recently used files" in capsys.readouterr().out
    assert main(["gc", root, "--max-bytes", "lots"]) == 2


def test_gc_while_a_reader_has_the_file_open(tmp_path):
    root, rels = _root(tmp_path, n=3)
    path = os.path.join(root, rels[0])
    expect = open(path, "rb").read()
    with open(path, "rb") as f:  # an in-flight load: its inode stays valid after unlink
        head = f.read(100)
        assert main(["gc", root, "--max-bytes", "1"]) == 0  # 1 byte: everything goes (0 would be no limit)
        assert not os.path.exists(path)
        assert head + f.read() == expect
    with pytest.raises(FileNotFoundError):  # a later load sees a miss, never a partial file
        K.read_header(path)
    assert plan_gc(open_store(root), 1).victims == []


# -- exit codes, entry point -----------------------------------------------------------------------------
def test_usage_exit_codes(capsys):
    assert main([]) == 2
    assert main(["frobnicate"]) == 2
    assert main(["inspect"]) == 2
    assert main(["--help"]) == 0
    assert main(["inspect", "/definitely/not/here"]) == 2
    capsys.readouterr()


def test_console_script_runs(tmp_path):
    root, rels = _root(tmp_path, n=2)
    exe = Path(sys.executable).parent / "kvformat"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-c", "import sys; from kvformat.cli import main; sys.exit(main())"]
    r = subprocess.run(cmd + ["verify", root], capture_output=True, text=True)
    assert r.returncode == 0 and "checked 2 files: 0 bad" in r.stdout
    r = subprocess.run(cmd + ["verify", "--bogus", root], capture_output=True, text=True)
    assert r.returncode == 2


def test_demo_tells_the_whole_story(tmp_path, capsys):
    assert main(["demo", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for needle in ("written at TP=8", "legacy vLLM fs-tier root", "converted 12, skipped 0, failed 0",
                   "TP=2: 12/12 blocks byte-identical", "TP=1: 12/12 blocks byte-identical", "7.9x smaller",
                   "read refused: ChecksumError", "destination zeroed, not left holding wrong bytes: True",
                   "kvformat verify --quarantine", "demo OK"):
        assert needle in out, needle
    assert os.path.isdir(tmp_path / "kvformat-cache" / ".quarantine")
