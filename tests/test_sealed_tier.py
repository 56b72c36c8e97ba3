"""Sealed files (issue 24, spec §12) through vLLM's real TieringOffloadingManager with KVFormatTier: files planted
without the key are never loaded, a wrong-key deployment gets misses, rotation keeps old files readable, and
sealed and clear deployments never share a namespace. The sealing hook is the engine-neutral one in
kvformat.cache (``_sealing``, ``_rows``), which every engine adapter drives."""

from __future__ import annotations

import base64
import json
import logging
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM is installed by tools/setup.sh")

import safetensors  # noqa: E402
import xxhash  # noqa: E402
from vllm_harness import Deployment, kvf, kvf_files, make_keys, make_payload, payloads  # noqa: E402

import kvformat as K  # noqa: E402
from kvformat.cache._config import TierConfig  # noqa: E402
from kvformat.cache._sealing import tier_keyring  # noqa: E402
from kvformat.errors import SchemaError  # noqa: E402
from kvformat.format._keys import load_key  # noqa: E402
from treediff import changes  # noqa: E402

N_LAYERS = 3


def new_key(tmp_path: Path, name: str) -> tuple[str, bytes]:
    """A key file (64 hex digits, as `openssl rand -hex 32` writes it): (its path, the key)."""
    secret = os.urandom(32)
    p = tmp_path / f"{name}.key"
    p.write_text(secret.hex() + "\n")
    p.chmod(0o600)
    return str(p), secret


def rel_of(dep: Deployment, key) -> str:
    return dep.tier().engine.relpath(key[:-4].hex())


def data_of(p: Path) -> bytes:
    hdr = K.read_header(p)
    return p.read_bytes()[hdr.data_offset:]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "store_path"])
@pytest.mark.parametrize("level", ["authenticate", "encrypt"])
def test_sealed_roundtrip_files_are_sealed(tmp_path, level, fused, monkeypatch):
    if not fused:  # the generic Store read/write pipeline (remote roots, subclasses) instead of the fused one
        monkeypatch.setenv("KVFORMAT_NO_FUSED", "1")
    src, secret = new_key(tmp_path, "k1")
    root = tmp_path / "root"
    with Deployment([kvf(root, seal=level, seal_key=src)], tp=2, replicated=False, n_layers=N_LAYERS,
                    num_chunks=8) as dep:
        keys = make_keys(4, f"rt{level}{fused}")
        items = payloads(dep, keys)
        dep.store(items)
        dep.evict_primary()
        assert dep.load(keys) == items  # both worker slots filled (the harness checks the fan-out)
        tier = dep.tier()
        assert tier.layout.seal == level and tier.namespace == tier.layout.namespace()
        files = kvf_files(root)
        assert len(files) == len(keys)
        kid = K.Keyring.of([secret]).write_key.key_id
        for p in files:
            hdr = K.read_header(p)  # no key needed to read a header
            assert hdr.layout.seal == level and hdr.seal is not None and hdr.seal.key_id == kid
            payload = items[next(k for k in keys if k[:-4].hex() == hdr.key.hash)]
            stored = data_of(p)
            if level == "authenticate":
                assert stored == payload
            else:
                assert stored != payload and len(stored) == len(payload)
                assert payload[:4096] not in p.read_bytes()  # no plaintext anywhere in the file
            with safetensors.safe_open(str(p), "pt") as f:  # still a safetensors file
                assert (list(f.keys()) == ["kvf.sealed"]) == (level == "encrypt")
        c = tier.counters()
        assert c["files_written"] == len(keys) and c["seal_failures"] == 0 and c["corrupt_files"] == 0


