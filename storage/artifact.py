"""Open a dataset artifact, verify it against its manifest, and read its aligned arrays.

An artifact on object storage (``s3://...``) is read through an ``ArtifactCache``: every file a
reader touches is a local, sha256-verified copy (``storage/cache.py``)."""
from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Callable

import numpy as np

from sluice.storage.cache import ArtifactCache
from sluice.storage.fingerprint import sha256_file
from sluice.storage.manifest import MANIFEST_NAME, ArtifactError, FileRecord, Manifest, read_manifest
from sluice.storage.paths import filesystem, is_local, join, local_path, read_bytes

LATEST = "LATEST"


class DatasetArtifact:
    """A complete, immutable dataset artifact (a directory with a manifest). A remote one gets
    ``cache`` (default: an unlimited ``ArtifactCache`` under ``default_cache_dir()``)."""

    def __init__(self, root: str | os.PathLike, cache: ArtifactCache | None = None):
        self.root = os.fspath(root)
        self.manifest: Manifest = read_manifest(self.root)
        self.cache: ArtifactCache | None = None
        if not is_local(self.root):
            self.cache = cache or ArtifactCache(self.root, self.manifest.fingerprint)

    def __repr__(self) -> str:
        return f"DatasetArtifact({self.root!r}, fingerprint={self.manifest.fingerprint[:16]})"

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint

    def path(self, record: FileRecord | str) -> str:
        rel = record.path if isinstance(record, FileRecord) else record
        return join(self.root, *rel.split("/"))

    def local(self, record: FileRecord | str) -> Path:
        """Local filesystem path of a file (loaders that pread or mmap need one); for a remote
        artifact, its verified copy in the cache (fetched now if need be)."""
        return self.locator()(self._record(record))

    def locator(self) -> "Callable[[FileRecord], Path]":
        """A picklable function from a file record to its local path (for worker processes)."""
        return self.cache if self.cache is not None else _LocalFiles(self.root)

    def _record(self, record: FileRecord | str) -> FileRecord:
        if isinstance(record, FileRecord):
            return record
        for f in self.manifest.files():
            if f.path == record:
                return f
        raise ArtifactError(f"{record} is not a file of the artifact at {self.root}")

    def labels(self, split: str) -> np.ndarray:
        rec = self.manifest.split(split).labels
        return np.load(io.BytesIO(self.local(rec).read_bytes()), allow_pickle=False)

    def keys(self, split: str) -> list[str]:
        rec = self.manifest.split(split).keys
        return self.local(rec).read_bytes().decode().splitlines()

    def verify(self, splits: list[str] | None = None, deep: bool = True) -> None:
        """Raise ArtifactError naming the first file that is missing or differs.

        ``deep`` re-hashes every byte; otherwise only existence and size are checked.
        """
        names = splits if splits is not None else list(self.manifest.splits)
        for name in names:
            s = self.manifest.split(name)
            recs = [r for sh in s.shards for r in (sh.tar, sh.dali_index) if r] + \
                   [r for r in (s.ffcv, s.labels, s.keys) if r]
            for rec in recs:
                verify_file(self.path(rec), rec, deep=deep)


class _LocalFiles:
    def __init__(self, root: str):
        self.root = root

    def __call__(self, rec: FileRecord) -> Path:
        return local_path(join(self.root, *rec.path.split("/")))


def verify_file(path: str, rec: FileRecord, deep: bool = True) -> None:
    fs, p = filesystem(path)
    if not fs.exists(p):
        raise ArtifactError(f"artifact file missing: {path}")
    size = fs.size(p)
    if size != rec.bytes:
        raise ArtifactError(f"artifact file {path} has {size} bytes, manifest says {rec.bytes} "
                            "(truncated or replaced)")
    if deep:
        if is_local(path):
            digest = sha256_file(local_path(path))
        else:
            import hashlib
            digest = hashlib.sha256(read_bytes(path)).hexdigest()
        if digest != rec.sha256:
            raise ArtifactError(f"checksum mismatch for {path}: sha256 {digest[:16]}…, "
                                f"manifest says {rec.sha256[:16]}… (corrupted)")


def open_artifact(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                  cache_max_bytes: int | None = None, retries: int = 3, ahead: int = 2) -> DatasetArtifact:
    """Open an artifact by its directory, or a dataset root (follows its LATEST pointer).

    A remote artifact is read through a local cache (``cache_dir``, default
    ``default_cache_dir()``) of at most ``cache_max_bytes``; see ``ArtifactCache``."""
    s = os.fspath(path)
    fs, p = filesystem(s)
    if not fs.exists(join(p, MANIFEST_NAME)) and fs.exists(join(p, LATEST)):
        version = read_bytes(join(s, LATEST)).decode().strip()
        s = join(s, version)
    if is_local(s):
        return DatasetArtifact(s)
    fingerprint = read_manifest(s).fingerprint
    return DatasetArtifact(s, ArtifactCache(s, fingerprint, cache_dir, cache_max_bytes, retries, ahead))
