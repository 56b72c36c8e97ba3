"""The CLI's edge cases (its defect classes): each test is named after its class and checks more than
one example of it."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from cli_helpers import (
    cli,
    flip,
    kv_root,
    layout,
    other_user,
    run_as,
    shared_tmpdir,
)
from legacy_trees import build, config_dir

import kvformat as K
from kvformat.cli import main
from kvformat.errors import LayoutMismatchError, LegacyLayoutError
from kvformat.legacy import LegacyNamespace, find_namespaces
from kvformat.storage import open_store
from treediff import changes, snapshot


def _json(argv, capsys) -> tuple[int, dict]:
    rc = main(argv + ["--json"])
    return rc, json.loads(capsys.readouterr().out)


# -- data loss -------------------------------------------------------------------------------------------
def test_verify_quarantine_moves_only_block_files_inside_a_namespace(tmp_path, capsys):
    root, rels = kv_root(str(tmp_path / "kv"), n=3)
    ns = rels[0].split("/")[0]
    flip(os.path.join(root, rels[2]))
    strays = {  # none of these is a block file of a namespace: never moved, whatever their bytes
        f"{ns}/notes.kvf": b"my notes",
        f"{ns}/.hidden.kvf": b"dot",
        f"{ns}/{rels[0].split('/', 1)[1][:5]}/.{'ab' * 32}.kvf": b"dotfile at block depth",
        f"{ns}/00/00/{'11' * 32}.kvf": b"hash and directories disagree",
        f"not-a-namespace/{rels[0].split('/', 1)[1]}": open(os.path.join(root, rels[1]), "rb").read(),
        f"{ns}/README": b"not even .kvf",
    }
    for rel, data in strays.items():
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        open(os.path.join(root, rel), "wb").write(data)
    before = snapshot(root)
    rc, d = _json(["verify", "--quarantine", root], capsys)
    misplaced = next(r for r in strays if r.startswith("not-a-namespace/"))
    # the copy outside any namespace is checked (and found misplaced) but, not being in a namespace, stays
    assert rc == 1 and sorted(b["path"] for b in d["bad"]) == sorted([os.path.join(root, rels[2]),
                                                                        os.path.join(root, misplaced)])
    assert d["quarantined"] == [os.path.join(root, ".quarantine", rels[2] + ".ChecksumError")]
    ignored = {os.path.relpath(i["path"], root) for i in d["ignored"]}
    assert ignored == {r for r in strays if r.endswith(".kvf")}
    after = snapshot(root)
    for rel in strays:
        assert after[rel] == before[rel], rel
    # given one by one, a stray is checked for its bytes but never moved
    for rel in strays:
        if rel.endswith(".kvf"):
            rc, d = _json(["verify", "--quarantine", os.path.join(root, rel)], capsys)
            assert d["quarantined"] == [] and os.path.exists(os.path.join(root, rel)), rel
            assert "never quarantined" in d["ignored"][0]["why"]


def test_compact_refuses_a_destination_that_does_not_outlive_the_process(tmp_path, capsys):
    t = build(str(tmp_path / "src"), tp=2, n_files=3)
    before = snapshot(t.root)
    for dst in ("memory://x", "memory://bucket/deep/prefix"):
        for extra in (["--delete-source"], [], ["--dry-run"]):
            assert main(["compact", t.root, dst, *extra]) == 2
            assert "does not outlive this process" in capsys.readouterr().err
    assert not changes(before, snapshot(t.root)), changes(before, snapshot(t.root))  # every source still there
    assert main(["compact", t.root, t.root]) == 2  # nor SRC itself
    assert "DST must differ" in capsys.readouterr().err


def test_gc_works_on_a_kvformat_root_only_and_size_zero_is_no_limit(tmp_path, capsys):
    a, rels_a = kv_root(str(tmp_path / "many" / "a"), n=3)
    b, rels_b = kv_root(str(tmp_path / "many" / "b"), n=3, salt=10)
    everything = snapshot(str(tmp_path / "many"))
    # several roots at once, a namespace, an empty directory, a legacy cache, a missing path: refused
    t = build(str(tmp_path / "legacy"), tp=2, n_files=1)
    (tmp_path / "empty").mkdir()
    for target in (tmp_path / "many", os.path.join(a, rels_a[0].split("/")[0]), tmp_path / "empty", t.root,
                   tmp_path / "nope"):
        assert main(["gc", str(target), "--max-bytes", "1"]) == 2, target
        capsys.readouterr()
    assert snapshot(str(tmp_path / "many")) == everything
    # 0 is no limit (as the tier's max_bytes): nothing evicted
    assert main(["gc", a, "--max-bytes", "0"]) == 0
    assert snapshot(str(tmp_path / "many")) == everything
    capsys.readouterr()
    # other .kvf files in the root are never deleted
    stray = os.path.join(a, "scratch", "x.kvf")
    os.makedirs(os.path.dirname(stray))
    open(stray, "wb").write(b"mine")
    h = "abcd" * 16  # a block path, but in a directory that is no namespace (no namespace.json)
    stray2 = os.path.join(a, "not-a-namespace", "ab", "cd", h + ".kvf")
    os.makedirs(os.path.dirname(stray2))
    shutil.copyfile(os.path.join(a, rels_a[0]), stray2)
    os.utime(stray2, (1, 1))  # the oldest file of all: LRU would pick it first
    assert main(["gc", a, "--max-bytes", "1", "--dry-run"]) == 0
    dry = capsys.readouterr().out.splitlines()
    assert main(["gc", a, "--max-bytes", "1"]) == 0
    real = capsys.readouterr().out.splitlines()
    # the dry run says what the real run deletes, in the same words
    assert [l.replace("would delete ", "deleted ", 1) for l in dry if l.startswith("would delete ")] == \
        [l for l in real if l.startswith("deleted ")]
    assert sum(l.startswith("deleted ") for l in real) == 3
    assert dry[-1].replace("would delete", "deleted").split(";")[0] == real[-1].split(";")[0]
    assert os.path.exists(stray) and any("scratch/x.kvf" in l and "never deleted" in l for l in real)
    assert os.path.exists(stray2) and any("not-a-namespace" in l and "never deleted" in l for l in real)
    assert all(os.path.exists(os.path.join(b, r)) for r in rels_b)  # the sibling root untouched
    assert main(["gc", a]) == 2  # nothing to do is a usage error, not a silent success
    capsys.readouterr()


# -- crashes and misleading results -------------------------------------------------------------------------
BAD_CONFIGS = {
    "tp_size string": ("tp_size", "8"),
    "tp_size null": ("tp_size", None),
    "tp_size zero": ("tp_size", 0),
    "blocks_per_file zero": ("blocks_per_file", 0),
    "blocks_per_file float": ("blocks_per_file", 1.0),
    "tokens_per_hash string": ("tokens_per_hash", "16"),
    "dtype null": ("dtype", None),
    "model_name int": ("model_name", 5),
    "groups a dict": ("kv_cache_groups", {"tokens_per_block": 16}),
    "group a list": ("kv_cache_groups", [[16, ["a"]]]),
    "layer_names a string": ("kv_cache_groups", [{"tokens_per_block": 16, "layer_names": "model.layers.0"}]),
    "tokens_per_block null": ("kv_cache_groups", [{"tokens_per_block": None, "layer_names": ["x"]}]),
    "tokens_per_block bool": ("kv_cache_groups", [{"tokens_per_block": True, "layer_names": ["x"]}]),
    "replicated_layout string": ("replicated_layout", "yes"),
    "canonical_format int": ("canonical_format", 3),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_malformed_legacy_config_is_a_layout_error_not_a_traceback(case, tmp_path, capsys):
    key, value = BAD_CONFIGS[case]
    bad = build(str(tmp_path / "src"), tp=2, n_files=2)
    build(str(tmp_path / "src"), tp=2, n_files=2, salt="good", model="other/Model")  # a good neighbour
    cfg_path = os.path.join(config_dir(bad), "config.json")
    cfg = json.load(open(cfg_path))
    cfg[key] = value
    open(cfg_path, "w").write(json.dumps(cfg))
    with pytest.raises(LegacyLayoutError, match=r"config\.json.*" + key.split("[")[0]):
        find_namespaces(bad.root)
    errors: list[LegacyLayoutError] = []
    found = find_namespaces(bad.root, errors=errors)
    assert [n.model for n in found] == ["other/Model"] and len(errors) == 1 and errors[0].path == cfg_path
    # the accessor itself refuses it too
    ns = LegacyNamespace(bad.root, os.path.basename(config_dir(bad)), cfg, (), False)
    with pytest.raises(LegacyLayoutError):
        ns.validate()
    dst = str(tmp_path / "dst")
    for argv in (["inspect", bad.root], ["inspect", bad.root, "--json"], ["verify", bad.root],
                 ["verify", bad.root, "--json"], ["compact", bad.root, dst], ["compact", bad.root, dst, "--json"],
                 ["inspect", bad.paths[sorted(bad.paths)[0]]], ["verify", bad.paths[sorted(bad.paths)[0]]]):
        rc = main(argv)  # 3 would be the last-resort handler: a crash this test exists to rule out
        out, err = capsys.readouterr()
        assert rc == 2, (argv, rc, out[-300:], err[-300:])
        assert "config.json" in out + err or "not a kvformat" in err, (argv, out[-300:], err[-300:])
        if "--json" in argv:
            json.loads(out)
    if case == "tp_size null":  # and as a user runs it: its own process, no traceback
        r = cli(["verify", bad.root])
        assert r.returncode == 2 and b"Traceback" not in r.stderr + r.stdout and b"tp_size" in r.stderr
    # the good namespace was still converted
    assert len(list(open_store(dst).list())) == 2


def test_last_resort_handler_has_its_own_exit_code(monkeypatch, capsys):
    import kvformat.cli as cli_mod

    def buggy(_a):  # stands in for a bug in a command: the one case no real input can reach
        raise ZeroDivisionError("division by zero")

    monkeypatch.setitem(cli_mod._COMMANDS, "demo", buggy)
    assert main(["demo"]) == 3
    err = capsys.readouterr().err
    assert "internal error" in err and "ZeroDivisionError" in err and "Traceback" not in err
    monkeypatch.setenv("KVFORMAT_DEBUG", "1")
    assert main(["demo"]) == 3 and "Traceback" in capsys.readouterr().err


def test_undecodable_and_newline_names_are_escaped(tmp_path):
    root, rels = kv_root(str(tmp_path / "kv"), n=2)
    ns = rels[0].split("/")[0]
    flip(os.path.join(root, rels[1]))
    raw_root = os.fsencode(root)
    names = [b"bad\xff\xfe.kvf", b"two\nlines.kvf", b"esc\x1b[31m.kvf"]
    for n in names:
        open(os.path.join(raw_root, os.fsencode(ns), n), "wb").write(b"x")
    env = {"PYTHONIOENCODING": "utf-8", "LC_ALL": "C.UTF-8"}
    for argv, rc_want in ((["verify", root], 1), (["inspect", root], 0), (["inspect", root, "--verify"], 1),
                          (["verify", root, "--json"], 1)):
        r = cli(argv, env=env)
        assert r.returncode == rc_want and b"Traceback" not in r.stderr, (argv, r.stderr)
        if "--json" in argv:
            d = json.loads(r.stdout)
            got = {os.fsencode(i["path"]).rsplit(b"/", 1)[-1] for i in d["ignored"]}
            assert got == set(names)  # lossless in JSON
            continue
        out = r.stdout.decode("utf-8")
        lines = [l for l in out.splitlines() if l.startswith("ignored ")]
        assert len(lines) == 3, out  # one line per name, whatever it holds
        assert any("bad\\xff\\xfe.kvf" in l for l in lines) and any("two\\nlines.kvf" in l for l in lines)
        assert "\x1b" not in out and any("esc\\x1b[31m.kvf" in l for l in lines)


def _unreadable_tree(base: str) -> tuple[str, list[str], str]:
    root, rels = kv_root(os.path.join(base, "kv"), n=5)
    for dp, dn, fn in os.walk(base):
        for d in dn:
            os.chmod(os.path.join(dp, d), 0o755)
        for f in fn:
            os.chmod(os.path.join(dp, f), 0o644)
    flip(os.path.join(root, rels[1]))
    locked = os.path.join(root, rels[3])
    os.chmod(locked, 0o000)
    return root, rels, locked


def test_one_unreadable_file_is_reported_and_the_others_checked():
    base = shared_tmpdir()
    try:
        root, rels, locked = _unreadable_tree(base)
        t = build(os.path.join(base, "legacy"), tp=2, n_files=3)
        for dp, dn, fn in os.walk(t.root):
            for d in dn:
                os.chmod(os.path.join(dp, d), 0o755)
            for f in fn:
                os.chmod(os.path.join(dp, f), 0o644)
        os.chmod(t.paths[sorted(t.paths)[0]], 0o000)
        user = other_user()
        for argv in (["verify", root, "--json"], ["inspect", root, "--verify", "--json"], ["verify", t.root, "--json"]):
            run_as(None, argv)  # imports
            rc, out = run_as(user, argv)
            d = json.loads(out)
            assert rc == 2, out
            unread = d["unreadable"] if "unreadable" in d else []
            assert len(unread) == 1 and "EACCES" in unread[0]["error"], out
            if argv[1] == root and argv[0] == "verify":
                assert d["checked"] == 4 and [b["path"] for b in d["bad"]] == [os.path.join(root, rels[1])]
                assert unread[0]["path"] == locked
            if argv[0] == "inspect":
                assert d["totals"]["files"] == 4 and d["totals"]["corrupt"] == 1
            if argv[1] == t.root:
                assert d["checked"] == 3 and d["bad"] == []
        rc, out = run_as(user, ["verify", root])  # (the UNREADABLE line itself goes to stderr)
        assert rc == 2 and "BAD" in out and "checked 4 files: 1 bad, 1 unreadable" in out
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_verify_quarantine_on_a_read_only_tree_keeps_the_report(tmp_path, capsys):
    root, rels = kv_root(str(tmp_path / "kv"), n=3)
    flip(os.path.join(root, rels[0]))
    flip(os.path.join(root, rels[2]))
    # .quarantine is a regular file: every move fails with a real OSError (root ignores chmod)
    open(os.path.join(root, ".quarantine"), "wb").write(b"in the way")
    rc, d = _json(["verify", "--quarantine", root], capsys)
    assert rc == 2 and len(d["bad"]) == 2 and d["quarantined"] == [] and len(d["quarantine_failed"]) == 2
    assert main(["verify", "--quarantine", root]) == 2
    out, err = capsys.readouterr()
    assert out.count("BAD ") == 2 and "checked 3 files: 2 bad, 0 quarantined" in out
    assert err.count("NOT quarantined ") == 2 and "ENOTDIR" in err or "EEXIST" in err, err
    assert all(os.path.exists(os.path.join(root, r)) for r in rels)
    base = shared_tmpdir()
    user = other_user()
    try:
        if user is not None:  # and a tree another user may read but not write
            r2, rels2, _ = _unreadable_tree(base)
            run_as(None, ["verify", r2, "--json"])  # imports (without moving anything)
            rc, out = run_as(user, ["verify", "--quarantine", r2, "--json"])
            d = json.loads(out)
            assert rc == 2 and len(d["bad"]) == 1 and len(d["quarantine_failed"]) == 1
            assert "EACCES" in d["quarantine_failed"][0]["error"]
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_demo_with_zero_layers_or_blocks_is_a_usage_error(capsys):
    for argv in (["demo", "--layers", "0"], ["demo", "--blocks", "0"], ["demo", "--layers", "-3"],
                 ["demo", "--layers", "62"]):
        assert main(argv) == 2
        assert "expected" in capsys.readouterr().err


def test_verify_checks_placement_as_a_load_does(tmp_path, capsys):
    root, rels = kv_root(str(tmp_path / "kv"), n=3)
    store = open_store(root)
    other = K.CanonicalLayout.uniform("other/Model", "bfloat16", [f"model.layers.{i}.self_attn.attn" for i in range(4)],
                                      16, 576)
    store.ensure_namespace(other)
    # a valid block under another block's name, and one in another model's namespace
    wrong_name = rels[2].rsplit("/", 1)[0] + "/" + rels[2].rsplit("/", 1)[1]
    h0 = rels[0].rsplit("/", 1)[1][:-4]
    wrong_key = f"{rels[0].split('/')[0]}/ee/ee/{'ee' * 32}.kvf"
    wrong_ns = f"{other.namespace()}/{h0[:2]}/{h0[2:4]}/{h0}.kvf"
    for rel in (wrong_key, wrong_ns):
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        shutil.copyfile(os.path.join(root, rels[0]), os.path.join(root, rel))
    # what a load does: the tier reads block_relpath(layout, key) expecting that layout and key
    for rel, L, key in ((wrong_key, layout(), K.BlockKey("ee" * 32)), (wrong_ns, other, K.BlockKey(h0))):
        with pytest.raises(LayoutMismatchError):
            store.read_into(rel, bytearray(L.payload_bytes), expect=L, key=key)
    rc, d = _json(["verify", root], capsys)
    fields = sorted((os.path.relpath(b["path"], root), b["reason"], b["message"].split(":")[0]) for b in d["bad"])
    assert rc == 1 and fields == sorted([(wrong_key, "LayoutMismatchError", "layout mismatch on key"),
                                         (wrong_ns, "LayoutMismatchError", "layout mismatch on namespace")])
    assert d["checked"] == 5 and wrong_name == rels[2]
    for rel in (wrong_key, wrong_ns):  # one file at a time, and on inspect
        assert main(["verify", os.path.join(root, rel)]) == 1
    capsys.readouterr()
    rc, d = _json(["inspect", root], capsys)
    assert rc == 1 and d["totals"]["corrupt"] == 2
    rc, d = _json(["verify", "--quarantine", root], capsys)
    assert len(d["quarantined"]) == 2 and main(["verify", root]) == 0
    capsys.readouterr()


def test_verify_of_a_root_with_legacy_and_kvformat_trees_checks_both(tmp_path, capsys):
    root, rels = kv_root(str(tmp_path / "mixed"), n=3)
    t = build(str(tmp_path / "mixed"), tp=2, n_files=3)
    assert main(["verify", root]) == 0
    assert "checked 6 files: 0 bad" in capsys.readouterr().out
    flip(os.path.join(root, rels[0]))
    h = sorted(t.paths)[1]
    p = t.payloads[h]
    open(t.paths[h], "wb").write(t.row(p, [p, bytes(len(p))]))
    rc, d = _json(["verify", root], capsys)
    assert rc == 1 and d["checked"] == 6
    assert sorted(b["reason"] for b in d["bad"]) == ["ChecksumError", "ReplicaMismatchError"]
    rc, d = _json(["verify", "--quarantine", root], capsys)  # kvformat side moved, legacy side reported
    assert rc == 1 and len(d["quarantined"]) == 1 and os.path.exists(t.paths[h])


def test_inspect_verify_and_gc_agree_on_empty_missing_and_junk_roots(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "a.kvf").write_bytes(b"x")
    for p in ("empty", "nope", "junk"):
        for cmd, verb in (("inspect", "inspect"), ("verify", "verify"), ("gc", "collect")):
            argv = [cmd, str(tmp_path / p)] + (["--max-bytes", "1"] if cmd == "gc" else [])
            assert main(argv) == 2, argv
            err = capsys.readouterr().err
            assert f"nothing to {verb}" in err or "no such file" in err or "not a directory" in err, (argv, err)
    # an empty namespace is a real (empty) namespace: checked 0, fine, for every command
    store = open_store(str(tmp_path / "kv"))
    store.ensure_namespace(layout())
    assert main(["verify", str(tmp_path / "kv")]) == 0
    assert "checked 0 files: 0 bad" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "kv")]) == 0
    assert main(["gc", str(tmp_path / "kv"), "--max-bytes", "1"]) == 0


def test_a_root_written_only_by_put_block_is_a_root_for_every_command(tmp_path, capsys):
    """Issue 26: Store.put_block (and so Stager.save) leaves a root inspect, verify and gc accept."""
    L = layout()
    store = open_store(str(tmp_path / "kv"))
    rels = [store.put_block(os.urandom(L.payload_bytes), L, K.BlockKey(f"{i:02x}" * 32))[0] for i in range(3)]
    root = str(tmp_path / "kv")
    assert main(["verify", root]) == 0 and "checked 3 files: 0 bad" in capsys.readouterr().out
    rc, d = _json(["inspect", root], capsys)
    assert rc == 0 and d["totals"]["files"] == 3
    assert main(["gc", root, "--max-bytes", "1"]) == 0
    assert not any(os.path.exists(os.path.join(root, r)) for r in rels)


def test_block_files_without_their_namespace_json_are_explained(tmp_path, capsys):
    """A root written before put_block wrote namespace.json: refused, naming what is missing and how to add it."""
    L = layout()
    store = open_store(str(tmp_path / "kv"))
    rel = store.put_block(os.urandom(L.payload_bytes), L, K.BlockKey("ab" * 32))[0]
    os.unlink(tmp_path / "kv" / L.namespace() / "namespace.json")
    for cmd in ("inspect", "verify", "gc"):
        assert main([cmd, str(tmp_path / "kv")] + (["--max-bytes", "1"] if cmd == "gc" else [])) == 2
        err = capsys.readouterr().err
        assert f"{L.namespace()} hold block files but no namespace.json" in err and "ensure_namespace" in err, err
    assert os.path.exists(tmp_path / "kv" / rel)  # gc refused: nothing deleted
    store2 = open_store(str(tmp_path / "kv"))
    store2.ensure_namespace(L)
    assert main(["verify", str(tmp_path / "kv")]) == 0


def test_exit_codes_match_the_docs(tmp_path, capsys):
    # a legacy layout that needs --page-bytes: 2 for inspect, verify and compact
    t = build(str(tmp_path / "src"), tp=1, replicated=True, n_layers=3, width=512, n_files=2)
    for argv in (["inspect", t.root], ["verify", t.root], ["compact", t.root, str(tmp_path / "d")],
                 ["inspect", t.paths[sorted(t.paths)[0]]], ["verify", t.paths[sorted(t.paths)[0]]]):
        assert main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert "--page-bytes" in out + err, argv
        rc, d = _json(argv, capsys)
        assert rc == 2 and "--page-bytes" in json.dumps(d), argv
    assert main(["verify", t.root, "--page-bytes", str(16 * 512 * 2)]) == 0
    capsys.readouterr()
    t2 = build(str(tmp_path / "src2"), tp=2, n_files=1)
    for level in ("99", "-1", "x"):  # a bad level is a usage error before anything is written
        assert main(["compact", t2.root, str(tmp_path / "d2"), "--codec", "zstd", "--level", level]) == 2
        assert not os.path.exists(tmp_path / "d2")
    capsys.readouterr()
    # a broken pipe: 141 (tests/test_cli_conventions.py::test_broken_pipe_exits_quietly); a bug: 3 (above)


def test_compact_rerun_repairs_an_output_whose_payload_is_corrupt(tmp_path, capsys):
    t = build(str(tmp_path / "src"), tp=2, n_files=4)
    dst = str(tmp_path / "dst")
    assert main(["compact", "-q", t.root, dst]) == 0
    first = snapshot(dst)
    outs = sorted(p for p in first if p.endswith(".kvf"))
    flip(os.path.join(dst, outs[0]), 100)  # payload bytes: the header still verifies
    flip(os.path.join(dst, outs[1]), 1)
    K.read_header(os.path.join(dst, outs[0]))  # header intact: a header-only check would skip it
    capsys.readouterr()
    rc, rep = _json(["compact", t.root, dst], capsys)
    assert rc == 0 and rep["converted"] == 2 and rep["skipped"] == 2
    assert snapshot(dst) == first
    assert main(["verify", dst]) == 0
    capsys.readouterr()


def test_demo_never_names_a_directory_it_removed(tmp_path, capsys):
    assert main(["demo", "--layers", "2", "--blocks", "2"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "removed" in last and "/" not in last, last  # the scratch directory is gone: it is not named
    assert main(["demo", "--layers", "2", "--blocks", "2", "--dir", str(tmp_path / "d")]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    named = last.split("files under ", 1)[1].rstrip(")")
    assert os.path.isdir(named), last
