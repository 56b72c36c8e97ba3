"""A new evictor of a shared root must not index files that are gone because an old journal names them.

A journal stays on the root after its writer stopped journaling: the writer died, or it became the evictor (an
evictor writes none). A later evictor merges it as news; each write it names that an earlier evictor deleted would
be an entry for a file that is not there, a hit that finds no file when loaded (``missing_files`` on CI in
tests/test_shared_root.py, 2026-12-06: the second take-over merged the journal the first evictor had written as a
follower). Same harness as tests/test_shared_control.py: SharedBound engines on a real root, ticks pumped by hand.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from test_shared_control import FILE, Engine, _start


def _ghosts(e: Engine, root: str) -> list[str]:
    """Files ``e`` has indexed that are not on the root."""
    return [rel for rel in e.index.lru_order() if not Path(root, rel).exists()]


def test_the_journal_of_a_follower_that_became_the_evictor_is_not_merged_again(tmp_path: Path) -> None:
    root = str(tmp_path)
    a, b = _start(root)
    wrote = [b.store_one("b") for _ in range(3)]
    assert all(wrote)
    b.sb.tick()  # its journal names the three writes
    a.sb.tick()
    a.sb.close()  # released: b takes over at its next tick
    b.sb.tick()
    assert b.sb.is_evictor
    assert not Path(root, b.sb.journal_rel).exists()  # the follower's journal went with the role
    b.sb.evict(b.index.victims(limit=0))  # alone on the root: deleted at once
    assert not any(Path(root, rel).exists() for rel in wrote)
    c = Engine(root)
    c.sb.tick()
    b.sb.close()
    c.sb.tick()
    assert c.sb.is_evictor
    assert _ghosts(c, root) == [] and not any(rel in c.index for rel in wrote)


def test_a_dead_followers_journal_does_not_bring_back_files_deleted_since(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="test_shared_control")
    root = str(tmp_path)
    a, b = _start(root)
    wrote = [b.store_one("b") for _ in range(3)]
    kept = b.store_one("b")
    assert all(wrote) and kept
    b.sb.tick()  # b's last journal: it dies here (no more ticks)
    a.sb.tick()
    assert all(rel in a.index for rel in wrote)
    time.sleep(1.1 * a.sb.ttl_s)  # b stops counting as live; its journal is removed only after 3 ttl_s
    a.sb.tick()
    assert a.sb.holding is not None and a.sb.holding.alone
    assert f"engine {b.sb.id} has not rewritten its journal" in caplog.text  # said once, when it went silent
    for rel in wrote:  # evicted while b is gone: deleted at once
        a.index.remove(rel)
        a.sb.evict([(rel, FILE)])
    assert not any(Path(root, rel).exists() for rel in wrote)
    c = Engine(root)
    c.sb.tick()
    a.sb.close()
    assert Path(root, b.sb.journal_rel).exists()  # the premise: c finds the dead engine's journal
    c.sb.tick()
    assert c.sb.is_evictor
    assert _ghosts(c, root) == [] and kept in c.index
