"""tests/hangfs.py mounted for one test: the FUSE process started, waited for, and always released and unmounted."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

HERE = Path(__file__).resolve().parent


@contextmanager
def hang_mount(src: Path, mnt: Path, ctl: Path, log_path: Path, delay_s: float = 0.0) -> Iterator[None]:
    """``src`` through a hangfs mount at ``mnt`` whose reads of files listed in ``ctl`` hang; ``delay_s``: every
    payload read waits that long first (a slow root)."""
    args = [sys.executable, str(HERE / "hangfs.py"), str(src), str(mnt), str(ctl)] + ([str(delay_s)] if delay_s else [])
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 30
            while not os.path.ismount(mnt) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert os.path.ismount(mnt), f"the FUSE mount did not come up: {log_path.read_text()[-2000:]}"
            yield
        finally:
            ctl.write_text("")  # release every hung read before unmounting
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
