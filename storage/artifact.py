"""Open a dataset artifact, verify it against its manifest, and read its aligned arrays.

An artifact on object storage (``s3://...``) is read through an ``ArtifactCache``: every file a
reader touches is a local, sha256-verified copy (``storage/cache.py``)."""
from __future__ import annotations

import io
import os
import warnings
from pathlib import Path
from typing import Callable

import numpy as np

from sluice.storage.cache import ArtifactCache
from sluice.storage.fingerprint import sha256_file
from sluice.storage.locking import SharedLease
from sluice.storage.manifest import MANIFEST_NAME, ArtifactError, FileRecord, Manifest, read_manifest
from sluice.storage.paths import filesystem, is_local, join, local_path, read_bytes, version_file
from sluice.storage.sums import SUMS_DTYPE

LATEST = "LATEST"
READERS = ".readers"  # <dataset root>/.readers/<version>.lock: the readers' leases (storage/gc.py)


def reader_lock_file(version_dir: str | os.PathLike) -> Path:
    """The lock a reader of the local version at ``version_dir`` holds shared while it reads, and
    that ``sluice gc`` must take exclusively to remove the version."""
    p = local_path(version_dir).resolve()
    return p.parent / READERS / f"{p.name}.lock"


class DatasetArtifact:
    """A complete, immutable dataset artifact (a directory with a manifest). A remote one gets
    ``cache`` (default: an unlimited ``ArtifactCache`` under ``default_cache_dir()``).

    A local one holds a reader's lease (a shared lock on ``reader_lock_file(root)``) from when it
    is opened until ``close()``, the end of its ``with`` block, or its garbage collection:
    ``sluice gc`` never removes a version a reader holds. Where the lock cannot be made (a
    read-only filesystem) it is read without one."""

    def __init__(self, root: str | os.PathLike, cache: ArtifactCache | None = None):
        self.root = os.fspath(root)
        self._lease: SharedLease | None = None
        self.manifest: Manifest = read_manifest(self.root)
        self.cache: ArtifactCache | None = None
        if not is_local(self.root):
            self.cache = cache or ArtifactCache(self.root, self.manifest.fingerprint)
        else:
            self._take_lease()
            # gc removes the manifest first, holding the lease's lock: read before it, so check
            if not os.path.exists(join(self.root, MANIFEST_NAME)):
                self.close()
                read_manifest(self.root)  # raises: no dataset artifact (collected meanwhile)

    def _take_lease(self) -> None:
        self._lease = SharedLease.acquire(reader_lock_file(self.root))

    def close(self) -> None:
        """Give up the reader's lease (the files stay readable; ``sluice gc`` may now remove
        this version unless another reader holds it). Idempotent."""
        if self._lease is not None:
            self._lease.close()
            self._lease = None

    def __enter__(self) -> "DatasetArtifact":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_lease": None}  # a descriptor means nothing in another process

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.cache is None and is_local(self.root):
            self._take_lease()  # the copy (a spawned worker's) holds its own lease

    def __repr__(self) -> str:
        return f"DatasetArtifact({self.root!r}, fingerprint={self.manifest.fingerprint[:16]})"

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint

    def path(self, record: FileRecord | str) -> str:
        """The file's URL or path: this version's directory, or the ancestor's that holds it."""
        if isinstance(record, FileRecord):
            return version_file(self.root, record.path, record.version)
        return join(self.root, *record.split("/"))

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

    def content(self, split: str) -> np.ndarray | None:
        """The split's content sums (a CRC-32 of each sample's pixels, by split index); None for
        a split written before them."""
        rec = self.manifest.split(split)
        return self._per_sample(split, rec.content, "content sums", (rec.count,))

    def sizes(self, split: str) -> np.ndarray | None:
        """The split's stored (height, width) per sample, (count, 2) uint32 by split index; None
        for a split written before them."""
        rec = self.manifest.split(split)
        return self._per_sample(split, rec.sizes, "sizes", (rec.count, 2))

    def _per_sample(self, split: str, file: FileRecord | None, what: str, shape: tuple[int, ...]) -> np.ndarray | None:
        """A split's per-sample ``.npy`` (``what``, of ``shape``) as uint32; None where not written."""
        if file is None:
            return None
        try:
            out = np.load(io.BytesIO(self.local(file).read_bytes()), allow_pickle=False)
        except (ValueError, OSError) as e:
            raise ArtifactError(f"{self.root}: split {split!r} {what} are unreadable: {e}") from None
        if out.shape != shape:
            raise ArtifactError(f"{self.root}: split {split!r} has {what} of shape {out.shape} for {shape[0]} samples")
        return out.astype(np.uint32)

    def live(self, split: str) -> np.ndarray:
        """The split indices a reader may yield, sorted: all but those removed in this version
        or an ancestor (deleted from the source, or their content changed)."""
        s = self.manifest.split(split)
        if not s.removed:
            return np.arange(s.count, dtype=np.int64)
        mask = np.ones(s.count, bool)
        mask[np.asarray(s.removed, np.int64)] = False
        return np.flatnonzero(mask).astype(np.int64)

    def stored_labels(self, split: str, labels: np.ndarray | None = None) -> np.ndarray:
        """The labels the split's sample files carry (labels.npy but for relabels since);
        ``labels``: the split's labels.npy when the caller has read it already."""
        relabelled = self.manifest.split(split).relabelled
        base = self.labels(split) if labels is None else labels
        if not relabelled:
            return base
        out = base.copy()
        for r in relabelled:
            out[r.index] = r.stored
        return out

    def keys(self, split: str) -> list[str]:
        rec = self.manifest.split(split).keys
        return self.local(rec).read_bytes().decode().splitlines()

    def sums(self, split: str) -> np.ndarray | None:
        """The split's per-sample checksums (``storage/sums.py``), verified against the manifest's
        sha256; None for an artifact written before them (warned once per artifact)."""
        rec = self.manifest.split(split).sums
        if rec is None:
            if self.root not in _WARNED:
                _WARNED.add(self.root)
                warnings.warn(f"{self.root} has no per-sample checksums (written before them): damaged "
                              "samples cannot be caught on read; re-shard it, or check it with "
                              f"`sluice verify {self.root} --full`", stacklevel=2)
            return None
        path = self.local(rec)
        verify_file(str(path), rec, deep=True)  # small (8 bytes a sample); it vouches for the rest
        try:
            out = np.load(io.BytesIO(path.read_bytes()), allow_pickle=False)
        except (ValueError, OSError) as e:
            raise ArtifactError(f"{path} is not a valid .npy file: {e}") from None
        if out.dtype != SUMS_DTYPE or out.shape != (self.manifest.split(split).count,):
            raise ArtifactError(f"{path} holds {out.dtype} {out.shape}, not one checksum record per sample")
        return out

    def verify(self, splits: list[str] | None = None, deep: bool = True) -> None:
        """Raise ArtifactError naming the first file that is missing or differs, or whose sample
        count disagrees with the manifest's.

        ``deep`` re-hashes every byte; otherwise existence and size are checked, the small files
        that say what each sample is (labels, keys, checksums, DALI indexes: ~100 bytes a sample)
        are re-hashed, and the counts read from the files' headers. The samples' own bytes are
        checked as they are read, against their checksums (``storage/sums.py``).
        """
        names = splits if splits is not None else list(self.manifest.splits)
        for name in names:
            s = self.manifest.split(name)
            small = [r for sh in s.shards for r in (sh.dali_index,) if r] + \
                    [r for r in s.per_sample_files() if r]
            for rec in [r for sh in s.shards for r in (sh.tar,)] + [p.file for p in s.ffcv_files()]:
                verify_file(self.path(rec), rec, deep=deep)
            for rec in small:
                verify_file(self.path(rec), rec, deep=True)
            self._check_counts(name)

    def _check_counts(self, name: str) -> None:
        """The split's sample count against what its files hold: shards that tile 0..count-1,
        each DALI index header, the .beton header, labels.npy's shape and keys.txt's lines. A
        hand-edited manifest fails here, before the first batch, not with garbage later."""
        s = self.manifest.split(name)

        def mismatch(what: str, holds: int, expected: int | None = None) -> ArtifactError:
            return ArtifactError(f"{self.root}: split {name!r} has {expected if expected is not None else s.count} "
                                 f"samples by its manifest, but {what} holds {holds} (the manifest was edited "
                                 "or belongs to other files); re-shard, or restore the original manifest")
        first = 0
        for sh in s.shards:
            if sh.first_index != first:
                raise mismatch(f"the shard list (shard {sh.tar.path} starts at index {sh.first_index})", first)
            first += sh.count
            if sh.dali_index is not None:
                head = _head(self.path(sh.dali_index), 64).split(b"\n", 1)[0].split()
                n = int(head[1]) if len(head) == 2 and head[1].isdigit() else -1
                if n != sh.count:
                    raise mismatch(f"the index {sh.dali_index.path}", n, sh.count)
        if s.shards and first != s.count:
            raise mismatch(f"its {len(s.shards)} tar shards together", first)
        for part in s.ffcv_files():
            n = int.from_bytes(_head(self.path(part.file), 16)[8:16], "little")  # FFCV header: num_samples
            if n != part.count or part.count < 0:
                raise mismatch(f"the FFCV file {part.file.path}", n, part.count)
        if s.removed and (s.removed != sorted(set(s.removed)) or s.removed[0] < 0 or s.removed[-1] >= s.count):
            raise ArtifactError(f"{self.root}: split {name!r} lists removed indices that are repeated, unsorted "
                                f"or outside 0..{s.count - 1}; re-shard, or restore the original manifest")
        raw = _head(self.path(s.labels), 256)
        try:
            f = io.BytesIO(raw)
            major, _ = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            shape = read(f)[0]
        except (ValueError, OSError) as e:
            raise ArtifactError(f"{self.path(s.labels)} is not a valid .npy file: {e}") from None
        if shape != (s.count,):
            raise mismatch(f"{s.labels.path} (shape {shape})", shape[0] if shape else 0)
        n = read_bytes(self.path(s.keys)).count(b"\n")
        if n != s.count:
            raise mismatch(f"{s.keys.path}", n)


