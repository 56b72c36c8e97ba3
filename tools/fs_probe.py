"""Probe the filesystem properties a kvformat root relies on, on one directory seen through one or more clients.

    python tools/fs_probe.py DIR [DIR ...] [--json]

Each DIR is the same directory as seen by a different client (e.g. two FUSE mounts of one MooseFS); with one DIR
both "clients" are this process. kvformat's shared root (cache/shared/) uses no POSIX lock: it needs exclusive
create (O_EXCL, ``link``), atomic replace (``rename``), listing, and that another client sees a replaced object
within a bound its lease ttl covers. The lock rows are reported for operators who wrap kvformat in their own
locking. Independent of kvformat: only os/fcntl here.
"""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import sys
import time
import uuid

POLL_S = 0.005
LIMIT_S = 10.0


def _visible_after(pred) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < LIMIT_S:
        if pred():
            return time.monotonic() - t0
        time.sleep(POLL_S)
    return None


def _read(p: str) -> bytes | None:
    try:
        with open(p, "rb") as f:
            return f.read()
    except OSError:
        return None


def _write(p: str, data: bytes) -> None:
    with open(p, "wb") as f:
        f.write(data)


def probe(dirs: list[str]) -> list[dict]:
    a, b = dirs[0], dirs[1 % len(dirs)]
    tag = uuid.uuid4().hex[:8]
    rows: list[dict] = []

    def row(name: str, ok: bool, detail: str, needed: str) -> None:
        rows.append({"property": name, "ok": bool(ok), "detail": detail, "kvformat": needed})

    def pa(n: str) -> str:
        return os.path.join(a, f".probe-{tag}-{n}")

    def pb(n: str) -> str:
        return os.path.join(b, f".probe-{tag}-{n}")

    made: list[str] = []
    try:
        fd = os.open(pa("excl"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        os.close(fd)
        made.append(pa("excl"))
        try:
            os.close(os.open(pb("excl"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            row("exclusive create across clients", False, "second O_EXCL create succeeded", "required (temp names)")
        except FileExistsError:
            row("exclusive create across clients", True, "second O_EXCL create: EEXIST", "required (temp names)")

        _write(pa("tmp1"), b"one")
        made += [pa("tmp1"), pa("link")]
        os.link(pa("tmp1"), pa("link"))
        vis = _visible_after(lambda: _read(pb("link")) == b"one")
        _write(pa("tmp2"), b"two")
        made.append(pa("tmp2"))
        try:
            os.link(pb("tmp2"), pb("link"))
            excl = False
        except FileExistsError:
            excl = True
        row("link publish: exclusive, visible", excl and vis is not None,
            f"second link EEXIST={excl}; other client sees it after {_ms(vis)}", "required (lease generations)")

        _write(pa("state"), b"v1")
        made.append(pa("state"))
        _read(pb("state"))  # let the other client cache the old object
        _write(pa("state.tmp"), b"v2-longer")
        os.replace(pa("state.tmp"), pa("state"))
        vis = _visible_after(lambda: _read(pb("state")) == b"v2-longer")
        row("rename publish visible", vis is not None, f"replaced object seen by other client after {_ms(vis)}",
            "required; ttl_s must exceed this (state.json)")

        os.stat(pb("state"))
        def ident(p: str) -> tuple[int, int, int]:
            st = os.stat(p)
            return st.st_ino, st.st_size, st.st_mtime_ns

        st0 = ident(pb("state"))
        time.sleep(0.02)
        _write(pa("state.tmp"), b"v3")
        os.replace(pa("state.tmp"), pa("state"))
        vis = _visible_after(lambda: ident(pb("state")) != st0)
        row("attribute change visible (lease timing)", vis is not None,
            f"new inode/size/mtime seen by other client after {_ms(vis)}", "degrades: takeover waits ttl_s + this")

        _write(pa("listed"), b"x")
        made.append(pa("listed"))
        vis = _visible_after(lambda: os.path.basename(pa("listed")) in os.listdir(b))
        row("listing visible", vis is not None, f"new name in other client's listing after {_ms(vis)}",
            "required (lease/, engines/)")

        os.unlink(pa("listed"))
        vis = _visible_after(lambda: _read(pb("listed")) is None)
        row("delete visible", vis is not None, f"other client's open fails after {_ms(vis)}",
            "degrades: evicted bytes freed later")

        for name, lock, unlock in (("flock", lambda f: fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB),
                                    lambda f: fcntl.flock(f, fcntl.LOCK_UN)),
                                   ("fcntl", lambda f: fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB),
                                    lambda f: fcntl.lockf(f, fcntl.LOCK_UN))):
            _write(pa("lock"), b"")
            made.append(pa("lock"))
            fa = os.open(pa("lock"), os.O_RDWR)
            fb = os.open(pb("lock"), os.O_RDWR)
            try:
                lock(fa)
                try:
                    lock(fb)
                    ok, det = False, "second client also got the lock"
                    unlock(fb)
                except OSError as e:
                    ok, det = e.errno in (errno.EAGAIN, errno.EACCES), f"second client: {errno.errorcode.get(e.errno)}"
                unlock(fa)
            except OSError as e:
                ok, det = False, f"lock failed: {e}"
            finally:
                os.close(fa)
                os.close(fb)
            if len(dirs) == 1 and name == "fcntl":
                det += " (one process: POSIX locks never conflict within a process)"
            row(f"{name} exclusion across clients", ok, det, "not used (no POSIX locks)")

        made.append(pa("direct"))
        try:
            fd = os.open(pa("direct"), os.O_CREAT | os.O_WRONLY | getattr(os, "O_DIRECT", 0), 0o644)
            buf = mmap.mmap(-1, 4096)
            buf.write(b"d" * 4096)
            n = os.write(fd, buf)
            os.close(fd)
            row("O_DIRECT", n == 4096, f"aligned 4 KiB write wrote {n}", "not used (buffered I/O)")
        except OSError as e:
            row("O_DIRECT", False, f"{errno.errorcode.get(e.errno)}", "not used (buffered I/O)")

        made.append(pa("sparse"))
        with open(pa("sparse"), "wb") as f:
            f.truncate(64 << 20)
            f.seek(32 << 20)
            f.write(b"x")
        st = os.stat(pa("sparse"))
        row("sparse files", st.st_blocks * 512 < st.st_size // 2,
            f"{st.st_size >> 20} MiB file uses {st.st_blocks * 512 >> 10} KiB", "not needed (du counts st_size)")

        res = []
        for i in range(8):
            _write(pa("mtime"), bytes(i))
            res.append(os.stat(pa("mtime")).st_mtime_ns)
            time.sleep(0.003)
        made.append(pa("mtime"))
        sub = all(t % 1_000_000_000 == 0 for t in res)
        gran = "1 s" if sub else ("1 ms or finer" if any(t % 1_000_000 for t in res) else "ms")
        row("mtime resolution", True, gran, "not relied on (own monotonic clock)")

        sv = os.statvfs(a)
        row("statvfs", sv.f_blocks > 0 and sv.f_frsize > 0,
            f"{sv.f_blocks * sv.f_frsize >> 30} GiB total, {sv.f_bavail * sv.f_frsize >> 30} GiB free",
            "degrades: start-up probe's free-space check only")
    finally:
        for p in made:
            try:
                os.unlink(p)
            except OSError:
                pass
    return rows


def _ms(v: float | None) -> str:
    return "never (10 s)" if v is None else f"{v * 1000:.0f} ms"


def main(argv: list[str]) -> int:
    as_json = "--json" in argv
    dirs = [d for d in argv if d != "--json"]
    if not dirs:
        print(__doc__, file=sys.stderr)
        return 2
    rows = probe(dirs)
    if as_json:
        print(json.dumps({"dirs": dirs, "rows": rows}))
    else:
        print(f"{'property':42} {'ok':4} {'detail':58} kvformat")
        for r in rows:
            print(f"{r['property']:42} {'yes' if r['ok'] else 'NO':4} {r['detail']:58} {r['kvformat']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
