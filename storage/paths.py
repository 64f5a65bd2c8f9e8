"""Paths that may be local or any fsspec URL (``s3://``, ``gs://``, ``memory://``).

Local paths are the default and take fast paths (``os.replace``, ``fsync``); other
filesystems go through fsspec, whose package the user installs (``s3fs`` for S3).
"""
from __future__ import annotations

import os
import posixpath
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem


def is_local(url: str | os.PathLike) -> bool:
    """True for plain paths and ``file://`` URLs."""
    s = os.fspath(url)
    return "://" not in s or s.startswith("file://")


def local_path(url: str | os.PathLike) -> Path:
    """The filesystem path of a local URL (``file://`` stripped)."""
    s = os.fspath(url)
    return Path(s[len("file://"):] if s.startswith("file://") else s)


def filesystem(url: str | os.PathLike) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem for ``url`` and the path inside it.

    A missing filesystem package gets an error that names what to install.
    """
    s = os.fspath(url)
    if is_local(s):
        return LocalFileSystem(), str(local_path(s).absolute())
    try:
        fs, path = fsspec.core.url_to_fs(s)
    except (ImportError, ValueError) as e:
        scheme = s.split("://", 1)[0]
        raise ImportError(
            f"no filesystem for {scheme}:// URLs ({e}); install its fsspec package "
            f"(s3fs for s3://, gcsfs for gs://, adlfs for az://)") from e
    if not any(f is fs for f in _KEEP):
        _KEEP.append(fs)
    return fs, path


# Async filesystems (s3fs) close their session from a finalizer that waits on their event-loop
# thread. After a fork the child has no such thread, and fsspec drops its instance cache there,
# so the child would run that finalizer and hang forever (our shard pool and .beton writer, torch
# DataLoader workers). Holding every remote filesystem here keeps them alive in children.
_KEEP: list[fsspec.AbstractFileSystem] = []


def join(url: str | os.PathLike, *parts: str) -> str:
    """Join path parts onto a local path or URL without mangling the scheme."""
    s = os.fspath(url)
    if is_local(s):
        return str(local_path(s).joinpath(*parts))
    return posixpath.join(s, *parts)


def exists(url: str | os.PathLike) -> bool:
    fs, path = filesystem(url)
    return fs.exists(path)


def read_bytes(url: str | os.PathLike) -> bytes:
    fs, path = filesystem(url)
    with fs.open(path, "rb") as f:
        return f.read()


def parent_url(url: str | os.PathLike) -> str:
    """The directory holding ``url`` (a local path's parent, or a URL's), scheme kept."""
    s = os.fspath(url).rstrip("/")
    if is_local(s):
        return str(local_path(s).absolute().parent)
    return posixpath.dirname(s)


def version_file(root: str | os.PathLike, rel: str, version: str | None = None) -> str:
    """Where a file of the artifact at ``root`` lies: ``rel`` under ``root`` itself, or, for a
    file reused from another version (``version``), under that sibling directory."""
    if version is not None and (not version or "/" in version or version in (".", "..")):
        raise ValueError(f"bad version directory name {version!r}")  # never a path out of the root
    base = join(parent_url(root), version) if version else os.fspath(root)
    return join(base, *rel.split("/"))
