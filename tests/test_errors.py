"""One home for errors: every error class lives in kvformat.errors, each also the matching built-in."""

from __future__ import annotations

import ast
import errno
from pathlib import Path

import kvformat.errors as E

PKG = Path(E.__file__).parent


def test_no_error_class_is_defined_outside_errors_py() -> None:
    found = []
    for path in PKG.rglob("*.py"):
        if path.name == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Error"):
                found.append(f"{path.relative_to(PKG)}:{node.name}")
    assert found == []


def test_each_error_is_also_its_built_in() -> None:
    for name in E.__all__:
        cls = getattr(E, name)
        if cls is E.UnsafeFileError:  # never looked at the contents: an OS error, not a kvformat one
            assert issubclass(cls, OSError) and not issubclass(cls, E.KVFormatError)
            continue
        if cls is E.DestinationError:  # the caller's buffer, never a file's fault: no bad-file handler catches it
            assert issubclass(cls, ValueError) and not issubclass(cls, E.KVFormatError)
            continue
        assert issubclass(cls, E.KVFormatError), name
        if cls is E.RankError:  # a harness process failed: a RuntimeError
            assert issubclass(cls, RuntimeError)
        elif cls is E.PathEscapeError:  # a delete/move refused: also an OSError (ELOOP), as the syscall's would be
            assert issubclass(cls, OSError) and E.PathEscapeError("a/b", "why").errno == errno.ELOOP
        elif cls is not E.KVFormatError:
            assert issubclass(cls, ValueError), name
    assert issubclass(E.StagingTimeoutError, TimeoutError)
    e = E.StagingTimeoutError("chunk 3: writer rank 1 did not publish", chunk=3, writer=1)
    try:
        raise e
    except TimeoutError as caught:  # a generic timeout handler sees it
        assert caught.chunk == 3 and caught.writer == 1 and str(caught).startswith("chunk 3")


def test_staging_reexports_the_same_classes() -> None:
    from kvformat import staging

    assert staging.StagingError is E.StagingError and staging.StagingTimeoutError is E.StagingTimeoutError
