"""The docs stay true (issue 26): every shell and Python block of README.md, docs/ and spec/ runs here or says why
it cannot (tools/doc_snippets.py reads the blocks and their markers), sample sessions are reproduced by
tools/doc_samples.py, every JSON block parses (tier configs through the tier's own parser), the CLI synopsis
names every option, and roots written the documented way are roots for every command."""

from __future__ import annotations

import doctest
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
from s3_server import S3Server, s3_env, s3_server  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import doc_samples  # noqa: E402
from doc_snippets import Snippet, all_snippets, match_output  # noqa: E402

SNIPPETS = all_snippets()
CLI = [sys.executable, "-m", "kvformat.cli"]


def _ids(s: Snippet) -> str:
    return s.where


# -- every block is accounted for --------------------------------------------------------------------------------


def test_every_shell_and_python_block_runs_or_says_why_not() -> None:
    unmarked = [s.where for s in SNIPPETS if s.status == "UNMARKED"]
    assert not unmarked, f"shell blocks with no snippet marker (run it, or say why not): {unmarked}"
    for s in SNIPPETS:
        if s.mark == "not run:":
            assert len(s.arg) > 15, f"{s.where}: 'not run' needs a reason a reader can check"
        if s.mark is not None:
            assert s.runnable_kind, f"{s.where}: a marker on a {s.kind} block"


# -- Python blocks, run in order per document ---------------------------------------------------------------------


def _tiny_layout() -> Any:
    import kvformat as K

    return K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V2-Lite", "bfloat16",
                                     [f"model.layers.{i}.self_attn.attn" for i in range(4)], 16, 576)


def _prelude_s3(request: pytest.FixtureRequest, ns: dict[str, Any]) -> Callable[[], str]:
    """remote.md: the S3 server in the environment (AWS_ENDPOINT_URL…), the bucket the doc names, a block."""
    import kvformat as K

    srv: S3Server = request.getfixturevalue("s3_env")
    srv.make_bucket("kv-cache")
    layout = _tiny_layout()
    ns.update(layout=layout, key=K.BlockKey("5a" * 32), payload=os.urandom(layout.payload_bytes),
              out=bytearray(layout.payload_bytes))
    return lambda: "s3://kv-cache/deepseek-v2-lite"


def _prelude_staging(request: pytest.FixtureRequest, ns: dict[str, Any]) -> Callable[[], str]:
    """staging.md: a TP=1 group (the snippet is collective; one rank is a whole group), a CPU paged KV."""
    import torch

    import kvformat as K

    layout = _tiny_layout()
    torch.manual_seed(0)
    kv = [torch.randn(8, 16, 576).to(torch.bfloat16) for _ in layout.layers]
    ns.update(tp_rank=0, tp_size=1, layout=layout, kv_per_layer=kv, block_ids=[3], other_block_ids=[5], chunk=0,
              key=K.BlockKey("c3" * 32))

    def after() -> str:
        assert torch.equal(kv[0][5], kv[0][3]) and torch.equal(kv[-1][5], kv[-1][3]), "stage_in did not land"
        return "kv-cache"

    return after


def _prelude_v3_block(request: pytest.FixtureRequest, ns: dict[str, Any]) -> Callable[[], str] | None:
    """FORMAT.md §12's example: the DeepSeek-V3 block it describes, as block.kvf."""
    import safetensors

    import kvformat as K

    layout = K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V3", "bfloat16",
                                       [f"model.layers.{i}.self_attn.attn" for i in range(61)], 64, 576)
    K.save_file(os.urandom(layout.payload_bytes), "block.kvf", layout, K.BlockKey("9f" * 32))
    ns["safetensors"] = safetensors
    return None


PRELUDES: dict[str, Callable[[pytest.FixtureRequest, dict[str, Any]], Callable[[], str] | None]] = {
    "s3": _prelude_s3, "staging": _prelude_staging, "v3-block": _prelude_v3_block,
}
PY_DOCS = sorted({s.doc for s in SNIPPETS if s.kind.startswith("python") and s.mark != "not run:"})


def _run_session(s: Snippet, ns: dict[str, Any]) -> None:
    test = doctest.DocTestParser().get_doctest(s.text, ns, s.where, s.doc, s.line)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    runner.run(test, clear_globs=False)
    res = runner.summarize(verbose=False)
    assert res.attempted and not res.failed, f"{s.where}: {res}"


