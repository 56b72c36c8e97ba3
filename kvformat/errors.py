"""The kvformat error hierarchy.

Every problem with a file's *contents* raises a subclass of :class:`KVFormatError`; each subclass
also inherits the matching built-in (``ValueError`` …) so generic handlers still work. OS errors
(``FileNotFoundError``, ``PermissionError``, ``ENOSPC`` …) are never wrapped: they pass through.
"""

from __future__ import annotations

import errno

from typing import Any

__all__ = [
    "KVFormatError",
    "NotKVFormatError",
    "UnsupportedVersionError",
    "HeaderError",
    "TruncatedError",
    "OversizedHeaderError",
    "InvalidJSONError",
    "SchemaError",
    "LayoutMismatchError",
    "ChecksumError",
    "CodecError",
    "SealError",
    "TagMismatchError",
    "UnknownKeyError",
    "KeySourceError",
    "ReplicaMismatchError",
    "ControlRecordError",
    "LegacyLayoutError",
    "UsageError",
    "RootUnusableError",
    "StagingError",
    "StagingTimeoutError",
    "StagingConflictError",
    "UnsafeFileError",
    "PathEscapeError",
    "RankError",
    "DestinationError",
]


class KVFormatError(Exception):
    """Base class of every kvformat error. ``path`` is set when the error concerns a file.

    ``file_id`` is set by the reader when the error came from an open file: which file (version) was
    read, so that a quarantine moves that file and never one published later under the same name.
    """

    file_id: Any = None

    def __init__(self, message: str, *, path: str | None = None) -> None:
        self.message = message
        self.path = path
        super().__init__(message)

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message

    def with_path(self, path: str) -> "KVFormatError":
        """Attach the file path (storage code knows it, byte-level code does not)."""
        if self.path is None:
            self.path = path
        return self

    @property
    def reason(self) -> str:
        """A short stable tag for metrics and log-once keys (the class name)."""
        return type(self).__name__


class NotKVFormatError(KVFormatError, ValueError):
    """The bytes are not a kvformat file (no length field, or not the kvformat header prefix)."""


class UnsupportedVersionError(KVFormatError, ValueError):
    """The file declares a format major version this reader does not implement (spec §7)."""

    def __init__(self, found: str, supported: int, *, path: str | None = None) -> None:
        self.found = found
        self.supported = supported
        super().__init__(f"format version {found!r} is not supported (this reader reads major {supported})", path=path)


class HeaderError(KVFormatError, ValueError):
    """The header is malformed."""


class TruncatedError(HeaderError):
    """The file ends before a region it declares (header or payload)."""

    def __init__(self, region: str, needed: int, available: int, *, path: str | None = None) -> None:
        self.region = region
        self.needed = needed
        self.available = available
        super().__init__(f"truncated {region}: need {needed} bytes, have {available}", path=path)


class OversizedHeaderError(HeaderError):
    """The header length field exceeds the limit (spec §8), or a declared size exceeds a limit."""

    def __init__(self, field: str, limit: int, found: int, *, path: str | None = None) -> None:
        self.field = field
        self.limit = limit
        self.found = found
        super().__init__(f"{field} is {found}, over the limit of {limit}", path=path)


class InvalidJSONError(HeaderError):
    """The header bytes are not valid UTF-8 JSON (or repeat a key, or nest too deeply)."""


class SchemaError(HeaderError):
    """The header JSON parses but violates the schema (spec §4). ``field`` names the offender."""

    def __init__(self, field: str, message: str, *, path: str | None = None) -> None:
        self.field = field
        super().__init__(f"{field}: {message}", path=path)


class LayoutMismatchError(KVFormatError, ValueError):
    """The file is valid but its layout or key is not what the reader expects."""

    def __init__(self, field: str, expected: Any, found: Any, *, path: str | None = None) -> None:
        self.field = field
        self.expected = expected
        self.found = found
        super().__init__(f"layout mismatch on {field}: expected {expected!r}, found {found!r}", path=path)


class ChecksumError(KVFormatError, ValueError):
    """A checksum does not match. ``region`` is 'header', 'data' or 'raw' (spec §5)."""

    def __init__(self, region: str, expected: str, actual: str, *, path: str | None = None) -> None:
        self.region = region
        self.expected = expected
        self.actual = actual
        super().__init__(f"{region} checksum mismatch: header says {expected}, bytes hash to {actual}", path=path)


class CodecError(KVFormatError, ValueError):
    """The compressed payload cannot be decoded, or decodes to the wrong size."""


class SealError(KVFormatError, ValueError):
    """A sealed file (spec §12) that cannot be authenticated. Messages never quote payload bytes or keys."""


class TagMismatchError(SealError):
    """The authentication tag of a sealed file does not verify under the key its ``kvf.key_id`` names:
    the file was written without that key, or altered since (header, payload or tag)."""

    def __init__(self, key_id: str, *, path: str | None = None) -> None:
        self.key_id = key_id
        super().__init__(f"authentication tag does not verify under key {key_id}: the file was written without "
                         "the key or altered since", path=path)


