"""A real filesystem whose reads fail with EIO past a given offset: a read-only view of a directory, served
over /dev/fuse by a child process running this module (no libfuse: the kernel protocol, the few requests a
reader makes).

Why: a read that fails part-way (a bad sector, a dropped NFS or FUSE server) is an OSError raised after
some of the file's bytes have already landed in the reader's buffer. Nothing else on this machine produces
that from a plain file, and the tests of what a reader leaves in its destination then need the real thing.

Each read request is answered from the backing file, except that bytes at or past ``eio_from`` are
refused: a request starting there gets EIO, one that crosses it gets the bytes before it (a short read;
the reader's next request, at ``eio_from``, gets EIO). Files are opened with FOPEN_DIRECT_IO, so every
read reaches this server (no page cache in between) and the offsets are the reader's own.

    with FaultyFS(backing_dir, eio_from=300_000) as mnt:  # needs root (mount(2)) and /dev/fuse
        ...  # mnt/<path> reads backing_dir/<path>, failing from byte 300,000 on
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import struct
import subprocess
import sys
import time

IN_HDR = struct.Struct("<IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, total_extlen, padding
OUT_HDR = struct.Struct("<IiQ")  # len, error (negative errno), unique
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr: ino size blocks atime mtime ctime (+ns x3) mode nlink uid gid
ENTRY = struct.Struct("<QQQQII")  # fuse_entry_out before its attr: nodeid generation entry_valid attr_valid (+ns x2)
ATTR_OUT = struct.Struct("<QII")  # fuse_attr_out before its attr: attr_valid, attr_valid_nsec, dummy
INIT_IN = struct.Struct("<IIII")  # major, minor, max_readahead, flags
INIT_OUT = struct.Struct("<IIIIHHIIHHI7I")  # 64 bytes (protocol 7.23+)
OPEN_OUT = struct.Struct("<QII")  # fh, open_flags, padding
READ_IN = struct.Struct("<QQI")  # fh, offset, size (then flags we ignore)

LOOKUP, FORGET, GETATTR, OPEN, READ, RELEASE, FLUSH, INIT, INTERRUPT, DESTROY, BATCH_FORGET = (
    1, 2, 3, 14, 15, 18, 25, 26, 36, 38, 42)
NO_REPLY = (FORGET, INTERRUPT, BATCH_FORGET)
FOPEN_DIRECT_IO = 1
MAX_WRITE = 1 << 20


class _Server:
    def __init__(self, fd: int, backing: str, eio_from: int) -> None:
        self.fd = fd
        self.backing = backing
        self.eio_from = eio_from
        self.paths = {1: backing}  # nodeid -> backing path (1: the root)
        self.ids = {backing: 1}

    def reply(self, unique: int, err: int = 0, body: bytes = b"") -> None:
        os.write(self.fd, OUT_HDR.pack(OUT_HDR.size + len(body), -err, unique) + body)

    def attr(self, nodeid: int, st: os.stat_result) -> bytes:
        return ATTR.pack(nodeid, st.st_size, st.st_blocks, int(st.st_atime), int(st.st_mtime), int(st.st_ctime),
                         0, 0, 0, st.st_mode, st.st_nlink, 0, 0, 0, 4096, 0)

    def serve(self) -> None:
        while True:
            try:
                req = os.read(self.fd, MAX_WRITE + 4096)
            except OSError as e:
                if e.errno == errno.EINTR:
                    continue
                return  # ENODEV: unmounted
            _, op, unique, nodeid, *_ = IN_HDR.unpack_from(req)
            body = req[IN_HDR.size:]
            if op in NO_REPLY:
                continue
            try:
                self.handle(op, unique, nodeid, body)
            except OSError as e:
                self.reply(unique, e.errno or errno.EIO)
            if op == DESTROY:
                return

    def handle(self, op: int, unique: int, nodeid: int, body: bytes) -> None:
        if op == INIT:
            _, _, readahead, _ = INIT_IN.unpack_from(body)
            self.reply(unique, 0, INIT_OUT.pack(7, 31, readahead, 0, 16, 12, MAX_WRITE, 1, 0, 0, 0, *[0] * 7))
        elif op == LOOKUP:
            path = os.path.join(self.paths[nodeid], body.split(b"\0", 1)[0].decode())
            st = os.lstat(path)  # ENOENT is the answer for a missing name
            nid = self.ids.setdefault(path, len(self.ids) + 1)
            self.paths[nid] = path
            self.reply(unique, 0, ENTRY.pack(nid, 0, 0, 0, 0, 0) + self.attr(nid, st))  # nothing cached
        elif op == GETATTR:
            self.reply(unique, 0, ATTR_OUT.pack(0, 0, 0) + self.attr(nodeid, os.lstat(self.paths[nodeid])))
        elif op == OPEN:
            self.reply(unique, 0, OPEN_OUT.pack(0, FOPEN_DIRECT_IO, 0))
        elif op == READ:
            _, offset, size = READ_IN.unpack_from(body)
            if offset >= self.eio_from:
                raise OSError(errno.EIO, "injected")
            with open(self.paths[nodeid], "rb") as f:
                f.seek(offset)
                self.reply(unique, 0, f.read(min(size, self.eio_from - offset)))
        elif op in (RELEASE, FLUSH, DESTROY):
            self.reply(unique)
        else:
            raise OSError(errno.ENOSYS, "not served")


def _mount_and_serve(backing: str, mnt: str, eio_from: int) -> None:
    fd = os.open("/dev/fuse", os.O_RDWR)
    libc = ctypes.CDLL(None, use_errno=True)
    opts = f"fd={fd},rootmode={stat.S_IFDIR:o},user_id=0,group_id=0".encode()
    if libc.mount(b"faultyfs", mnt.encode(), b"fuse.faultyfs", 0, opts) != 0:
        e = ctypes.get_errno()
        print(f"mount: {os.strerror(e)}", flush=True)
        sys.exit(1)
    print("ready", flush=True)
    _Server(fd, os.path.abspath(backing), eio_from).serve()


class FaultyFS:
    """Mount the view in a child process for the ``with`` block; ``mount_error`` says why it could not be."""

    def __init__(self, backing: str, mnt: str, *, eio_from: int) -> None:
        self.backing, self.mnt, self.eio_from = backing, mnt, eio_from
        self.proc: subprocess.Popen[str] | None = None

    @staticmethod
    def mount_error() -> str | None:
        """Why a FUSE mount cannot work here (None: it can)."""
        if os.geteuid() != 0:
            return "mounting needs root"
        if not os.path.exists("/dev/fuse"):
            return "no /dev/fuse"
        return None

    def __enter__(self) -> str:
        os.makedirs(self.mnt, exist_ok=True)
        self.proc = subprocess.Popen([sys.executable, __file__, self.backing, self.mnt, str(self.eio_from)],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.proc.wait(10)
            raise OSError(errno.EPERM, f"the FUSE view did not mount: {line or 'no answer'}")
        return self.mnt

    def __exit__(self, *exc: object) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.umount2(self.mnt.encode(), 2)  # MNT_DETACH: the server's next read gets ENODEV and it exits
        assert self.proc is not None
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        deadline = time.monotonic() + 5
        while os.path.ismount(self.mnt) and time.monotonic() < deadline:
            time.sleep(0.05)


if __name__ == "__main__":
    _mount_and_serve(sys.argv[1], sys.argv[2], int(sys.argv[3]))