@pytest.mark.parametrize("level", ["authenticate", "encrypt"])
def test_planted_files_are_never_loaded(tmp_path, level):
    """Three plants at the right name, each with valid xxh3 checksums, by a writer without the key: a clear file,
    a sealed header of this deployment (its key id) over the attacker's payload, and a file sealed under the
    attacker's own key. None is ever loaded; the first two are quarantined, the third (a key this tier does not
    hold: it could be another deployment's file) stays where it is."""
    src, _ = new_key(tmp_path, "mine")
    attacker = K.Keyring.of([os.urandom(32)])
    root = tmp_path / "root"
    with Deployment([kvf(root, seal=level, seal_key=src)], n_layers=N_LAYERS, num_chunks=8) as dep:
        keys = make_keys(4, f"plant{level}")
        items = payloads(dep, keys)
        dep.store({keys[3]: items[keys[3]]})
        genuine = (root / rel_of(dep, keys[3])).read_bytes()
        tier = dep.tier()
        clear_layout = tier.layout.with_seal(None)
        planted = {k: make_payload(f"evil{i}", dep.slot_bytes) for i, k in enumerate(keys[:3])}
        # (a) a clear file, checksums valid
        K.save_file(planted[keys[0]], root / rel_of(dep, keys[0]), clear_layout, K.BlockKey(keys[0][:-4].hex()))
        # (b) the genuine file's header (our key id, tag) edited to name keys[1], over the attacker's payload;
        # checksums recomputed: nothing but the tag can tell
        hdr = K.read_header(root / rel_of(dep, keys[3]))
        head = bytearray(genuine[:hdr.data_offset])
        head = head.replace(hdr.key.hash.encode(), keys[1][:-4].hex().encode())
        _fix_checksums(head, planted[keys[1]])
        p1 = root / rel_of(dep, keys[1])
        p1.parent.mkdir(parents=True, exist_ok=True)
        p1.write_bytes(bytes(head) + planted[keys[1]])
        assert K.read_header(p1).seal.key_id == hdr.seal.key_id
        # (c) sealed under the attacker's own key, at the right name
        K.save_file(planted[keys[2]], root / rel_of(dep, keys[2]), tier.layout, K.BlockKey(keys[2][:-4].hex()),
                    keys=attacker)
        for k in keys[:3]:  # every plant passes the keyless checks (header and data checksums)
            K.verify_file(root / rel_of(dep, k))
        dep.evict_primary()
        got = dep.load(keys, timeout=20)
        assert got == {keys[0]: None, keys[1]: None, keys[2]: None, keys[3]: items[keys[3]]}
        region = bytes(dep.view)
        for k in keys[:3]:
            assert planted[k][:4096] not in region  # a failed load leaves nothing behind in the rows (F-5.5)
        c = tier.counters()
        assert c["quarantined:LayoutMismatchError"] == 1 and c["quarantined:TagMismatchError"] == 1
        assert c["seal_failures"] == 1 and c["corrupt_files"] == 2 and c["unknown_key_files"] >= 1
        assert not (root / rel_of(dep, keys[0])).exists() and not p1.exists()
        assert (root / rel_of(dep, keys[2])).exists()  # not ours to move
        assert not any(".TagMismatchError" in q.name and keys[2][:-4].hex() in q.name
                       for q in (root / ".quarantine").rglob("*"))
        # the plants keep missing; storing the real chunks afterwards works where the path was freed
        dep.store({k: items[k] for k in keys[:2]})
        dep.evict_primary()
        assert dep.load(keys[:3], timeout=20) == {keys[0]: items[keys[0]], keys[1]: items[keys[1]], keys[2]: None}


def _fix_checksums(head: bytearray, data: bytes) -> None:
    """Recompute kvf.dxxh3 (over ``data``) and kvf.hxxh3 of a header region, as anyone can (spec §5)."""
    def put(field: bytes, value: str) -> None:
        i = head.index(field) + len(field)
        head[i:i + 16] = value.encode()
    put(b'"kvf.dxxh3":"', xxhash.xxh3_64_hexdigest(data))
    put(b'"kvf.hxxh3":"', "0" * 16)
    put(b'"kvf.hxxh3":"', xxhash.xxh3_64_hexdigest(bytes(head)))


def test_wrong_key_deployment_gets_misses_and_harms_nothing(tmp_path, caplog):
    a_src, _ = new_key(tmp_path, "a")
    b_src, b_secret = new_key(tmp_path, "b")
    root = tmp_path / "root"
    keys = make_keys(4, "wrongkey")
    with Deployment([kvf(root, seal="encrypt", seal_key=a_src)], n_layers=N_LAYERS, num_chunks=8) as a:
        items = payloads(a, keys)
        a.store(items)
    before = {p: p.read_bytes() for p in kvf_files(root)}
    with caplog.at_level(logging.DEBUG):
        with Deployment([kvf(root, seal="encrypt", seal_key=b_src)], n_layers=N_LAYERS, num_chunks=8) as b:
            assert b.tier().wait_scanned(10)
            assert b.load(keys, timeout=20) == {k: None for k in keys}
            b.store(payloads(b, keys))  # every path is taken by A's file: nothing is replaced
            b.evict_primary()
            assert b.load(keys, timeout=20) == {k: None for k in keys}
            c = b.tier().counters()
            assert c["unknown_key_files"] >= len(keys) and c["corrupt_files"] == 0 and c["files_read"] == 0
            assert c["files_written"] == 0
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "this reader holds" in text  # logged once, with key ids ...
    assert b_secret.hex() not in text and K.Keyring.of([b_secret]).write_key.key_id in text  # ... never keys
    after = {p: p.read_bytes() for p in kvf_files(root)}
    assert not changes(before, after), (changes(before, after), list((root / ".quarantine").rglob("*")))  # A's files untouched, none quarantined
    assert not (root / ".quarantine").exists()
    with Deployment([kvf(root, seal="encrypt", seal_key=a_src)], n_layers=N_LAYERS, num_chunks=8) as a2:
        assert a2.load(keys) == items


