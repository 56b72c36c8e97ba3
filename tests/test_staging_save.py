"""Stager.save and a slot republished while it is being saved (issue 11): no file ever becomes visible.

Two real ranks (threads) on one real /dev/shm row; the store is a real LocalStore that records what
it was asked to publish.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import pytest

from kvformat.staging import DONE, Stager, StagingConflictError
from kvformat.storage import LocalStore
from staging_helpers import RacingStager
from test_staging import _ids, _key, _kv, _layout, _name, _open_threads


class _RecordingStore(LocalStore):
    """A LocalStore that remembers every put and delete it served."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.puts: list[str] = []
        self.deletes: list[str] = []

    def _put_many(self, items: Sequence[tuple[str, list[Any]]], **kw: Any) -> list[bool | BaseException]:
        # block files only: the namespace.json a store writes once per namespace is not a publication
        self.puts += [r for r, _ in items if r.endswith(".kvf")]
        return super()._put_many(items, **kw)

    def _delete_many(self, relpaths: Sequence[str], timeout_s: float | None) -> list[bool | BaseException]:
        self.deletes += list(relpaths)
        return super()._delete_many(relpaths, timeout_s)


def _republish(ranks: tuple[Stager, ...], block_ids: list[int]) -> None:
    for st in ranks:  # the collective stage_out of new blocks into chunk 0
        st.stage_out(block_ids, 0)


def test_stager_save_never_publishes_a_republished_slot(tmp_path) -> None:
    L = _layout()
    store = _RecordingStore(str(tmp_path))
    rows = _open_threads(_name(), 2, L.payload_bytes)
    try:
        ids = _ids(3)
        other = Stager(rows[1], _kv(2), L, timeout_s=5)
        w = RacingStager(rows[0], _kv(), L, timeout_s=5)
        assert w.stage_out(ids[0], 0) and not other.stage_out(ids[0], 0)
        w.race = functools.partial(_republish, (w, other), ids[1])  # the slot is reused mid-save
        with pytest.raises(StagingConflictError):
            w.save(0, _key(0), store, all_ranks=True)
        assert store.puts == [] and store.deletes == []  # nothing was ever visible, nothing to take back
        assert list(store.list()) == [] and rows[0].state(0) == (2, DONE)
        w.race = None
        rel, n, wrote = w.save(0, _key(0), store)  # the new epoch saves normally, from one consistent copy
        assert wrote and store.puts == [rel]
        out = bytearray(L.payload_bytes)
        store.read_into(rel, out, expect=L, key=_key(0))
        assert bytes(out) == rows[0].slot(0).numpy().tobytes()
        del w, other
    finally:
        for row in rows:
            row.close()
