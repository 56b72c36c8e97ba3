"""Sealed files (issue 24, spec §12) in the CLI: ``inspect`` shows the seal level and key id without a key and
checks the tag with ``--key``; ``verify --key`` authenticates (and quarantines forgeries, never files under a key
not given); ``compact --seal`` writes sealed files; ``gc`` needs no key."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

import kvformat as K
from kvformat.cli import main
from kvformat.cli._schema import INSPECT_SCHEMA, SCHEMAS, validate
from kvformat.storage import open_store

from legacy_trees import MODEL, build, layer_names


def key_file(tmp_path: Path, name: str) -> tuple[str, K.Keyring]:
    secret = os.urandom(32)
    p = tmp_path / f"{name}.key"
    p.write_text(secret.hex() + "\n")
    return str(p), K.Keyring.of([secret])


def sealed_root(tmp_path: Path, keys: K.Keyring, level: str = "encrypt", n: int = 4) -> tuple[str, list[str]]:
    store = open_store(str(tmp_path / "kv"))
    L = K.CanonicalLayout.uniform(MODEL, "bfloat16", layer_names(4), 16, 576, seal=level)
    store.ensure_namespace(L)
    rels = []
    for i in range(n):
        pay = np.random.default_rng(i).integers(0, 256, L.payload_bytes, dtype=np.uint8)
        rel, _, _ = store.put_block(pay, L, K.BlockKey(f"{i:02x}" * 32), keys=keys,
                                    provenance=K.Provenance(tp=2, row="replicated", writer="test", created=1_700_000_000))
        os.utime(os.path.join(store.root, rel), (1_700_000_000 + i,) * 2)
        rels.append(rel)
    return store.root, rels


def run_json(argv: list[str], capsys) -> tuple[int, dict]:
    rc = main(argv + ["--json"])
    return rc, json.loads(capsys.readouterr().out)


def forge(path: str) -> None:
    """Alter a sealed file's data and recompute both xxh3 checksums: what anyone with write access can do."""
    import xxhash

    raw = bytearray(open(path, "rb").read())
    hdr = K.read_header(path)
    raw[-1] ^= 0x01
    for field, value in ((b'"kvf.dxxh3":"', xxhash.xxh3_64_hexdigest(bytes(raw[hdr.data_offset:]))),
                         (b'"kvf.hxxh3":"', None)):
        i = raw.index(field) + len(field)
        if value is None:
            raw[i:i + 16] = b"0" * 16
            value = xxhash.xxh3_64_hexdigest(bytes(raw[:hdr.data_offset]))
        raw[i:i + 16] = value.encode()
    open(path, "wb").write(bytes(raw))


def test_inspect_shows_seal_and_key_id_without_a_key(tmp_path, capsys):
    src, keys = key_file(tmp_path, "k")
    other, _ = key_file(tmp_path, "other")
    root, rels = sealed_root(tmp_path, keys)
    kid = keys.write_key.key_id
    path = os.path.join(root, rels[0])
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert f"sealed      encrypt, key id {kid}: tag not checked (give --key to check it)" in out
    assert "data ok" in out  # the stored bytes' checksum needs no key
    rc, d = run_json(["inspect", path], capsys)
    assert rc == 0 and d["seal"] == {"level": "encrypt", "key_id": kid, "tag": "unchecked"}
    assert d["header"]["seal"]["key_id"] == kid and validate(d, INSPECT_SCHEMA) == []
    rc, d = run_json(["inspect", path, "--key", src], capsys)
    assert rc == 0 and d["seal"]["tag"] == "ok" and validate(d, INSPECT_SCHEMA) == []
    rc, d = run_json(["inspect", path, "--key", other], capsys)
    assert rc == 1 and d["seal"]["tag"] == "unknown_key" and d["error"]["reason"] == "UnknownKeyError"
    forge(path)
    rc, d = run_json(["inspect", path], capsys)
    assert rc == 0 and d["seal"]["tag"] == "unchecked"  # intact checksums: without the key nobody can tell ...
    rc, d = run_json(["inspect", path, "--key", src], capsys)
    assert rc == 1 and d["seal"]["tag"] == "bad" and d["error"]["reason"] == "TagMismatchError"  # ... with it, yes
    assert main(["inspect", root]) == 0
    out = capsys.readouterr().out
    assert f"encrypt, key ids {kid} (4 files)" in out
    rc, d = run_json(["inspect", root], capsys)
    (ns,) = d["namespaces"]
    assert ns["seal"] == "encrypt" and ns["key_ids"] == {kid: 4} and validate(d, INSPECT_SCHEMA) == []


