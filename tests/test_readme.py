"""The README's Python snippet and its safetensors session run as written (in a scratch directory)."""

from __future__ import annotations

import doctest
import os
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _format_section() -> str:
    text = README.read_text()
    return text.split("## The file format", 1)[1].split("\n## ", 1)[0]


def test_readme_python_snippet_and_session_run_as_written(tmp_path, monkeypatch):
    sec = _format_section()
    (code,) = re.findall(r"```python\n(.*?)```", sec, re.S)
    session = re.search(r"```\n(>>> .*?)```", sec, re.S)
    assert session, "the safetensors session is gone from the README"
    monkeypatch.chdir(tmp_path)
    globs: dict = {"__name__": "readme"}
    exec(compile(code, "README.md (python snippet)", "exec"), globs)  # the snippet's own asserts run too
    assert os.path.getsize("block.kvf") > globs["layout"].payload_bytes
    assert len(globs["tensors"]) == 61 and globs["hdr"].key == globs["key"]
    test = doctest.DocTestParser().get_doctest(session.group(1), globs, "README.md (session)", str(README), 0)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    res = runner.summarize(verbose=False)
    assert res.attempted == 2 and res.failed == 0, res  # the import, the with-block (and its output)
