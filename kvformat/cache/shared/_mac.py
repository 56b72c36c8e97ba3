"""Authenticated control records of a sealed shared root (issue 31 item 6; spec/GUARANTEES.md section 10).

On a sealed root every engine holds the deployment key, so the coordination files (journals, state, leases) carry a
MAC under it: a co-tenant without the key can then at worst remove or garble whole files (which it could do to the
cache files anyway), never write a record an engine acts on, so it cannot steer the evictor. Pure bytes in, bytes
out: the callers read and write the files.

A record is its JSON body followed by one trailer line, ``\\nkvf-mac <key id> <64 hex digits>\\n``. The MAC is keyed
BLAKE2b-256 over the record's path under the root, a NUL and the body, so a record is valid only at the path it was
written for (a journal copied over the state, or to another engine's name, does not verify). The MAC key is derived
from the deployment key with its own label, so it is never the key that seals the cache files.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass, field

from ...errors import ControlRecordError
from ...format import Keyring

__all__ = ["ControlMac"]

_LABEL = b"kvformat control-record MAC v1"
_TRAILER = re.compile(rb"\nkvf-mac ([0-9a-f]{16}) ([0-9a-f]{64})\n\Z")


@dataclass(frozen=True, repr=False)
class ControlMac:
    """The MAC keys of a keyring: the write key's signs, every held key's verifies (a rotation keeps the peers
    that still write under the old key in the bound)."""

    write_id: str
    _keys: dict[str, bytes] = field(compare=False)

    @classmethod
    def of(cls, keys: Keyring) -> "ControlMac":
        derived = {k.key_id: hmac.new(k.secret, _LABEL, hashlib.sha256).digest() for k in keys.keys}
        return cls(keys.write_key.key_id, derived)

    def _mac(self, key_id: str, relpath: str, body: bytes) -> str:
        return hashlib.blake2b(relpath.encode() + b"\0" + body, key=self._keys[key_id], digest_size=32).hexdigest()

    def seal(self, relpath: str, body: bytes) -> bytes:
        """``body`` with its trailer, for the file at ``relpath``."""
        return body + b"\nkvf-mac %s %s\n" % (self.write_id.encode(), self._mac(self.write_id, relpath, body).encode())

    def open(self, relpath: str, raw: bytes) -> bytes:
        """The body of the record read at ``relpath``; ControlRecordError ``mac`` when it has no trailer, names a
        key this engine does not hold, or does not verify."""
        m = _TRAILER.search(raw)
        if m is None:
            raise ControlRecordError("mac", "no MAC on a sealed root's control record", path=relpath)
        key_id, tag = m.group(1).decode(), m.group(2).decode()
        body = raw[:m.start()]
        if key_id not in self._keys:
            raise ControlRecordError("mac", f"MAC under key id {key_id}, not held here", path=relpath)
        if not hmac.compare_digest(self._mac(key_id, relpath, body), tag):
            raise ControlRecordError("mac", "MAC does not verify (written without the key, altered or moved)",
                                     path=relpath)
        return body

    def __repr__(self) -> str:
        return f"ControlMac(write_id={self.write_id})"
