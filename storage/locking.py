"""Locks on local paths (``flock``): one writer per dataset version, one promotion at a time in
the model registry; shared locks for readers of a dataset version and for writers that a garbage
collection must not run beside (storage/gc.py). The kernel drops a lock when its holder dies, even
by ``kill -9``, so a crashed writer never leaves a lock behind."""
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
    with _locked(lock_file, fcntl.LOCK_EX, on_wait) as f:
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


@contextlib.contextmanager
def shared(lock_file: str | os.PathLike, on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold a shared lock on ``lock_file`` (created if missing) for the ``with`` block: any number
    of shared holders at once, none while an exclusive holder has it (then ``on_wait(holder)`` is
    called once, as in ``exclusive``, and this process waits). A shared holder writes nothing
    into the file (the others' record stays)."""
    with _locked(lock_file, fcntl.LOCK_SH, on_wait):
        yield


@contextlib.contextmanager
def _locked(lock_file: str | os.PathLike, mode: int, on_wait: Callable[[str], None] | None):
    """The open lock file, locked in ``mode``: at once, or after telling ``on_wait`` who holds it."""
    path = Path(lock_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                f.seek(0)
                on_wait(f.read().strip() or "another process")
            fcntl.flock(f, mode)
        try:
            yield f
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def try_exclusive(lock_file: str | os.PathLike, create: bool = True) -> Iterator[bool]:
    """Take an exclusive lock on ``lock_file`` without waiting: yields True while it is held for
    the ``with`` block, False (holding nothing) when another holder, shared or exclusive, has it.

    ``create=False`` never creates the file (nor its folder): a missing file yields True with
    nothing held, since nobody can hold a lock on it (a dry run that must write nothing; racy
    against a holder that creates the file just after, so a real decision creates it)."""
    path = Path(lock_file)
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    else:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            yield True
            return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


class SharedLease:
    """A shared lock on ``lock_file`` held for as long as this object lives, or until ``close()``
    (a reader's lease on a dataset version, storage/gc.py). ``acquire`` returns None, holding
    nothing, where the file cannot be opened (read-only filesystem, unwritable folder).

    The descriptor is close-on-exec (a program run from here does not inherit it); a forked child
    (DataLoader worker) shares it, which keeps the lock while either lives. Closing never unlocks
    explicitly (``LOCK_UN`` from a forked child would drop the parent's lock too): the kernel
    drops it when the last descriptor is closed."""

    __slots__ = ("fd", "path", "_finalizer", "__weakref__")

    def __init__(self, fd: int, path: str):
        import weakref
        self.fd, self.path = fd, path
        self._finalizer = weakref.finalize(self, os.close, fd)

    @classmethod
    def acquire(cls, lock_file: str | os.PathLike) -> "SharedLease | None":
        path = os.fspath(lock_file)
        fd = -1
        try:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            except FileNotFoundError:  # first reader of this root: make the folder (not its parents)
                with contextlib.suppress(FileExistsError):
                    os.mkdir(os.path.dirname(path))
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            except OSError:  # read-only filesystem or folder: an existing lock file still locks
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a collection removes this version
        except OSError:
            if fd >= 0:
                os.close(fd)
            return None
        return cls(fd, path)

    @property
    def held(self) -> bool:
        return self._finalizer.alive

    def close(self) -> None:
        self._finalizer()