@pytest.mark.parametrize("doc", PY_DOCS)
def test_python_blocks_run_as_written(doc: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      request: pytest.FixtureRequest) -> None:
    monkeypatch.chdir(tmp_path)
    ns: dict[str, Any] = {"__name__": "doc"}
    roots = []
    for s in [s for s in SNIPPETS if s.doc == doc and s.kind.startswith("python") and s.mark != "not run:"]:
        after = PRELUDES[s.arg](request, ns) if s.mark == "prelude" else None
        if s.kind == "python-session":
            _run_session(s, ns)
        else:
            exec(compile(s.text, s.where, "exec"), ns)  # the snippet's own asserts run too
        if after is not None:
            roots.append(after())
    for root in roots:  # a root written as the doc shows is a root for the CLI (issue 26)
        for argv in (["verify", root], ["inspect", root], ["gc", root, "--max-bytes", "1GiB"]):
            r = subprocess.run(CLI + argv, capture_output=True, text=True, env=os.environ.copy())
            assert r.returncode == 0, (doc, argv, r.stdout, r.stderr)
        r = subprocess.run(CLI + ["verify", root, "--json"], capture_output=True, text=True)
        assert json.loads(r.stdout)["checked"] >= 1, (doc, r.stdout)


# -- sample sessions ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("s", [s for s in SNIPPETS if s.mark == "sample"], ids=_ids)
def test_sample_sessions_are_what_the_commands_print(s: Snippet, tmp_path: Path) -> None:
    got = doc_samples.session(s.arg, str(tmp_path))
    diff = match_output(s.text, got)
    assert diff is None, f"{s.where} no longer matches `python tools/doc_samples.py {s.arg}`: {diff}"


def test_the_matcher_sees_a_changed_line() -> None:
    exp = "a\n… b …\n...\nz\n"
    assert match_output(exp, "a\nx b y\n1\n2\nz\n") is None
    assert match_output(exp, "a\nx c y\nz\n") is not None
    assert match_output(exp, "a\nx b y\nq\n") is not None


# -- run elsewhere in CI --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("s", [s for s in SNIPPETS if s.mark == "run by:"], ids=_ids)
def test_blocks_run_elsewhere_are_run_there(s: Snippet) -> None:
    where = s.arg.split()[0]
    if where == "tools/test.sh":  # the whole suite: every test file the block names is one of it
        named = re.findall(r"\btests/test_\w+\.py\b", s.text)
        assert named and all((REPO / n).is_file() for n in named), (s.where, named)
        assert "tools/test.sh" in (REPO / ".ci/run").read_text()
    elif where == ".ci/run":
        ci = (REPO / ".ci/run").read_text()
        for line in s.text.splitlines():
            for cmd in line.split("#", 1)[0].split("&&"):
                assert cmd.strip() in ci, f"{s.where}: `{cmd.strip()}` is not run by .ci/run"
    else:
        path, _, name = where.partition("::")
        assert f"def {name}(" in (REPO / path).read_text(), f"{s.where}: {where} does not exist"


# -- JSON and tier configs ------------------------------------------------------------------------------------------


def _tier_configs(obj: Any) -> list[dict[str, Any]]:
    if isinstance(obj, dict):
        found = [obj] if obj.get("type") == "KVFormatTier" else []
        return found + [c for v in obj.values() for c in _tier_configs(v)]
    if isinstance(obj, list):
        return [c for v in obj for c in _tier_configs(v)]
    return []


def _json_blocks() -> list[tuple[str, Any]]:
    out = [(s.where, json.loads(s.text)) for s in SNIPPETS if s.kind == "json"]
    for s in SNIPPETS:  # the --kv-transfer-config of the documented `vllm serve` lines
        for m in re.finditer(r"--kv-transfer-config '(.*?)'", s.text, re.S):
            out.append((s.where, json.loads(m.group(1))))
    return out


def test_json_blocks_parse_and_tier_configs_are_accepted_by_the_tier() -> None:
    from kvformat.cache._config import TierConfig

    blocks = _json_blocks()
    tiers = [(w, c) for w, obj in blocks for c in _tier_configs(obj)]
    assert len(tiers) >= 3, tiers  # README, vllm.md, remote.md
    for where, c in tiers:
        kw = {k: v for k, v in c.items() if k not in ("type", "module_path", "root")}
        TierConfig.parse(c["root"], **kw)  # raises, naming the parameter, on a key or value the tier refuses
        assert c["module_path"] == "kvformat.vllm", where


# -- the CLI synopsis -----------------------------------------------------------------------------------------------


def test_cli_synopsis_names_every_option() -> None:
    from kvformat.cli._args import build_parser

    synopsis = next(s for s in SNIPPETS if s.doc == "docs/cli.md" and s.kind == "text").text
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    for cmd, parser in sub.choices.items():  # type: ignore[attr-defined]
        block = synopsis.split(f"kvformat {cmd}", 1)
        assert len(block) == 2, f"docs/cli.md synopsis lacks `kvformat {cmd}`"
        text = re.split(r"\nkvformat ", block[1], maxsplit=1)[0]
        for a in parser._actions:
            longs = [o for o in a.option_strings if o.startswith("--") and o != "--help"]
            if longs and not any(o in text for o in longs):
                raise AssertionError(f"docs/cli.md synopsis of `kvformat {cmd}` lacks {longs[0]}")


