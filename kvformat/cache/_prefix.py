"""Prefix-aware eviction: an :class:`LRUIndex` that knows each chunk's predecessor.

An engine loads the longest run of stored chunks from the start of a prompt, so a chunk whose predecessor is
gone can never be loaded again; plain LRU keeps it (with its bytes and its age) while evicting chunks that are
still loadable. This index learns ``child -> parent`` links (:meth:`PrefixIndex.link`, fed by the tier, which
sees a request's keys in order) and evicts such *dead* chunks before anything else, oldest death first.
:meth:`PrefixIndex.touch_chain` touches a loaded chain tail first, so within one chain the head is the most
recently used and LRU takes tails (leaves) before the heads that keep them loadable.

Links are advisory: a chunk whose parent was never linked is never dead, so an engine that does not link
behaves exactly as with :class:`LRUIndex`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from ._lru import LRUIndex

__all__ = ["PrefixIndex"]


class PrefixIndex(LRUIndex):
    """:class:`LRUIndex` that evicts chunks whose predecessor is gone before any loadable chunk."""

    def __init__(self, max_bytes: int | None) -> None:
        super().__init__(max_bytes)
        self._parent: dict[str, str] = {}
        self._children: dict[str, set[str]] = {}
        self._dead: OrderedDict[str, None] = OrderedDict()  # indexed chunks whose parent is not indexed

    def link(self, relpath: str, parent: str | None) -> None:
        """Record that ``relpath`` follows ``parent`` in a prompt (None: it starts one)."""
        with self._lock:
            old = self._parent.get(relpath)
            if old == parent:
                return
            if old is not None:
                self._children.get(old, set()).discard(relpath)
            if parent is None:
                self._parent.pop(relpath, None)
                self._dead.pop(relpath, None)
                return
            self._parent[relpath] = parent
            self._children.setdefault(parent, set()).add(relpath)
            self._judge_locked(relpath)

    def is_dead(self, relpath: str) -> bool:
        """True when ``relpath`` is indexed and its predecessor is not (it cannot be loaded)."""
        return relpath in self._dead

    def touch_chain(self, relpaths: Sequence[str]) -> None:
        """Touch a loaded prefix, tail first: the head ends most recently used."""
        with self._lock:
            for rel in reversed(relpaths):
                self._touch_locked(rel)

    def _indexed(self, rel: str) -> bool:
        return rel in self

    def _judge_locked(self, rel: str) -> None:
        parent = self._parent.get(rel)
        if parent is not None and self._indexed(rel) and not self._indexed(parent):
            self._dead.setdefault(rel)
        else:
            self._dead.pop(rel, None)

    def _gone_locked(self, rel: str) -> None:
        self._dead.pop(rel, None)
        for child in self._children.get(rel, ()):
            self._judge_locked(child)

    def _drop_locked(self, relpath: str) -> int | None:
        size = super()._drop_locked(relpath)
        if size is not None:
            self._gone_locked(relpath)
        return size

    def add(self, relpath: str, size: int, *, reserved: int = 0) -> list[tuple[str, int]]:
        out = super().add(relpath, size, reserved=reserved)
        self._revive(relpath)
        return out

    def add_found(self, relpath: str, size: int, since: int = 0) -> bool:
        ok = super().add_found(relpath, size, since)
        if ok:
            self._revive(relpath)
        return ok

    def _revive(self, relpath: str) -> None:
        with self._lock:
            if self._indexed(relpath):
                self._judge_locked(relpath)
                for child in self._children.get(relpath, ()):
                    self._judge_locked(child)

    def _first_victims_locked(self) -> list[str]:
        return list(self._dead)  # dead chunks first: their bytes buy no hit

    def _evicted_locked(self, victims: list[tuple[str, int]]) -> None:
        for rel, _ in victims:
            self._gone_locked(rel)
