"""Issue 32 item 5: the ``--json`` output is described by a JSON Schema generated from the code.

docs/schema/kvformat-cli.schema.json must be exactly what ``python -m kvformat.cli._schema`` writes now, and the
real output of every command, on real files, must validate against it with the ``jsonschema`` package (an
implementation that is not kvformat's own, so the schema means to other tools what it means to us).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from cli_helpers import flip, kv_root
from legacy_trees import build

from kvformat.cli import main
from kvformat.cli._schema import SCHEMAS, document

REPO = Path(__file__).resolve().parents[1]
PUBLISHED = REPO / "docs" / "schema" / "kvformat-cli.schema.json"


def _validator(command: str) -> jsonschema.protocols.Validator:
    published = json.loads(PUBLISHED.read_text())
    return jsonschema.Draft202012Validator({"$ref": f"#/$defs/{command}", "$defs": published["$defs"]})


def test_the_published_schema_is_what_the_generator_writes(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    r = subprocess.run([sys.executable, "-m", "kvformat.cli._schema", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert out.read_text() == PUBLISHED.read_text(), \
        "docs/schema/kvformat-cli.schema.json is stale: run `python -m kvformat.cli._schema`"
    published = json.loads(PUBLISHED.read_text())
    jsonschema.Draft202012Validator.check_schema(published)
    assert published == document() and set(published["$defs"]) == set(SCHEMAS)


def _runs(tmp_path: Path) -> dict[str, list[list[str]]]:
    root, rels = kv_root(str(tmp_path / "kv"), n=4)
    flip(os.path.join(root, rels[1]))
    t = build(str(tmp_path / "src"), tp=2, n_files=3)
    return {
        "inspect": [["inspect", root], ["inspect", root, "--verify"], ["inspect", os.path.join(root, rels[0])],
                    ["inspect", os.path.join(root, rels[1]), "--verify"], ["inspect", t.root],
                    ["inspect", t.paths[sorted(t.paths)[0]]]],
        "verify": [["verify", root], ["verify", t.root], ["verify", "--quarantine", root]],
        "compact": [["compact", t.root, str(tmp_path / "dst"), "--dry-run"],
                    ["compact", t.root, str(tmp_path / "dst")]],
        "gc": [["gc", root, "--max-bytes", "1", "--dry-run"], ["gc", root, "--quarantine", "--max-bytes", "1"]],
        "demo": [["demo", "--layers", "2", "--blocks", "2"]],
    }


def test_real_json_output_of_every_command_validates_against_the_published_schema(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = _runs(tmp_path)
    assert set(runs) == set(SCHEMAS)  # a new command needs its runs here
    seen_kinds = set()
    for name, argvs in runs.items():
        v = _validator(name)
        for argv in argvs:
            main(argv + ["--json"])
            doc: Any = json.loads(capsys.readouterr().out)
            errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in v.iter_errors(doc)]
            assert not errors, (argv, errors)
            seen_kinds.add(doc.get("kind", doc.get("command")))
    assert {"file", "kvformat_root", "legacy_root", "legacy_file"} <= seen_kinds, seen_kinds


def test_the_published_schema_rejects_what_breaks_it() -> None:
    """The check can fail: a document missing a required field, or with a wrong type, is refused."""
    assert list(_validator("gc").iter_errors({"command": "gc"}))
    assert list(_validator("verify").iter_errors({"command": "verify", "path": 3}))
    assert list(_validator("inspect").iter_errors({"kind": "file", "path": "x"}))
