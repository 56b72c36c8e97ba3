"""Suite-wide rule: a skipped test fails the run, unless the skip is explicitly allowed.

The integration tests (vLLM, s3fs/moto, tmpfs mounts) skip when their dependency is missing, and a
skipped test must never be counted as passing (docs/DEVELOPING.md). ``KVFORMAT_ALLOW_SKIPS=1`` allows
every skip (a partial local setup); ``KVFORMAT_ALLOW_SKIPS=test_diskfull,test_s3`` allows the skips
whose test id contains one of the comma-separated parts.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

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
