"""An unbounded root's stand-in for :class:`~kvformat.cache.shared.SharedBound`: the same questions, answered as
an engine alone on a root without ``max_bytes`` answers them, so that the row engine and the housekeeping never ask
whether there is a bound."""

from __future__ import annotations

from typing import Callable

__all__ = ["NoBound"]


class NoBound:
    """No bound to share: every write and read allowed, nothing journaled, victims deleted at once by ``delete``
    (the row engine's deletion), no housekeeping, no gauges."""

    is_evictor = False  # nobody's evictor: the periodic listing of a shared root's evictor does not run

    def __init__(self, delete: Callable[[list[tuple[str, int]]], None]) -> None:
        self._delete = delete

    def may_write(self, nbytes: int) -> str | None:
        return None

    def unreserve(self, nbytes: int) -> None:
        pass

    def wrote(self, relpath: str, nbytes: int, pred: str | None = None) -> None:
        pass

    def used(self, relpath: str) -> None:
        pass

    def removed(self, relpath: str) -> None:
        pass

    def evict(self, victims: list[tuple[str, int]]) -> None:
        self._delete(victims)

    def refused(self, relpath: str) -> bool:
        return False

    def may_read(self, relpath: str) -> bool:
        return True

    def view_current(self) -> bool:
        return True

    def read_begin(self, relpath: str) -> int | None:
        return -1  # a token read_end ignores, as the evictor's

    def read_end(self, token: int | None) -> None:
        pass

    def describe(self) -> str:
        return ""

    def gauges(self) -> dict[str, int]:
        return {}

    def tick(self) -> None:
        pass

    def close(self) -> None:
        pass
