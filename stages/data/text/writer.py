"""Writing one split of a token artifact: the flat token file, its offsets, keys, per-document
checksums and content hashes, and the WebDataset tar shards, each file published atomically.

Documents arrive in split order (a parent's kept documents first, copied as token bytes, then the
new ones, tokenised). ``tokens.bin`` is streamed to a temp file and renamed at the end; the
small arrays follow. The tar shards hold ``<key>.tokens`` (the document's token bytes exactly as in
``tokens.bin``, so one checksum covers both) and ``<key>.idx`` (its int64 document index). No
``.txt`` member: the text is the tokens decoded by the artifact's own ``tokenizer.json``, and a
second copy would double the bytes on object storage without a checksum of its own.
"""
from __future__ import annotations

import contextlib
import hashlib
import zlib
from pathlib import Path

import numpy as np

from sluice.stages.data.formats.tar import TarShardWriter
from sluice.storage import atomic
from sluice.storage.fingerprint import sha256_file
from sluice.storage.manifest import FileRecord
from sluice.storage.tokens import TokenShardRecord, TokenSplitRecord


def file_record(work: Path, path: Path) -> FileRecord:
    return FileRecord(path=path.relative_to(work).as_posix(), bytes=path.stat().st_size, sha256=sha256_file(path))


def save_npy(path: Path, arr: np.ndarray) -> None:
    with atomic.atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, arr, allow_pickle=False)


class _Tar:
    """One tar shard being written: a temp file, renamed into place by ``close``."""

    def __init__(self, path: Path, first_doc: int):
        self.path, self.first_doc, self.count, self.tokens = path, first_doc, 0, 0
        self._ctx = atomic.atomic_path(path)
        self._f = open(self._ctx.__enter__(), "wb")
        self.writer = TarShardWriter(self._f)

    def add(self, key: str, index: int, data: bytes, ntok: int) -> None:
        self.writer.add_sample(key, [("tokens", data), ("idx", np.int64(index).tobytes())])
        self.count += 1
        self.tokens += ntok

    def close(self, work: Path) -> TokenShardRecord:
        self.writer.close()
        self._f.close()
        self._ctx.__exit__(None, None, None)
        rec = FileRecord(path=self.path.relative_to(work).as_posix(), bytes=self.writer.offset,
                         sha256=self.writer.sha.hexdigest())
        return TokenShardRecord(tar=rec, first_doc=self.first_doc, count=self.count)

    def abort(self) -> None:
        self._f.close()
        with contextlib.suppress(BaseException):
            self._ctx.__exit__(RuntimeError, RuntimeError("aborted"), None)


class SplitWriter:
    """Append documents to one split; ``finish`` writes the arrays and returns its record.

    ``reused_shards``: the parent's tar shards kept as they are (they hold documents
    ``0 .. reuse_docs - 1``, at the same indices); documents from ``reuse_docs`` on go into new
    shards, numbered after them."""

    def __init__(self, work: Path, split: str, dtype: np.dtype, shard_tokens: int,
                 reused_shards: list[TokenShardRecord] | None = None):
        self.work, self.split, self.dtype, self.shard_tokens = work, split, np.dtype(dtype), shard_tokens
        self.dir = work / split
        self.dir.mkdir(parents=True, exist_ok=True)
        self.shards = list(reused_shards or [])
        self.reuse_docs = sum(s.count for s in self.shards)
        self.keys: list[str] = []
        self.offsets = [0]
        self.sums: list[int] = []
        self.content: list[int] = []
        self._ctx = atomic.atomic_path(self.dir / "tokens.bin")
        self._f = open(self._ctx.__enter__(), "wb")
        self._sha = hashlib.sha256()
        self._tar: _Tar | None = None

    def add(self, key: str, digest: int, ids: np.ndarray) -> None:
        data = np.ascontiguousarray(ids, self.dtype.newbyteorder("<")).tobytes()
        i = len(self.keys)
        self._f.write(data)
        self._sha.update(data)
        self.keys.append(key)
        self.offsets.append(self.offsets[-1] + len(data) // self.dtype.itemsize)
        self.sums.append(zlib.crc32(data) & 0xFFFFFFFF)
        self.content.append(digest)
        if i < self.reuse_docs:
            return
        if self._tar is None:
            self._tar = _Tar(self.dir / f"shard-{len(self.shards):06d}.tar", i)
        self._tar.add(key, i, data, len(data) // self.dtype.itemsize)
        if self._tar.tokens >= self.shard_tokens:
            self.shards.append(self._tar.close(self.work))
            self._tar = None

    def abort(self) -> None:
        if self._tar is not None:
            self._tar.abort()
        self._f.close()
        with contextlib.suppress(BaseException):
            self._ctx.__exit__(RuntimeError, RuntimeError("aborted"), None)

    def finish(self, text_bytes: int | None = None) -> TokenSplitRecord:
        """The split's record; ``text_bytes``: the UTF-8 bytes of its documents' text."""
        if len(self.keys) < self.reuse_docs:
            raise RuntimeError(f"split {self.split}: {len(self.keys)} documents, fewer than the "
                               f"{self.reuse_docs} the reused shards hold")
        if self._tar is not None:
            self.shards.append(self._tar.close(self.work))
            self._tar = None
        size = self._f.tell()
        self._f.close()
        self._ctx.__exit__(None, None, None)
        tokens = FileRecord(path=f"{self.split}/tokens.bin", bytes=size, sha256=self._sha.hexdigest())
        d = self.dir
        save_npy(d / "offsets.npy", np.asarray(self.offsets, np.int64))
        save_npy(d / "sums.npy", np.asarray(self.sums, np.uint32))
        save_npy(d / "content.npy", np.asarray(self.content, np.uint64))
        atomic.write_bytes(d / "keys.txt", "".join(f"{k}\n" for k in self.keys).encode())
        return TokenSplitRecord(docs=len(self.keys), tokens=self.offsets[-1], tokens_file=tokens,
                                offsets=file_record(self.work, d / "offsets.npy"),
                                keys=file_record(self.work, d / "keys.txt"),
                                sums=file_record(self.work, d / "sums.npy"),
                                content=file_record(self.work, d / "content.npy"), shards=self.shards,
                                text_bytes=text_bytes)


__all__ = ["SplitWriter", "file_record", "save_npy"]