# -- one text per fact ----------------------------------------------------------------------------------------------


def _param_table(doc: str) -> list[str]:
    text = (REPO / doc).read_text()
    sec = text.split("### Parameters", 1)[1].split("\n#", 1)[0]
    return [ln for ln in sec.splitlines() if ln.startswith("|")]


def test_the_tier_parameter_table_is_one_text_in_readme_and_vllm_md() -> None:
    """The README and docs/vllm.md each carry the tier's parameter table; they had drifted apart (o_direct)."""
    readme, vllm_md = _param_table("README.md"), _param_table("docs/vllm.md")
    assert len(readme) > 5 and readme == vllm_md, [a for a, b in zip(readme, vllm_md) if a != b]


# -- figures name their command, date and commit -----------------------------------------------------------------


def _figure_markers() -> list[tuple[str, tuple[str, str, str]]]:
    from doc_snippets import DOCS, FIGURE

    return [(f"{d}:{i + 1}", m.groups()) for d in DOCS
            for i, line in enumerate((REPO / d).read_text().splitlines()) for m in FIGURE.finditer(line)]


def test_every_benchmark_output_names_its_command_date_and_commit() -> None:
    missing = [s.where for s in SNIPPETS if s.runs_a_tool and s.figure is None]
    assert not missing, f"benchmark output without a <!-- figure: measured DATE at COMMIT: CMD --> marker: {missing}"
    for s in SNIPPETS:
        if s.runs_a_tool and s.figure is not None:
            first = s.text.lstrip("\n").split("\n", 1)[0].strip()
            assert first.endswith(s.figure[2].removeprefix("python ").strip()), (s.where, first, s.figure[2])
    markers = _figure_markers()
    assert len(markers) >= 5, markers
    # A shallow clone (or an unpacked sdist) lacks the history: there only the marker's form is checked.
    r = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--is-shallow-repository"], capture_output=True, text=True)
    history = r.returncode == 0 and r.stdout.strip() == "false"
    for where, (date, commit, command) in markers:
        script = re.search(r"\btools/\w+\.py\b", command)
        assert script and (REPO / script.group(0)).is_file(), f"{where}: no tools/ script in `{command}`"
        if not history:
            continue
        r = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
        assert r.returncode == 0, f"{where}: commit {commit} is not in this repository's history"
        r = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%cs", commit], capture_output=True,
                           text=True)
        assert r.stdout.strip() <= date, f"{where}: measured {date}, before its commit {commit} ({r.stdout.strip()})"


# -- the README's benchmark summary quotes its sources -----------------------------------------------------------


def _summary_rows() -> list[tuple[str, str, str]]:
    text = (REPO / "README.md").read_text()
    sec = text.split("## Benchmarks", 1)[1].split("\n## ", 1)[0]
    rows = []
    for ln in sec.splitlines():
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        if ln.startswith("| `") and len(cells) == 4:
            rows.append((cells[0], cells[2], cells[3]))
    return rows


def test_the_readme_benchmark_summary_quotes_its_sources() -> None:
    """Each number of the README's summary appears in the doc its row names, and that doc carries a figure marker
    (command, date, commit): the summary cannot drift from the tables it summarises (it had, issue 26)."""
    rows = _summary_rows()
    assert len(rows) >= 8, rows
    for cmd, result, source in rows:
        doc = re.search(r"\b(docs/[\w/]+\.md)\b", source)
        assert doc and (REPO / doc.group(1)).is_file(), f"README benchmark row {cmd}: no source doc in {source!r}"
        text = (REPO / doc.group(1)).read_text()
        numbers = re.findall(r"\d+(?:\.\d+)?", re.sub(r"`[^`]*`", "", result))
        if numbers and "not run" not in result:
            assert "<!-- figure: measured" in text, f"{doc.group(1)} has no figure marker for {cmd}"
        for n in numbers:
            assert re.search(rf"(?<![\d.]){re.escape(n)}(?![\d])", text), \
                f"README benchmark row {cmd}: {n} does not appear in {doc.group(1)}"


# -- user docs at human size (issue 32) ----------------------------------------------------------------------------


USER_DOC_MAX_LINES = 300


def test_no_user_doc_is_longer_than_a_reader_will_read() -> None:
    """README.md and docs/*.md say what to run and what it means; measurement records live in docs/benchmarks/ (not
    user docs, and not counted). A doc that outgrows the limit is split by topic, never trimmed of facts."""
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    assert len(docs) >= 8, docs
    long = {str(d.relative_to(REPO)): n for d in docs if (n := len(d.read_text().splitlines())) > USER_DOC_MAX_LINES}
    assert not long, f"user docs over {USER_DOC_MAX_LINES} lines (split them, measurements to docs/benchmarks/): {long}"
