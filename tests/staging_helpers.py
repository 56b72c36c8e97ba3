"""A Stager whose re-check of a slot can be raced: shared by tests/test_staging.py and tests/test_staging_save.py."""

from __future__ import annotations

from typing import Callable

from kvformat.staging import Stager


class RacingStager(Stager):
    """Runs ``race`` (the writer republishing the chunk) between this rank's copy of the slot and its re-check."""

    race: Callable[[], None] | None = None

    def _check_unchanged(self, chunk: int, epoch: int) -> None:
        if self.race is not None:
            self.race()
        super()._check_unchanged(chunk, epoch)
