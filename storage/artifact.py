"""Open a dataset artifact, verify it against its manifest, and read its aligned arrays."""
from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np

from sluice.storage.fingerprint import sha256_file
from sluice.storage.manifest import MANIFEST_NAME, ArtifactError, FileRecord, Manifest, read_manifest
from sluice.storage.paths import filesystem, is_local, join, local_path, read_bytes

LATEST = "LATEST"


class DatasetArtifact:
    """A complete, immutable dataset artifact (a directory with a manifest)."""

    def __init__(self, root: str | os.PathLike):
        self.root = os.fspath(root)
        self.manifest: Manifest = read_manifest(self.root)

    def __repr__(self) -> str:
        return f"DatasetArtifact({self.root!r}, fingerprint={self.manifest.fingerprint[:16]})"

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint

    def path(self, record: FileRecord | str) -> str:
        rel = record.path if isinstance(record, FileRecord) else record
        return join(self.root, *rel.split("/"))

    def local(self, record: FileRecord | str) -> Path:
        """Local filesystem path of a file (loaders that mmap need one)."""
        p = self.path(record)
        if not is_local(p):
            raise ArtifactError(f"{p} is not on a local filesystem; copy the artifact locally "
                                "(e.g. `fsspec` get) before loading it with this backend")
        return local_path(p)

    def labels(self, split: str) -> np.ndarray:
        rec = self.manifest.split(split).labels
        return np.load(io.BytesIO(read_bytes(self.path(rec))), allow_pickle=False)

    def keys(self, split: str) -> list[str]:
        rec = self.manifest.split(split).keys
        text = read_bytes(self.path(rec)).decode()
        return text.splitlines()

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


def open_artifact(path: str | os.PathLike) -> DatasetArtifact:
    """Open an artifact by its directory, or a dataset root (follows its LATEST pointer)."""
    s = os.fspath(path)
    fs, p = filesystem(s)
    if not fs.exists(join(p, MANIFEST_NAME)) and fs.exists(join(p, LATEST)):
        version = read_bytes(join(s, LATEST)).decode().strip()
        s = join(s, version)
    return DatasetArtifact(s)