def test_rotation_keeps_old_files_readable(tmp_path):
    old_src, old = new_key(tmp_path, "2026q1")
    new_src, new = new_key(tmp_path, "2026q2")
    root = tmp_path / "root"
    first, second = make_keys(3, "rot1"), make_keys(3, "rot2")
    old_id, new_id = K.Keyring.of([old]).write_key.key_id, K.Keyring.of([new]).write_key.key_id
    with Deployment([kvf(root, seal="authenticate", seal_key=old_src)], n_layers=N_LAYERS, num_chunks=8) as d1:
        items1 = payloads(d1, first)
        d1.store(items1)
        ns = d1.tier().namespace
    # rotated: the new key seals, the old one still opens; same namespace (it names the level, not the key)
    with Deployment([kvf(root, seal="authenticate", seal_key=new_src, seal_read_keys=[old_src])],
                    n_layers=N_LAYERS, num_chunks=8) as d2:
        assert d2.tier().namespace == ns
        assert d2.load(first) == items1
        items2 = payloads(d2, second)
        d2.store(items2)
        ids = {K.read_header(p).key.hash: K.read_header(p).seal.key_id for p in kvf_files(root)}
        assert {ids[k[:-4].hex()] for k in first} == {old_id} and {ids[k[:-4].hex()] for k in second} == {new_id}
    # the old key retired: its files are misses (left for max_bytes or gc), the new ones hit
    with Deployment([kvf(root, seal="authenticate", seal_key=new_src)], n_layers=N_LAYERS, num_chunks=8) as d3:
        got = d3.load(first + second, timeout=20)
        assert got == {**{k: None for k in first}, **items2}
        assert d3.tier().counters()["unknown_key_files"] >= len(first)


def test_sealed_and_clear_never_share_a_namespace(tmp_path):
    src, _ = new_key(tmp_path, "k")
    root = tmp_path / "root"
    keys = make_keys(2, "ns")
    spaces = {}
    for level in ("off", "authenticate", "encrypt"):
        kw = {} if level == "off" else {"seal": level, "seal_key": src}
        with Deployment([kvf(root, **kw)], n_layers=N_LAYERS, num_chunks=8) as dep:
            spaces[level] = dep.tier().namespace
            if level == "off":
                items = payloads(dep, keys)
                dep.store(items)
            else:  # the clear files of the same model, layout and keys are never looked at
                assert dep.load(keys, timeout=20) == {k: None for k in keys}
                assert dep.tier().counters()["files_read"] == 0
                assert dep.tier().counters()["corrupt_files"] == 0
    assert len(set(spaces.values())) == 3
    for level, ns in spaces.items():
        ident = json.loads((root / ns / "namespace.json").read_text())["identity"]
        assert ident.get("seal") == (None if level == "off" else level)
    # and a clear deployment never reads sealed files: store sealed, read clear
    with Deployment([kvf(root / "s", seal="authenticate", seal_key=src)], n_layers=N_LAYERS, num_chunks=8) as s:
        s.store(payloads(s, keys))
    with Deployment([kvf(root / "s")], n_layers=N_LAYERS, num_chunks=8) as c:
        assert c.load(keys, timeout=20) == {k: None for k in keys}


# -- configuration ---------------------------------------------------------------------------------
def key_spellings(secret: bytes) -> dict[str, str]:
    """The ways an operator pastes a key where a key source belongs (issue 43 item 8)."""
    h = secret.hex()
    b64 = base64.b64encode(secret).decode()
    return {
        "bare hex": h, "upper hex": h.upper(), "0x hex": "0x" + h, "0X hex": "0X" + h.upper(),
        "base64": b64, "base64url unpadded": base64.urlsafe_b64encode(secret).decode().rstrip("="),
        "double-quoted": f'"{h}"', "single-quoted": f"'{h}'", "quoted base64": f'"{b64}"',
        "quoted 0x with blanks": f' " 0x{h} " ', "spaced bytes": " ".join(h[i:i + 2] for i in range(0, 64, 2)),
        "colon bytes": ":".join(h[i:i + 2] for i in range(0, 64, 2)), "grouped by 8": " ".join(
            h[i:i + 8] for i in range(0, 64, 8)), "padded with whitespace": f"\t {h} \n",
    }


