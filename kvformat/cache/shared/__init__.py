"""One ``max_bytes`` for a root that several engines share (the protocol: :mod:`kvformat.cache.shared._bound`).

What the rest of ``cache/`` uses: :class:`SharedBound` (every engine on a bounded root runs one), the grant
arithmetic, the control paths and :class:`ControlMac` (a sealed root's control records)."""

from ._bound import SharedBound
from ._mac import ControlMac
from ._state import ENGINES_DIR, LEASE_DIR, STATE_FILE, default_allowance, grant, shared_target

__all__ = ["ENGINES_DIR", "LEASE_DIR", "STATE_FILE", "ControlMac", "SharedBound", "default_allowance", "grant",
           "shared_target"]
