"""Shared pieces of the CLI tests: kvformat roots, running the real CLI in a subprocess (on a pty, as
another user), and a flip of one byte."""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401  (run_as: imported before the child drops privileges)
import os
import pty
import select
import subprocess
import sys
import tempfile

import numpy as np
from legacy_trees import MODEL, layer_names

import kvformat as K
from kvformat.storage import open_store

CODE = "import sys; from kvformat.cli import main; sys.exit(main(sys.argv[1:]))"
NOBODY = 65534


def layout(n_layers: int = 4, model: str = MODEL) -> K.CanonicalLayout:
    return K.CanonicalLayout.uniform(model, "bfloat16", layer_names(n_layers), 16, 576)


def kv_root(root: str, n: int = 6, *, model: str = MODEL, salt: int = 0) -> tuple[str, list[str]]:
    """A kvformat root of ``n`` blocks in one namespace (namespace.json written, as the tier does)."""
    store = open_store(root)
    L = layout(model=model)
    store.ensure_namespace(L)
    rels = []
    for i in range(n):
        pay = np.random.default_rng(i + salt).integers(0, 256, L.payload_bytes, dtype=np.uint8)
        rel, _, _ = store.put_block(pay, L, K.BlockKey(f"{i + salt:02x}" * 32),
                                    provenance=K.Provenance(tp=2, row="per_worker", writer="test", created=1_700_000_000))
        os.utime(os.path.join(store.root, rel), (1_700_000_000 + i, 1_700_000_000 + i))
        rels.append(rel)
    return store.root, rels


def flip(path: str, offset_from_end: int = 1) -> None:
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))


def cli(args: list[str], *, user: int | None = None, umask: int | None = None, env: dict | None = None,
        **kw) -> subprocess.CompletedProcess:
    """The CLI in its own process (a real stdout encoding, umask, user)."""
    def pre() -> None:
        if umask is not None:
            os.umask(umask)
        if user is not None:
            os.setgid(user)
            os.setuid(user)
    e = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-c", CODE, *args], capture_output=True, preexec_fn=pre, env=e, **kw)


def cli_on_pty(args: list[str]) -> tuple[int, bytes, bytes]:
    """The CLI with stderr on a pseudo-terminal (a TTY) and stdout on a pipe: (rc, stdout, stderr)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", CODE, *args], stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    err = b""
    while True:
        r, _, _ = select.select([master], [], [], 60)
        if not r:
            break
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        err += chunk
    out, _ = proc.communicate()
    os.close(master)
    return proc.returncode, out, err


def run_as(user: int | None, argv: list[str]) -> tuple[int, str]:
    """``main(argv)`` in a forked child running as ``user`` (None: as we are): (exit code, stdout).

    A fork, not a new interpreter: the interpreter may live where another user cannot read it. The
    caller runs the same command once first, so every module it needs is already imported.
    """
    import io
    import json as _json

    from kvformat.cli import main

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        rc = 99
        try:
            os.close(r)
            if user is not None:
                os.setgid(user)
                os.setuid(user)
            buf = io.StringIO()
            real, sys.stdout = sys.stdout, buf
            try:
                rc = main(argv)
            finally:
                sys.stdout = real
            os.write(w, _json.dumps([rc, buf.getvalue()]).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    rc, out = _json.loads(data)
    return rc, out


def shared_tmpdir() -> str:
    """A directory another user can traverse (pytest's tmp_path is 0700 to root)."""
    d = tempfile.mkdtemp(prefix="kvf-cli-", dir="/tmp")
    os.chmod(d, 0o755)
    return d


def other_user() -> int | None:
    """The uid to run as "another user": nobody when we are root, else None (we are not the owner-only case)."""
    return NOBODY if os.geteuid() == 0 else None