class UnknownKeyError(SealError):
    """A sealed file names a key id this reader holds no key for (another deployment's key, a retired key,
    or no key given). Not a sign of damage: the tier serves it as a miss and leaves it in place."""

    def __init__(self, key_id: str, held: tuple[str, ...] = (), *, path: str | None = None) -> None:
        self.key_id = key_id
        self.held = held
        have = f"holds {', '.join(held)}" if held else "holds no key"
        super().__init__(f"sealed under key {key_id}; this reader {have}", path=path)


class ControlRecordError(KVFormatError, ValueError):
    """A record of a shared root's coordination (``.kvformat/``: a journal, the state, a lease) that is not of the
    expected shape: a path leaving the root, a size or generation out of range, an oversized or non-regular file,
    a missing MAC on a sealed root. The record is skipped and counted; ``why`` is a short stable tag."""

    def __init__(self, why: str, detail: str = "", *, path: str | None = None) -> None:
        self.why = why
        super().__init__(f"control record rejected ({why}){': ' + detail if detail else ''}", path=path)

    @property
    def reason(self) -> str:
        return f"ControlRecordError:{self.why}"


class ReplicaMismatchError(KVFormatError, ValueError):
    """Per-worker slots that must be byte-identical (replicated MLA latent) differ."""

    def __init__(self, digests: list[str], *, path: str | None = None) -> None:
        self.digests = digests
        per_slot = f" (xxh3 per slot: {', '.join(digests)})" if digests else ""
        super().__init__(f"worker replicas differ{per_slot}", path=path)


class LegacyLayoutError(KVFormatError, ValueError):
    """A legacy vLLM fs-tier file's row layout cannot be inferred. ``hint`` names the CLI flag."""

    def __init__(self, message: str, *, hint: str | None = None, path: str | None = None) -> None:
        self.hint = hint
        super().__init__(message + (f" (pass {hint})" if hint else ""), path=path)


class UsageError(KVFormatError, ValueError):
    """A bad value given by the user: a command-line argument or a configuration parameter.

    The CLI exits with code 2 on it. Also a ``ValueError``, as a bad argument value is in Python.
    """


class KeySourceError(UsageError):
    """A seal key source (a key file or an environment variable) that cannot be used: unreadable, unset, or
    not one 256-bit key. ``source`` names the file or variable, never its contents."""

    def __init__(self, source: str, message: str) -> None:
        self.source = source
        super().__init__(f"seal key {source}: {message}")


class RootUnusableError(UsageError, OSError):
    """A cache root that cannot be used as configured: the start-up probe (create, write, publish, read back,
    delete one object) failed. ``field`` names the parameter to fix (``root``, ``storage_options``,
    ``storage_options.endpoint_url`` …), ``step`` the probe step that failed, ``cause`` the storage error.

    Also an ``OSError``: a root that cannot be written is one to vLLM's tier contract (its own fs tier raises
    the OS error), and callers that catch ``OSError`` around a tier's construction must catch this too.
    ``errno`` is the cause's, where it has one.
    """

    def __init__(self, field: str, message: str, *, step: str | None = None, cause: BaseException | None = None,
                 path: str | None = None) -> None:
        self.field = field
        self.step = step
        self.cause = cause
        super().__init__(f"{field}: {message}", path=path)
        self.errno = getattr(cause, "errno", None)


class StagingError(KVFormatError, ValueError):
    """A staging call cannot complete: bad arguments, or the writer of a chunk reported a failure."""


class StagingTimeoutError(StagingError, TimeoutError):
    """Waiting on another rank passed its deadline. ``chunk``/``writer`` say what was waited for.

    Also a ``TimeoutError`` (an ``OSError`` without errno): generic timeout handlers catch it.
    """

    def __init__(self, message: str, *, chunk: int | None = None, writer: int | None = None,
                 epoch: int | None = None, state: str | None = None, waited_s: float = 0.0) -> None:
        self.chunk = chunk
        self.writer = writer
        self.epoch = epoch
        self.state = state
        self.waited_s = waited_s
        super().__init__(message)


class StagingConflictError(StagingError):
    """A slot was republished while a rank was still reading it (the caller reused the chunk too early)."""


class UnsafeFileError(OSError):
    """A small metadata file that is not read: a symlink, not a regular file, or too large.

    An ``OSError`` only (not a :class:`KVFormatError`): the file's contents were never looked at, so callers
    treat it as the unreadable file it is.
    """


class PathEscapeError(KVFormatError, OSError):
    """A delete or move under a root refused: its path would leave the root (a symlinked directory, ``..``, an
    absolute or empty component) or names another file than the one checked. ``path`` and ``why`` say which."""

    def __init__(self, path: str, why: str) -> None:
        self.why = why
        KVFormatError.__init__(self, why, path=path)
        self.errno = errno.ELOOP


class RankError(KVFormatError, RuntimeError):
    """A rank process of :func:`kvformat.testing.ranks.run_ranks` raised: ``rank`` and its ``traceback`` (text)."""

    def __init__(self, rank: int, tb: str) -> None:
        self.rank = rank
        self.traceback = tb
        super().__init__(f"rank {rank} failed:\n{tb}")


class DestinationError(ValueError):
    """The caller's destination cannot take a read (too small for the expected layout, outside the row).

    A ``ValueError`` only, not a :class:`KVFormatError`: the file was not at fault, so no handler of bad
    files (the tier's quarantine, ``verify``) ever condemns a file for it.
    """
