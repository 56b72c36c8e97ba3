"""Seal keys from their sources (spec §12.4): a key file or an environment variable, never a config value.

A source is a path, or ``env:NAME``. It holds one 256-bit key as 64 hex digits (surrounding whitespace
ignored): ``openssl rand -hex 32 > key`` makes one. Errors name the source, never its contents, and a
:class:`~kvformat.format._seal.Keyring`'s repr shows key ids only, so a key never reaches a log.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import stat
from collections.abc import Sequence

from ._consts import SEAL_KEY_BYTES
from ._seal import Keyring, SealKey
from ..errors import KeySourceError

__all__ = ["ENV_PREFIX", "load_key", "load_keyring", "looks_like_key"]

ENV_PREFIX = "env:"
_HEX_KEY = re.compile(rb"[0-9a-fA-F]{%d}" % (2 * SEAL_KEY_BYTES))
_MAX_KEY_FILE = 4096


_HEXISH = re.compile(r"(0[xX])?[0-9a-fA-F]{32,}")
_B64ISH = re.compile(r"[A-Za-z0-9+/_-]{22,}={0,2}")
_SHOWN_INSTEAD = "(a value that looks like key material, not shown)"
_QUOTES = "\"'`"
_SEPARATORS = re.compile(r"[\s:]+")


def looks_like_key(value: str) -> bool:
    """Whether a configuration value is a key itself rather than a source naming one (refused: a key in a
    config file ends up in logs, process listings and bug reports). Any spelling counts: bare hex, ``0x…``,
    base64 or base64url, in quotes, split by spaces or colons, with surrounding whitespace."""
    # Hex (with or without 0x) or base64 text of 16+ bytes that names no file: key material, whatever its
    # exact length or spelling, so neither a refusal nor a "no such file" error may echo it.
    v = value.strip()
    if v.startswith(ENV_PREFIX) or os.path.lexists(v) or os.path.dirname(v) not in ("", "/") and os.path.isdir(
            os.path.dirname(v)):  # a missing file in an existing directory: a path, shown as given
        return False
    # A key pasted with its quotes (a YAML or shell habit) or grouped for reading ("ab cd ..", "ab:cd:..").
    while len(v) >= 2 and v[0] == v[-1] and v[0] in _QUOTES:
        v = v[1:-1].strip()
    v = _SEPARATORS.sub("", v)
    if _HEXISH.fullmatch(v):
        return True
    if _B64ISH.fullmatch(v):
        t = v.replace("-", "+").replace("_", "/")
        try:
            return len(base64.b64decode(t + "=" * (-len(t) % 4), validate=True)) >= 16
        except (binascii.Error, ValueError):
            return False
    return False


def _shown(source: str) -> str:
    """How an error names ``source``: never the key itself."""
    return _SHOWN_INSTEAD if looks_like_key(source) else source


def _parse(source: str, raw: bytes) -> SealKey:
    text = raw.strip()
    if not _HEX_KEY.fullmatch(text):
        raise KeySourceError(_shown(source), f"expected one key of {SEAL_KEY_BYTES} bytes as {2 * SEAL_KEY_BYTES} "
                             f"hex digits (e.g. from `openssl rand -hex {SEAL_KEY_BYTES}`), found {len(text)} "
                             "other bytes")
    return SealKey(bytes.fromhex(text.decode()))


def load_key(source: str) -> SealKey:
    """The key a source holds: ``env:NAME`` reads the environment variable NAME, anything else is a file path.

    Raises KeySourceError (a UsageError) when the file cannot be read, the variable is unset, or the
    contents are not one 64-hex-digit key.
    """
    if not isinstance(source, str) or not source.strip():
        raise KeySourceError(repr(source), "expected a key file path or env:NAME")
    if looks_like_key(source):
        raise KeySourceError("(a literal key)", "give a key file path or env:NAME; a key written into a "
                             "configuration leaks into logs and process listings")
    if source.startswith(ENV_PREFIX):
        name = source[len(ENV_PREFIX):]
        value = os.environ.get(name)
        if not name or value is None:
            raise KeySourceError(source, "environment variable not set")
        return _parse(source, value.encode())
    try:
        raw = _read_key_file(source)
    except OSError as e:
        raise KeySourceError(_shown(source), e.strerror or type(e).__name__) from None
    return _parse(source, raw)


def _read_key_file(path: str) -> bytes:
    # Symlinks are followed (secret mounts such as Kubernetes' are symlinks); a FIFO must not block the
    # start-up (O_NONBLOCK) and anything but a small regular file is refused.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeySourceError(path, "not a regular file")
        if st.st_size > _MAX_KEY_FILE:
            raise KeySourceError(path, f"{st.st_size} bytes: not one key")
        return os.read(fd, _MAX_KEY_FILE + 1)
    finally:
        os.close(fd)


def load_keyring(write: str | None, read: Sequence[str] = ()) -> Keyring:
    """The keyring of a deployment: ``write`` seals new files (and opens them), ``read`` only opens files
    sealed earlier (rotation). With no ``write`` the first read key is the keyring's first (a reader)."""
    sources = ([write] if write else []) + [s for s in read if s != write]
    if not sources:
        raise KeySourceError("(none)", "no key given")
    return Keyring(tuple(load_key(s) for s in sources))
