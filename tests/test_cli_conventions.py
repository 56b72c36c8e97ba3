"""Issue 12 item 4: the CLI follows the conventions of rsync/zfs/restic (help, exit codes, one size
syntax, --jobs, --json everywhere, progress on a TTY only, broken pipe, sizes printed, file modes,
quarantine shown and purged)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import (
    CODE,
    cli,
    cli_on_pty,
    flip,
    kv_root,
    other_user,
    run_as,
    shared_tmpdir,
)
from legacy_trees import build

from kvformat.cli import EXIT_CODES, main
from kvformat.cli._args import build_parser as _parser
from kvformat.cli._schema import SCHEMAS, validate
from kvformat.cli._util import human
from kvformat.format._sizes import parse_limit, parse_size
from kvformat.cache._config import TierConfig
from kvformat.errors import SchemaError, UsageError

DOCS = Path(__file__).resolve().parent.parent / "docs" / "cli.md"
COMMANDS = ("inspect", "verify", "compact", "gc", "demo")


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    p = _parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


# -- help --------------------------------------------------------------------------------------------
def test_every_argument_and_option_has_help_text():
    subs = _subparsers()
    assert set(subs) == set(COMMANDS)
    for name, sp in subs.items():
        for act in sp._actions:
            if isinstance(act, argparse._HelpAction):
                continue
            assert act.help and act.help != argparse.SUPPRESS and len(act.help) > 10, (name, act.dest)


@pytest.mark.parametrize("argv", [["--help"]] + [[c, "--help"] for c in COMMANDS])
def test_help_lists_exit_codes_and_examples(argv, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "exit codes:" in out
    for code, text in EXIT_CODES.items():
        assert re.search(rf"^\s+{code}\s+{re.escape(text[:30])}", out, re.MULTILINE), (argv, code)
    cmd = argv[0] if argv[0] != "--help" else None
    assert re.search(rf"^\s+kvformat {cmd or ''}", out, re.MULTILINE)  # the examples are commands of this command


def test_exit_codes_in_help_are_the_documented_ones():
    text = DOCS.read_text()
    for code in EXIT_CODES:
        assert re.search(rf"^\| {code} \|", text, re.MULTILINE), code


# -- one size syntax ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text,value", [
    ("1000000", 1_000_000), ("0", 0), ("500G", 500 * 10**9), ("500GB", 500 * 10**9), ("1.5TB", 1_500_000_000_000),
    ("800g", 800 * 10**9), ("64MiB", 64 << 20), ("64mi", 64 << 20), ("2PiB", 2 << 50), ("3P", 3 * 10**15),
    ("1.1TB", 1_100_000_000_000), ("1.5KiB", 1536), (" 7 KiB ", 7168), ("10B", 10), ("0.5K", 500),
])
def test_one_size_syntax_everywhere(text, value, tmp_path, capsys):
    assert parse_size(text) == value
    # the tier's parser is the same parser (0 aside: no limit there, see the next test)
    assert TierConfig.parse(str(tmp_path), max_bytes=text).max_bytes == (value or None)
    # and the CLI's --max-bytes
    root, _ = kv_root(str(tmp_path / "kv"), n=2)
    rc = main(["gc", root, "--max-bytes", text, "--dry-run", "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["max_bytes"] == (value or None)


@pytest.mark.parametrize("bad", ["lots", "5 parsecs", "-1", "1e3", "inf", "nan", "1.5.2G", "G", "", "0x10"])
def test_bad_sizes_are_refused_the_same_way_everywhere(bad, tmp_path, capsys):
    with pytest.raises(UsageError):
        parse_size(bad)
    with pytest.raises(SchemaError, match="max_bytes"):
        TierConfig.parse(str(tmp_path), max_bytes=bad)
    root, _ = kv_root(str(tmp_path / "kv"), n=1)
    assert main(["gc", root, "--max-bytes", bad]) == 2
    assert "--max-bytes" in capsys.readouterr().err


def test_size_zero_means_no_limit_everywhere(tmp_path, capsys):
    assert parse_limit(0) is None and parse_limit("0GiB") is None and parse_limit(None) is None
    assert TierConfig.parse(str(tmp_path), max_bytes=0).max_bytes is None
    assert TierConfig.parse(str(tmp_path), max_bytes="0").max_bytes is None
    root, rels = kv_root(str(tmp_path / "kv"), n=3)
    rc = main(["gc", root, "--max-bytes", "0", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0 and rep["max_bytes"] is None and rep["deleted"] == 0 and rep["evicted"] == []
    assert all(os.path.exists(os.path.join(root, r)) for r in rels)
    assert main(["gc", root, "--max-bytes", "0"]) == 0
    assert "(no limit): deleted 0 least recently used files" in capsys.readouterr().out
    assert "**`0` means no limit**" in DOCS.read_text()


# -- --jobs and other counts -------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["0", "-1", "abc", "257", "1.5"])
def test_jobs_validated_the_same_everywhere(value, tmp_path, capsys):
    root, _ = kv_root(str(tmp_path / "kv"), n=1)
    t = build(str(tmp_path / "src"), tp=2, n_files=1)
    errs = []
    for argv in (["inspect", root], ["verify", root], ["compact", t.root, str(tmp_path / "dst")]):
        assert main(argv + ["--jobs", value]) == 2
        err = capsys.readouterr().err
        errs.append(err.strip().splitlines()[-1].split("error: ", 1)[1])
    assert len(set(errs)) == 1 and "thread count" in errs[0] and "1..256" in errs[0] or "expected" in errs[0], errs
    assert not os.path.exists(tmp_path / "dst")
    for argv in (["inspect", root], ["verify", root]):
        assert main(argv + ["--jobs", "256"]) == 0
    capsys.readouterr()


# -- --json everywhere ---------------------------------------------------------------------------------
def test_json_on_every_command_follows_its_documented_schema(tmp_path, capsys):
    root, rels = kv_root(str(tmp_path / "kv"), n=4)
    flip(os.path.join(root, rels[1]))
    t = build(str(tmp_path / "src"), tp=2, n_files=3)
    runs = {
        "inspect": [["inspect", root], ["inspect", root, "--verify"], ["inspect", os.path.join(root, rels[0])],
                    ["inspect", t.root], ["inspect", t.paths[sorted(t.paths)[0]]]],
        "verify": [["verify", root], ["verify", t.root], ["verify", "--quarantine", root]],
        "compact": [["compact", t.root, str(tmp_path / "dst"), "--dry-run"], ["compact", t.root, str(tmp_path / "dst")]],
        "gc": [["gc", root, "--max-bytes", "1", "--dry-run"], ["gc", root, "--quarantine", "--max-bytes", "1"]],
        "demo": [["demo", "--layers", "2", "--blocks", "2"]],
    }
    for name, argvs in runs.items():
        for argv in argvs:
            rc = main(argv + ["--json"])
            out = capsys.readouterr().out
            doc = json.loads(out)  # exactly one document
            assert validate(doc, SCHEMAS[name]) == [], (argv, validate(doc, SCHEMAS[name]))
            if "exit_code" in doc:
                assert doc["exit_code"] == rc, argv
    # a document that breaks the schema is caught (the check can fail)
    assert validate({"command": "gc"}, SCHEMAS["gc"])


# -- progress --------------------------------------------------------------------------------------------
def _many(tmp_path, n: int = 40) -> str:
    root, _ = kv_root(str(tmp_path / "kv"), n=n)
    return root


@pytest.mark.parametrize("argv,label", [(["verify"], b"verify ["), (["inspect", "--verify"], b"inspect ["),
                                         (["gc", "--max-bytes", "1"], b"gc [")])
def test_progress_on_a_tty_quiet_in_pipes_and_with_quiet(argv, label, tmp_path):
    root = _many(tmp_path)
    cmd = [argv[0], root, *argv[1:]]
    rc, out, err = cli_on_pty(cmd)
    assert rc == 0 and b"\r" + label in err and b"40/40 files" in err, err[-300:]
    r = cli(cmd)  # stderr a pipe: nothing
    assert r.returncode == 0 and r.stderr == b"" and r.stdout
    rc, out, err = cli_on_pty(cmd + ["--quiet"])
    assert rc == 0 and label not in err and b"\r" not in err
    rc, out, err = cli_on_pty(cmd + ["--json"])  # a JSON consumer gets no bar either
    assert rc == 0 and label not in err and json.loads(out)


# -- broken pipe ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("json_out", [False, True])
def test_broken_pipe_exits_quietly(json_out, tmp_path):
    root = _many(tmp_path, 4)
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first write: as `| head -0`
    argv = ["inspect", root] + (["--json"] if json_out else [])
    p = subprocess.run([sys.executable, "-c", CODE, *argv], stdout=w, stderr=subprocess.PIPE)
    os.close(w)
    assert p.returncode == 141 and p.stderr == b"", p.stderr
    assert "| 141 |" in DOCS.read_text()


# -- human sizes -------------------------------------------------------------------------------------------
def test_human_never_prints_an_exponent():
    seen = set()
    for base in (1, 1024, 1024**2, 1024**3, 1024**4, 1024**5):
        for v in (999, 999.4, 999.5, 999.9, 1000, 1023, 1023.4, 1023.5, 1023.99, 1024, 9.994, 9.996, 99.94, 99.96):
            s = human(v * base)
            seen.add(s)
            assert "e+" not in s and "e-" not in s, (v, base, s)
            num, unit = s.split()
            assert float(num) < 1024 and unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"), s
    assert human(1023.99 * 1024) == "1.00 MiB" and human(1023.4 * 1024) == "1023 KiB"
    assert human(500) == "500 B" and human(1536) == "1.50 KiB" and human(20 * 1024) == "20.0 KiB"


# -- file modes ---------------------------------------------------------------------------------------------
def _modes(root: str) -> tuple[set[int], set[int]]:
    files, dirs = set(), set()
    for dp, dn, fn in os.walk(root):
        if dp != root:
            dirs.add(stat.S_IMODE(os.stat(dp).st_mode))
        for f in fn:
            files.add(stat.S_IMODE(os.stat(os.path.join(dp, f)).st_mode))
    return files, dirs


@pytest.mark.parametrize("umask,mode,want_files,want_dirs", [
    (0o022, None, 0o644, 0o755), (0o027, None, 0o640, 0o750), (0o077, None, 0o600, 0o700),
    (0o077, "0640", 0o640, 0o750), (0o022, "600", 0o600, 0o700), (0o077, "0664", 0o664, 0o775),
])
def test_created_files_have_the_documented_mode(umask, mode, want_files, want_dirs):
    base = shared_tmpdir()
    try:
        t = build(os.path.join(base, "src"), tp=2, n_files=3)
        dst = os.path.join(base, "dst")
        r = cli(["compact", "-q", t.root, dst] + (["--mode", mode] if mode else []), umask=umask)
        assert r.returncode == 0, r.stderr
        files, dirs = _modes(dst)
        assert files == {want_files} and dirs == {want_dirs}, (oct(umask), mode, files, dirs)
        user = other_user()
        if user is not None:
            assert run_as(None, ["verify", dst])[0] == 0  # imports everything the child needs
            rc, out = run_as(user, ["verify", dst])
            if want_files & 0o004 and want_dirs & 0o001:
                # the vLLM user (another uid, not in the group) reads what compact wrote
                assert rc == 0 and "checked 3 files: 0 bad" in out, out
            else:  # and a mode that shuts others out does shut them out
                assert rc == 2, out
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("bad", ["999", "abc", "0400", "8"])
def test_bad_mode_is_a_usage_error(bad, tmp_path, capsys):
    t = build(str(tmp_path / "src"), tp=2, n_files=1)
    assert main(["compact", t.root, str(tmp_path / "dst"), "--mode", bad]) == 2
    assert "--mode" in capsys.readouterr().err and not os.path.exists(tmp_path / "dst")


# -- quarantine shown and purged -----------------------------------------------------------------------------
def test_quarantine_shown_by_inspect_and_purged_by_gc(tmp_path, capsys):
    root, rels = kv_root(str(tmp_path / "kv"), n=4)
    flip(os.path.join(root, rels[0]))
    flip(os.path.join(root, rels[1]), 5000)
    assert main(["verify", "--quarantine", root]) == 1
    capsys.readouterr()
    assert main(["inspect", root]) == 0
    out = capsys.readouterr().out
    assert re.search(r"quarantine: 2 files, [0-9.]+ KiB in .*\.quarantine \(2 ChecksumError\)", out), out
    assert "kvformat gc ROOT --quarantine" in out
    rc = main(["inspect", root, "--json"])
    q = json.loads(capsys.readouterr().out)["quarantine"]
    assert rc == 0 and q["files"] == 2 and q["reasons"] == {"ChecksumError": 2} and q["bytes"] > 0
    # dry run: the same lines a real run prints, with "would"; nothing deleted
    assert main(["gc", root, "--quarantine", "--dry-run"]) == 0
    dry = capsys.readouterr().out.splitlines()
    assert sum(1 for l in dry if l.startswith("would delete .quarantine/")) == 2
    assert len(os.listdir(os.path.join(root, ".quarantine"))) == 1
    assert main(["gc", root, "--quarantine"]) == 0
    real = capsys.readouterr().out.splitlines()
    assert [l.replace("would delete", "deleted") for l in dry if l.startswith("would delete")] == \
        [l for l in real if l.startswith("deleted")]
    assert os.listdir(os.path.join(root, ".quarantine")) == []  # purged; the directory itself stays
    assert all(os.path.exists(os.path.join(root, r)) for r in rels[2:])  # block files untouched
    assert main(["inspect", root, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["quarantine"]["files"] == 0


# -- the CLI stays thin ------------------------------------------------------------------------------------
def test_cli_modules_import_no_private_names_from_each_other():
    import ast

    pkg = Path(__file__).resolve().parent.parent / "kvformat" / "_cli"
    offenders = []
    for f in pkg.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                offenders += [f"{f.name}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert offenders == []


def test_scan_engine_is_a_library_api(tmp_path):
    from kvformat.admin import scan_root

    root, rels = kv_root(str(tmp_path / "kv"), n=3)
    flip(os.path.join(root, rels[2]))
    seen = []

    class Sink:
        def add_total(self, files, nbytes):
            seen.append(("total", files))

        def update(self, n_bytes, n=1):
            seen.append(("file", n_bytes))

    res = scan_root(root, verify=True, progress=Sink())
    assert [r for r, _ in res.bad] == [rels[2]] and res.accs[0].files == 3 and res.unreadable == []
    assert seen[0] == ("total", 3) and len(seen) == 4