_WARNED: set[str] = set()  # artifacts already warned about (once per process)


class _LocalFiles:
    def __init__(self, root: str):
        self.root = root

    def __call__(self, rec: FileRecord) -> Path:
        return local_path(version_file(self.root, rec.path, rec.version))


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


def _head(path: str, n: int) -> bytes:
    fs, p = filesystem(path)
    with fs.open(p, "rb") as f:
        return f.read(n)


def open_artifact(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                  cache_max_bytes: int | None = None, retries: int = 3, ahead: int = 2) -> DatasetArtifact:
    """Open an artifact by its directory, or a dataset root (follows its LATEST pointer).

    A remote artifact is read through a local cache (``cache_dir``, default
    ``default_cache_dir()``) of at most ``cache_max_bytes``; see ``ArtifactCache``."""
    s = os.fspath(path)
    fs, p = filesystem(s)
    if not fs.exists(join(p, MANIFEST_NAME)) and fs.exists(join(p, LATEST)):
        version = read_bytes(join(s, LATEST)).decode().strip()
        if is_local(s):
            try:
                return DatasetArtifact(join(s, version))
            except ArtifactError:  # collected between reading LATEST and the lease: LATEST moved on
                again = read_bytes(join(s, LATEST)).decode().strip()
                if again == version:
                    raise
                version = again
        s = join(s, version)
    if is_local(s):
        return DatasetArtifact(s)
    fingerprint = read_manifest(s).fingerprint
    return DatasetArtifact(s, ArtifactCache(s, fingerprint, cache_dir, cache_max_bytes, retries, ahead))