def test_verify_with_key_authenticates_and_quarantines_only_forgeries(tmp_path, capsys):
    src, keys = key_file(tmp_path, "k")
    other, _ = key_file(tmp_path, "other")
    root, rels = sealed_root(tmp_path, keys, level="authenticate")
    assert main(["verify", root]) == 0 and main(["verify", root, "--key", src]) == 0
    capsys.readouterr()
    forge(os.path.join(root, rels[1]))
    assert main(["verify", root]) == 0  # keyless: checksums hold, the forgery cannot be seen
    capsys.readouterr()
    rc, rep = run_json(["verify", root, "--key", src], capsys)
    assert rc == 1 and [b["reason"] for b in rep["bad"]] == ["TagMismatchError"]
    assert validate(rep, SCHEMAS["verify"]) == []
    # a key that opens none of them: every file is bad (unchecked) but none is moved
    rc, rep = run_json(["verify", root, "--key", other, "--quarantine"], capsys)
    assert rc == 1 and {b["reason"] for b in rep["bad"]} == {"UnknownKeyError"} and rep["quarantined"] == []
    assert len(rep["ignored"]) == len(rels) and all("never quarantined" in i["why"] for i in rep["ignored"])
    assert all(os.path.exists(os.path.join(root, r)) for r in rels)
    rc, rep = run_json(["verify", root, "--key", src, "--quarantine"], capsys)
    assert rc == 1 and len(rep["quarantined"]) == 1 and rep["quarantined"][0].endswith(".TagMismatchError")
    assert not os.path.exists(os.path.join(root, rels[1]))
    assert main(["verify", root, "--key", src]) == 0
    capsys.readouterr()
    rc, rep = run_json(["verify", os.path.join(root, rels[0]), "--key", other, "--quarantine"], capsys)
    assert rc == 1 and rep["quarantined"] == [] and os.path.exists(os.path.join(root, rels[0]))


def test_bad_key_sources_are_usage_errors(tmp_path, capsys):
    src, keys = key_file(tmp_path, "k")
    root, _ = sealed_root(tmp_path, keys)
    literal = Path(src).read_text().strip()
    for argv in (["verify", root, "--key", literal], ["verify", root, "--key", str(tmp_path / "nope")],
                 ["inspect", root, "--key", "env:KVF_CLI_TEST_UNSET"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "seal key" in err and literal not in err


def test_compact_seal_writes_sealed_files(tmp_path, capsys):
    src, keys = key_file(tmp_path, "k")
    t = build(str(tmp_path / "legacy"), tp=2, n_files=3)
    dst = str(tmp_path / "out")
    assert main(["compact", t.root, dst, "--seal", "encrypt"]) == 2  # no key
    assert main(["compact", t.root, dst, "--key", src]) == 2  # a key without --seal
    assert main(["compact", t.root, dst, "--seal", "encrypt", "--key", src, "--codec", "zstd"]) == 2
    capsys.readouterr()
    rc, rep = run_json(["compact", t.root, dst, "--seal", "encrypt", "--key", src], capsys)
    assert rc == 0 and rep["converted"] == 3 and validate(rep, SCHEMAS["compact"]) == []
    (ns,) = {n["namespace"] for n in rep["namespaces"]}
    files = sorted(Path(dst).rglob("*.kvf"))
    assert len(files) == 3
    for p in files:
        hdr = K.read_header(p)
        assert hdr.layout.seal == "encrypt" and hdr.seal.key_id == keys.write_key.key_id
        assert p.parent.parent.parent.name == ns == hdr.layout.namespace()
        out = bytearray(hdr.raw_bytes)
        K.read_into(p, out, keys=keys)
        assert bytes(out) == t.payloads[hdr.key.hash]
    rc, rep = run_json(["compact", t.root, dst, "--seal", "encrypt", "--key", src], capsys)
    assert rc == 0 and rep["skipped"] == 3 and rep["converted"] == 0  # a re-run opens and keeps them
    assert main(["verify", dst, "--key", src]) == 0


def test_gc_needs_no_key(tmp_path, capsys):
    _, keys = key_file(tmp_path, "k")
    root, rels = sealed_root(tmp_path, keys, n=4)
    size = os.path.getsize(os.path.join(root, rels[0]))
    assert main(["gc", root, "--max-bytes", str(2 * size)]) == 0
    capsys.readouterr()
    assert [os.path.exists(os.path.join(root, r)) for r in rels] == [False, False, True, True]  # oldest first
