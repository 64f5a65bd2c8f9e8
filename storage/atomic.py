"""Atomic writes: readers see either the old file or the whole new one, never a part.

Local files are written to a hidden temp name in the same directory, fsynced and renamed
with ``os.replace`` (atomic on POSIX), then the directory is fsynced so the rename survives a
power cut. On object stores a single ``put`` is already all-or-nothing per object.
A failed write (disk full, a crash of the producer) removes its temp file and names the target.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import uuid
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from sluice.errors import WriteError
from sluice.storage.paths import filesystem, is_local, local_path

TMP_PREFIX = ".tmp-"


def tmp_name(path: Path) -> Path:
    """A unique hidden sibling of ``path`` (same directory, so rename stays atomic)."""
    return path.with_name(f"{TMP_PREFIX}{uuid.uuid4().hex[:12]}-{path.name}")


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _describe(e: OSError, target: str) -> str:
    if e.errno == errno.ENOSPC:
        return f"disk full while writing {target}: no space left on device"
    if e.errno == errno.EDQUOT:
        return f"disk quota exceeded while writing {target}"
    return f"could not write {target}: {e.strerror or e}"


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a local temp path to fill; on success it replaces ``target`` atomically.

    For remote targets the temp file is local and uploaded on success.
    """
    s = os.fspath(target)
    if is_local(s):
        final = local_path(s)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = tmp_name(final)
    else:
        import tempfile
        tmp = Path(tempfile.mkdtemp(prefix="sluice-upload-")) / Path(s).name
    try:
        yield tmp
        if is_local(s):
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
            fsync_dir(final.parent)
        else:
            fs, path = filesystem(s)
            fs.makedirs(os.path.dirname(path), exist_ok=True)
            fs.put_file(str(tmp), path)
    except OSError as e:
        raise WriteError(e.errno, _describe(e, s)) from e
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        if not is_local(s):
            with contextlib.suppress(OSError):
                tmp.parent.rmdir()


@contextlib.contextmanager
def atomic_open(target: str | os.PathLike, mode: str = "wb") -> Iterator[IO[Any]]:
    """Open ``target`` for writing; it appears whole on close or not at all."""
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_open writes only ('wb' or 'w'), got {mode!r}")
    with atomic_path(target) as tmp:
        with open(tmp, mode) as f:
            yield f
            f.flush()


def write_bytes(target: str | os.PathLike, data: bytes) -> None:
    with atomic_open(target, "wb") as f:
        f.write(data)


def write_json(target: str | os.PathLike, obj: Any, **kw: Any) -> None:
    write_bytes(target, (json.dumps(obj, indent=2, sort_keys=True, **kw) + "\n").encode())


def write_with(target: str | os.PathLike, fill: Callable[[Path], None]) -> None:
    """Let ``fill(tmp_path)`` write a file (e.g. a library writer), then publish it atomically."""
    with atomic_path(target) as tmp:
        fill(tmp)
        if not tmp.exists():
            raise WriteError(errno.ENOENT, f"writer produced no file for {target}")


def remove_stale_temps(directory: Path) -> int:
    """Delete temp files a killed writer left behind; returns how many."""
    n = 0
    if directory.is_dir():
        for p in directory.rglob(f"{TMP_PREFIX}*"):
            with contextlib.suppress(OSError):
                p.unlink()
                n += 1
    return n
