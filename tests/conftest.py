"""Suite-wide rules.

1. Suite-wide rule: a skipped test fails the run, unless the skip is explicitly allowed.

The integration tests (vLLM, s3fs/moto, tmpfs mounts) skip when their dependency is missing, and a
skipped test must never be counted as passing (docs/DEVELOPING.md). ``KVFORMAT_ALLOW_SKIPS=1`` allows
every skip (a partial local setup); ``KVFORMAT_ALLOW_SKIPS=test_diskfull,test_s3`` allows the skips
whose test id contains one of the comma-separated parts.

2. Marks the vLLM-dependent tests ``vllm``, from what they import, so ``-m vllm`` runs exactly those.

A test is vLLM-dependent when its module imports vLLM or ``vllm_harness`` at module level, or when its
own code does so inside the function (``from vllm_harness import …``, ``pytest.importorskip("vllm…")``).
Nobody has to remember to add the marker, and two checks keep the selection honest:

* every collected module whose source mentions ``vllm_harness`` or imports vLLM must contribute at least
  one marked test (else the detection missed it: a usage error);
* ``-m vllm`` that selects nothing is a usage error, not a green run of zero tests.

``KVFORMAT_REQUIRE_VLLM=1`` (set by tools/test.sh) turns "vLLM does not import" into a usage error,
so CI cannot pass by skipping the integration tests.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest

_VLLM_NAMES = ("vllm", "vllm_harness")
_SOURCE_MENTIONS = re.compile(r"^\s*(from|import)\s+vllm(_harness)?\b|importorskip\(\s*[\"']vllm", re.M)


def _names_vllm(name: str) -> bool:
    return name in _VLLM_NAMES or name.startswith("vllm.")


def _code_uses_vllm(code: types.CodeType) -> bool:
    # An import inside a function compiles to IMPORT_NAME of a name in co_names; an importorskip of a
    # vLLM module leaves the module name as a string constant. Nested functions are code constants.
    if any(_names_vllm(n) for n in code.co_names):
        return True
    for c in code.co_consts:
        if isinstance(c, str) and c.startswith("vllm."):
            return True
        if isinstance(c, types.CodeType) and _code_uses_vllm(c):
            return True
    return False


def _module_uses_vllm(mod: types.ModuleType) -> bool:
    for v in vars(mod).values():
        name = v.__name__ if isinstance(v, types.ModuleType) else getattr(v, "__module__", None)
        if isinstance(name, str) and _names_vllm(name):
            return True
    return False


def is_vllm_test(item: pytest.Item) -> bool:
    """True when ``item`` needs vLLM: its module or its own code imports vLLM or the harness."""
    mod = getattr(item, "module", None)
    if mod is not None and _module_uses_vllm(mod):
        return True
    fn = getattr(item, "function", None)
    code = getattr(fn, "__code__", None)
    return code is not None and _code_uses_vllm(code)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm: needs vLLM (set from imports by tests/conftest.py)")
    config.addinivalue_line("markers", "platform(name): the platform the harness's workers play (default cuda; "
                            "'real': what vLLM reports on this machine)")
    if os.environ.get("KVFORMAT_REQUIRE_VLLM") == "1" and importlib.util.find_spec("vllm") is None:
        raise pytest.UsageError("KVFORMAT_REQUIRE_VLLM=1 but vLLM is not installed: run tools/setup.sh")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marked_modules: set[str] = set()
    seen_modules: dict[str, Path] = {}
    for item in items:
        path = Path(str(item.fspath))
        seen_modules[str(path)] = path
        if is_vllm_test(item):
            item.add_marker(pytest.mark.vllm)
            marked_modules.add(str(path))
    missed = [p.name for k, p in seen_modules.items()
              if k not in marked_modules and p.name != "conftest.py" and _SOURCE_MENTIONS.search(p.read_text())]
    if missed:
        raise pytest.UsageError(f"tests/conftest.py: {missed} import vLLM but no test there was marked vllm "
                                "(extend is_vllm_test)")


def pytest_collection_finish(session: pytest.Session) -> None:
    expr = session.config.getoption("markexpr", "") or ""
    if re.search(r"\bvllm\b", expr) and not re.search(r"\bnot\s+vllm\b", expr) and not session.items:
        raise pytest.UsageError(f"-m {expr!r} selected no tests: the vLLM run would prove nothing")


# -- the skip guard --------------------------------------------------------------------------------


ENV = "KVFORMAT_ALLOW_SKIPS"
_skipped: list[tuple[str, str]] = []


def _allowed(nodeid: str) -> bool:
    allow = os.environ.get(ENV, "").strip()
    if allow == "1":
        return True
    return any(part.strip() and part.strip() in nodeid for part in allow.split(","))


def _record(report: Any) -> None:
    if report.skipped and not hasattr(report, "wasxfail") and not _allowed(report.nodeid):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skipped.append((report.nodeid, reason))


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _record(report)  # a module-level importorskip skips the whole file at collection


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _record(report)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _skipped:
        terminalreporter.section(f"skipped tests fail this run (set {ENV} to allow)", red=True)
        for nodeid, reason in _skipped:
            terminalreporter.line(f"{nodeid}: {reason}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _skipped and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# -- the platform the harness plays ----------------------------------------------------------------


@pytest.fixture(autouse=True)
def _played_platform(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM on this CPU-only machine reports no GPU platform, so the tier would find no description of the
    pages' FP8 flavour or indexer order (kvformat.vllm.vllm_platform returns None). The harness already plays
    the GPU workers' copies; it also plays their platform: ``cuda`` unless a test is marked
    ``@pytest.mark.platform(name)`` (``"real"``: leave vLLM's answer alone)."""
    marker = request.node.get_closest_marker("platform")
    name = marker.args[0] if marker else "cuda"
    if name == "real":
        return
    if "kvformat.vllm._facts" not in sys.modules and request.node.get_closest_marker("vllm") is None:
        return  # this test builds no vLLM tier; importing the adapter would import vLLM
    import kvformat.vllm._facts as facts

    monkeypatch.setattr(facts, "vllm_platform", lambda: name, raising=False)


@pytest.fixture(autouse=True)
def _vllm_lines_reach_caplog(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tier logs under vLLM's "vllm" logger on purpose (vLLM's handlers and levels apply to its lines). A test
    that runs a tool in-process (parallel_matrix quiets that logger to ERROR) or builds a vLLM config (vLLM's
    logging config stops the logger's propagation) would change it for every later test, whose caplog would then
    see none of the tier's warnings: failures that depend on test order. Each test gets the logger as a fresh
    process has it."""
    import logging

    if "vllm" in logging.Logger.manager.loggerDict:
        log = logging.getLogger("vllm")
        monkeypatch.setattr(log, "propagate", True)
        monkeypatch.setattr(log, "level", logging.NOTSET)
        logging.Logger.manager._clear_cache()  # type: ignore[attr-defined]  # effective levels are cached


# tests/e2e runs real engines from vLLM's CPU build in its own venv and CI step (tools/e2e.sh); the main
# suite keeps its engine versions and never collects it.
collect_ignore = ["e2e"]
# tests/test_rgw_*.py need Ceph's RADOS gateway (tools/rgw_up.sh): collected only where KVFORMAT_RGW_ENV names its
# env file, i.e. in tools/rgw_check.sh's CI step; elsewhere they would only skip (and a skip fails the run).
collect_ignore_glob = [] if os.environ.get("KVFORMAT_RGW_ENV") else ["test_rgw_*.py"]
