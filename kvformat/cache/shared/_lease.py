"""The lease: ``lease/<generation>`` objects, created exclusively; whoever creates generation ``g + 1`` is the
root's evictor from then on (the protocol: :mod:`kvformat.cache.shared`). A lease names its holder (engine id, host,
PID), so that one provably dead here is not waited out."""

from __future__ import annotations

import json
import os
from typing import Any

from ...errors import ControlRecordError
from ...format import CONTROL_DIR
from ...format import host_tag
from ._checks import MAX_GEN, MAX_LEASE_BYTES, load_doc
from ._control import Control

__all__ = ["LEASE_DIR", "Leases", "dead_here", "parse_lease"]

LEASE_DIR = f"{CONTROL_DIR}/lease"


def parse_lease(raw: bytes) -> dict[str, Any]:
    """A lease's holder, checked: ``owner`` and ``host`` (None unless strings), ``pid`` (0 unless an int)."""
    doc = load_doc(raw)
    return {"owner": doc.get("owner") if isinstance(doc.get("owner"), str) else None,
            "host": doc.get("host") if isinstance(doc.get("host"), str) else None,
            "pid": doc.get("pid") if isinstance(doc.get("pid"), int) and not isinstance(doc.get("pid"), bool) else 0}


def dead_here(owner: dict[str, Any]) -> bool:
    """Whether the engine that wrote ``owner`` ({"host", "pid"}) is a process of this kernel boot and PID
    namespace that no longer runs (then its lease is not waited out)."""
    if owner.get("host") != host_tag():
        return False
    try:
        pid = int(owner.get("pid", 0))
    except (TypeError, ValueError):
        return False
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _rel(gen: int) -> str:
    return f"{LEASE_DIR}/{gen:012d}"


class Leases:
    """The root's leases as engine ``owner_id`` lists, reads and takes them."""

    def __init__(self, control: Control, owner_id: str) -> None:
        self.control = control
        self.owner_id = owner_id
        self._seen: dict[str, tuple[int, float, bool]] = {}  # sealed: lease name -> (size, mtime, MAC ok)

    def gens(self) -> list[int]:
        """The generations leased (on a sealed root, only those whose lease verifies)."""
        entries = [(e, e.relpath.rsplit("/", 1)[-1]) for e in self.control.store.list_dir(LEASE_DIR)]
        entries = [(e, n) for e, n in entries if len(n) == 12 and n.isdigit()]
        if self.control.mac is None:
            return [int(n) for _, n in entries]
        # Sealed: a lease counts only if its MAC verifies, else a keyless co-tenant could take the newest
        # generation by creating a name (the evictor would step down, followers wait on nobody). Each file is
        # read once per (size, mtime).
        seen, gens = self._seen, []
        for e, n in entries:
            was = seen.get(n)
            if was is None or was[:2] != (e.size, e.mtime):
                ok = self.body(int(n)) is not None
                seen[n] = was = (e.size, e.mtime, ok)
            if was[2]:
                gens.append(int(n))
        listed = {n for _, n in entries}
        for gone in [n for n in seen if n not in listed]:
            del seen[gone]
        return gens

    def body(self, gen: int) -> bytes | None:
        """Lease ``gen``'s body, or None when it cannot be read or (sealed) does not verify."""
        rel = _rel(gen)
        try:
            return self.control.read(rel, MAX_LEASE_BYTES)
        except ControlRecordError as e:
            self.control.reject(e.with_path(rel))
            return None
        except (OSError, TimeoutError):
            return None

    def owner(self, gen: int) -> dict[str, Any] | None:
        """Who holds lease ``gen`` (:func:`parse_lease`), or None when that is not known."""
        body = self.body(gen)
        if body is None:
            return None
        try:
            return parse_lease(body)
        except ControlRecordError as e:
            self.control.reject(e.with_path(_rel(gen)))
            return None

    def claim(self, gen: int) -> tuple[int, bool]:
        """Try to take generation ``gen``: (the generation taken, or 0; whether another engine won it, then
        watched instead)."""
        store = self.control.store
        if gen > MAX_GEN:
            # Only a planted lease holds the last generation (10**12 take-overs never happen). Taking over from it
            # would need a generation past the last: remove it and go on from the newest other one, so that a
            # co-tenant cannot end eviction on the root for good.
            self.control.reject(ControlRecordError("gen", f"a lease at the last generation {MAX_GEN} (removed)",
                                                   path=LEASE_DIR))
            try:
                store.delete(_rel(MAX_GEN))
            except OSError:
                return 0, False
            gen = max((g for g in self.gens() if g < MAX_GEN), default=0) + 1
        body = json.dumps({"owner": self.owner_id, "host": host_tag(), "pid": os.getpid()}).encode()
        rel = _rel(gen)
        if not self.control.put(rel, body, overwrite=False):
            if self.control.mac is None or self.body(gen) is not None:
                return 0, True  # another engine won this generation
            # Sealed, and the name is held by a record without a valid MAC (planted): not a lease. Remove it and
            # take the generation, else a planted name would block every take-over for good.
            try:
                store.delete(rel)
            except OSError:
                pass
            if not self.control.put(rel, body, overwrite=False):
                return 0, True
        return gen, False

    def drop_older(self, gen: int) -> None:
        """Delete the leases older than ``gen`` (history once ``gen`` is taken)."""
        for g in self.gens():
            if g < gen:
                try:
                    self.control.store.delete(_rel(g))
                except OSError:
                    pass