def test_a_literal_key_in_any_spelling_is_refused_and_never_echoed(tmp_path):
    src, secret = new_key(tmp_path, "k")
    h = secret.hex()
    pieces = {h[i:i + 8] for i in range(0, 57, 4)} | {h[i:i + 8].upper() for i in range(0, 57, 4)}
    b64 = base64.b64encode(secret).decode()
    pieces |= {b64[i:i + 8] for i in range(0, len(b64) - 8, 4)}
    for what, spelling in key_spellings(secret).items():
        for kw, field in (({"seal": "encrypt", "seal_key": spelling}, "seal_key"),
                          ({"seal": "encrypt", "seal_key": src, "seal_read_keys": [spelling]}, "seal_read_keys")):
            with pytest.raises(SchemaError) as ei:
                TierConfig.parse(str(tmp_path), **kw)
            assert ei.value.field == field, what
            assert "looks like a key" in str(ei.value), what
            shown = str(ei.value) + repr(ei.value) + repr(ei.value.args)
            leaked = [p for p in pieces if p in shown]
            assert not leaked, (what, "part of the key echoed")
        with pytest.raises(K.KVFormatError) as ei2:  # the key loader refuses it too, naming no part of it
            load_key(spelling)
        assert not [p for p in pieces if p in str(ei2.value)], what
    # sources stay sources: a key file, env:NAME, and a missing file in an existing directory (shown as given)
    assert TierConfig.parse(str(tmp_path), seal="encrypt", seal_key=src).seal_key == src
    assert TierConfig.parse(str(tmp_path), seal="encrypt", seal_key="env:KVF_KEY").seal_key == "env:KVF_KEY"
    missing = str(tmp_path / "deployment-a-2026-primary-key")
    assert TierConfig.parse(str(tmp_path), seal="encrypt", seal_key=missing).seal_key == missing


def test_seal_parameters_are_checked(tmp_path, monkeypatch, caplog):
    src, secret = new_key(tmp_path, "k")
    literal = secret.hex()
    bad = {
        "seal": ({"seal": "sign"}, "seal"),
        "no key": ({"seal": "encrypt"}, "seal_key"),
        "literal key": ({"seal": "encrypt", "seal_key": literal}, "seal_key"),
        "literal read key": ({"seal": "encrypt", "seal_key": src, "seal_read_keys": [literal]}, "seal_read_keys"),
        "read keys not a list": ({"seal": "encrypt", "seal_key": src, "seal_read_keys": src}, "seal_read_keys"),
        "keys, seal off": ({"seal_key": src}, "seal_key"),
        "zstd": ({"seal": "authenticate", "seal_key": src, "compression": "zstd"}, "compression"),
    }
    for what, (kw, field) in bad.items():
        with pytest.raises(SchemaError) as ei:
            TierConfig.parse(str(tmp_path), **kw)
        assert ei.value.field == field, what
        assert literal not in str(ei.value), what  # a key given by mistake is never echoed
    missing = TierConfig.parse(str(tmp_path), seal="encrypt", seal_key=str(tmp_path / "nope.key"))
    with pytest.raises(SchemaError, match="nope.key: No such file"):
        tier_keyring(missing)
    (tmp_path / "short.key").write_text("abcd")
    with pytest.raises(SchemaError, match="short.key: expected one key of 32 bytes"):
        tier_keyring(TierConfig.parse(str(tmp_path), seal="encrypt", seal_key=str(tmp_path / "short.key")))
    with pytest.raises(SchemaError, match="env:KVF_TEST_UNSET_KEY: environment variable not set"):
        tier_keyring(TierConfig.parse(str(tmp_path), seal="encrypt", seal_key="env:KVF_TEST_UNSET_KEY"))
    monkeypatch.setenv("KVF_TEST_KEY", literal)
    ring = tier_keyring(TierConfig.parse(str(tmp_path), seal="encrypt", seal_key="env:KVF_TEST_KEY",
                                         seal_read_keys=[src]))
    assert ring is not None and ring.ids == (K.Keyring.of([secret]).write_key.key_id,) * 2
    assert literal not in repr(ring) and literal not in repr(ring.write_key)
    os.chmod(src, 0o644)  # readable by every user: loaded, with a warning naming the file (never the key)
    with caplog.at_level(logging.WARNING, logger="kvformat.vllm"):
        tier_keyring(TierConfig.parse(str(tmp_path), seal="encrypt", seal_key=src))
    assert any("readable by every user" in r.getMessage() and src in r.getMessage() for r in caplog.records)
    assert all(literal not in r.getMessage() for r in caplog.records)
    # the real tier refuses at start-up, naming the parameter
    with pytest.raises(SchemaError, match="seal_key"):
        Deployment([kvf(tmp_path / "r", seal="encrypt", seal_key=str(tmp_path / "nope.key"))], n_layers=N_LAYERS)
