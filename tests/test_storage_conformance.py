"""The Store conformance suite (kvformat.testing.StoreTests) run against every built-in backend.

Each subclass only says how to open a fresh, empty store: a local directory (buffered and O_DIRECT),
``memory://`` with single-PUT writes, ``memory://`` with temp+move writes, and ``s3://`` on a real
moto S3 server on 127.0.0.1.
"""

from __future__ import annotations

import uuid

import pytest

from kvformat.storage import LocalStore, Store, open_store
from kvformat.storage._fsspec import FsspecStore
from kvformat.testing import StoreTests
from s3_server import s3_bucket, s3_env, s3_server  # noqa: F401  (fixtures)


class TestLocalStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path) -> Store:
        s = open_store(str(tmp_path / "root"))
        assert isinstance(s, LocalStore)
        return s


class TestLocalODirectStore(StoreTests):
    """Every read through O_DIRECT where the destination allows it (bytearrays mostly do not: the
    buffered fallback keeps the contract)."""

    @pytest.fixture
    def store(self, tmp_path) -> Store:
        s = open_store(str(tmp_path / "root"), o_direct="on")
        assert isinstance(s, LocalStore)
        return s


class TestMemoryStore(StoreTests):
    @pytest.fixture
    def store(self) -> Store:
        s = open_store(f"memory://kvf-{uuid.uuid4().hex[:12]}/root")
        assert isinstance(s, FsspecStore) and s.atomic_put
        return s


class TestMemoryTempMoveStore(StoreTests):
    """memory:// forced through temp object + move, the path SFTP/HDFS-like filesystems take."""

    exclusive_create = False  # check, then move: of racing writers, the last one's whole file stays

    @pytest.fixture
    def store(self) -> Store:
        s = open_store(f"memory://kvf-{uuid.uuid4().hex[:12]}/root", atomic_put=False)
        assert isinstance(s, FsspecStore) and not s.atomic_put and not s.exclusive_create
        return s


class TestS3Store(StoreTests):
    mtime_step = 1.1

    @pytest.fixture
    def store(self, s3_bucket: str) -> Store:
        s = open_store(f"s3://{s3_bucket}/cache/root", timeout_s=20)
        assert isinstance(s, FsspecStore) and s.atomic_put and s._conditional_put
        return s
