"""tests/conftest.py fails a run that skips a test, unless KVFORMAT_ALLOW_SKIPS allows it (real pytest runs)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def run_pytest(tmp_path: Path, allow: str | None) -> subprocess.CompletedProcess:
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_a.py").write_text("def test_ok():\n    pass\n")
    (tmp_path / "test_integration.py").write_text(
        "import pytest\npytest.importorskip('no_such_module_kvformat_test')\n\ndef test_x():\n    pass\n")
    (tmp_path / "test_b.py").write_text(
        "import pytest\n\ndef test_skips():\n    pytest.skip('no tmpfs here')\n\n"
        "@pytest.mark.xfail(reason='known')\ndef test_xfail():\n    assert False\n")
    env = {k: v for k, v in os.environ.items() if k != "KVFORMAT_ALLOW_SKIPS"}
    if allow is not None:
        env["KVFORMAT_ALLOW_SKIPS"] = allow
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_skip_fails_the_run(tmp_path):
    r = run_pytest(tmp_path, None)
    assert r.returncode == 1, r.stdout
    assert "test_integration.py" in r.stdout and "test_b.py::test_skips" in r.stdout
    assert "test_xfail" not in r.stdout.split("skipped tests fail this run")[1]  # an xfail is not a skip


def test_allowing_every_skip(tmp_path):
    assert run_pytest(tmp_path, "1").returncode == 0


def test_allowing_some_skips_by_name(tmp_path):
    r = run_pytest(tmp_path, "test_integration")
    assert r.returncode == 1 and "test_b.py::test_skips" in r.stdout
    assert run_pytest(tmp_path, "test_integration, test_b").returncode == 0
