"""The engine-neutral pieces behind issue 21, without an engine: the rate-limited log, the shared root's grant
arithmetic, storage_options checks, the start-up probe and the root health of a local store (a real tmpfs)."""

from __future__ import annotations

import logging
import os
import subprocess
import time
from pathlib import Path

import pytest
from tmpfs_mount import tmpfs

from kvformat.cache._health import DEGRADED, LOST, OK, RootHealth
from kvformat.cache._log import CacheLog
from kvformat.cache.shared import default_allowance, grant, shared_target
from kvformat.errors import RootUnusableError, SchemaError
from kvformat.format._spec import CanonicalLayout
from kvformat.storage import LocalStore
from kvformat.storage._options import check_storage_options
from kvformat.storage._probe import probe_store

LAYOUT = CanonicalLayout.uniform("m/x", "bfloat16", ["l0", "l1"], 16, 576)


def test_warnings_repeat_once_per_interval_with_their_count(caplog: pytest.LogCaptureFixture) -> None:
    log = CacheLog(logging.getLogger("kvformat.test_ops"), prefix="tier X", interval_s=0.2)
    caplog.set_level("WARNING", logger="kvformat.test_ops")
    assert log.warn("disk", "full: %s", "a") is True
    assert [log.warn("disk", "full: %s", "b") for _ in range(5)] == [False] * 5
    assert log.warn("other", "another reason") is True  # reasons are limited separately
    time.sleep(0.25)
    assert log.warn("disk", "full: %s", "c") is True
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs[0] == "tier X: full: a" and msgs[1] == "tier X: another reason"
    assert msgs[2].startswith("tier X: full: c (5 more like this in the last 0.2 s")
    log.warn("disk", "full")
    time.sleep(0.25)
    log.flush()  # what was held back is reported once its interval passed, even if nothing else comes
    assert caplog.records[-1].getMessage() == "tier X: 1 more 'disk' warning(s) in the last 0.2 s (see the tier's metrics)"
    assert log.suppressed("disk") == 0


def test_grant_keeps_every_engine_within_the_bound() -> None:
    m, a = 1000, 100
    assert grant(m, 500, [], a) == 100  # alone with room: the full allowance
    assert grant(m, 950, [], a) == 50
    assert grant(m, 700, [100, 100], a) == 100  # 700 + 2 * max(100, g) + g <= 1000
    assert grant(m, 750, [100, 100], a) == 50  # the followers may still use their old 100 each: 750 + 200 + 50
    assert grant(m, 700, [0, 0], 200) == 100  # fresh followers take the new grant: 700 + 3 g <= 1000
    assert grant(m, 900, [100, 100], a) == 0  # the followers may still use 200: nothing left to grant
    for counted in range(0, 1100, 37):
        for exp in ([], [0], [50, 100], [100, 100, 100]):
            g = grant(m, counted, exp, a)
            assert 0 <= g <= a
            if g:
                assert counted + sum(max(e, g) for e in exp) + g <= m
    assert shared_target(1000, 1, 100) == 1000 and shared_target(1000, 3, 100) == 700
    assert shared_target(1000, 8, 100) == 500  # never below half the bound
    assert default_allowance(64 << 30, 4 << 20) == 4 << 30 and default_allowance(100, 30) == 60


@pytest.mark.parametrize("opts,field", [
    ({"timeout_s": "abc"}, "storage_options.timeout_s"), ({"timeout_s": 0}, "storage_options.timeout_s"),
    ({"max_in_flight": 0}, "storage_options.max_in_flight"), ({"atomic_put": "yes"}, "storage_options.atomic_put"),
    ({"endpoint": "x"}, "storage_options.endpoint"), ({"secrett": "x"}, "storage_options.secrett"),
    ({1: "x"}, "storage_options"),
])
def test_storage_options_named(opts: dict, field: str) -> None:
    with pytest.raises(SchemaError) as e:
        check_storage_options("s3://bucket/prefix", opts)
    assert e.value.field == field
    check_storage_options("s3://bucket/prefix", {"endpoint_url": "http://x", "key": "k", "secret": "s",
                                                 "timeout_s": 2.5, "read_timeout_s": None, "client_kwargs": {}})
    check_storage_options("/local/path", {"anything": 1})  # local roots take none (the tier warns)


def test_probe_and_health_of_a_local_root(tmp_path: Path) -> None:
    st = LocalStore(str(tmp_path / "root"))
    assert probe_store(st) is None and not list((tmp_path / "root" / ".kvformat" / "probe").iterdir())
    mnt = tmp_path / "mnt"
    with tmpfs(mnt, "size=4m"):
        log = CacheLog(logging.getLogger("kvformat.test_ops"))
        h = RootHealth(LocalStore(str(mnt)), str(mnt), log)
        h.startup([LAYOUT])
        assert h.state == OK and h.check()
        os.unlink(mnt / LAYOUT.namespace() / "namespace.json")
        assert not h.check() and h.state == LOST and "namespace.json is gone" in h.reason
        LocalStore(str(mnt)).ensure_namespace(LAYOUT)
        assert h.check() and h.state == OK
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        with pytest.raises(RootUnusableError, match="read-only filesystem") as e:
            RootHealth(LocalStore(str(mnt)), str(mnt), log).startup([LAYOUT])
        assert e.value.step == "write"
        d = RootHealth(LocalStore(str(mnt)), str(mnt), log, start_degraded=True)
        d.startup([LAYOUT])
        assert d.state == DEGRADED and not d.check()
        subprocess.run(["mount", "-o", "remount,rw", str(mnt)], check=True)
        assert d.check() and d.state == OK
        subprocess.run(["umount", "-l", str(mnt)], check=True)
        assert not h.check() and h.state == LOST and "another directory now" in h.reason
        assert os.listdir(mnt) == []
