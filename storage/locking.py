"""Exclusive locks on local paths (``flock``): one writer per dataset version, one promotion at a
time in the model registry. The kernel drops a lock when its holder dies, even by ``kill -9``,
so a crashed writer never leaves a lock behind."""
from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from pathlib import Path
from typing import Callable, Iterator


@contextlib.contextmanager
def exclusive(lock_file: str | os.PathLike, on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_file`` (created if missing) for the ``with`` block.

    When another process holds it, ``on_wait(holder)`` is called once with who holds it (pid,
    host, since when; the holder writes that into the file) and this process waits its turn.
    """
    path = Path(lock_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                f.seek(0)
                on_wait(f.read().strip() or "another process")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.seek(0)
            f.truncate()
            f.write(f"pid {os.getpid()} on {socket.gethostname()} since "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            f.flush()
            yield
        finally:
            with contextlib.suppress(OSError):
                f.truncate(0)
            fcntl.flock(f, fcntl.LOCK_UN)
