"""Random access to samples inside the WebDataset shards, by split index.

The DALI index files written beside each shard give every member's byte offset and size, so a
sample's image bytes are one ``pread`` away: this is how the DALI and WebDataset backends follow
any sampler's order exactly instead of streaming tars front to back.
"""
from __future__ import annotations

import io
import os

import numpy as np

from sluice.storage.artifact import DatasetArtifact
from sluice.errors import ArtifactError


class SampleIndex:
    """Offsets of each sample's image member; ``read(i)`` returns its bytes, ``pixels(i)`` the
    decoded uint8 HWC array. Safe to pickle into worker processes (files reopen lazily)."""

    def __init__(self, artifact: DatasetArtifact, split: str):
        m = artifact.manifest
        rec = m.split(split)
        self.encoding = m.fields.image.encoding
        self.shape = m.fields.image.shape
        self.count = rec.count
        self.paths: list[str] = []
        self.shard_of = np.empty(rec.count, np.int32)
        self.offset = np.empty(rec.count, np.int64)
        self.size = np.empty(rec.count, np.int64)
        ext = self.encoding
        for s, sh in enumerate(rec.shards):
            if sh.dali_index is None:
                raise ArtifactError(f"split {split!r} has no DALI index files (formats={m.formats}); "
                                    "re-shard with the dali format for indexed access")
            self.paths.append(str(artifact.local(sh.tar)))
            lines = artifact.local(sh.dali_index).read_text().split("\n")
            header = lines[0].split()
            if len(header) != 2 or header[0] != "v1.2" or int(header[1]) != sh.count:
                raise ArtifactError(f"{sh.dali_index.path}: bad index header {lines[0]!r} (expected 'v1.2 {sh.count}')")
            for k, line in enumerate(lines[1:1 + sh.count]):
                parts = line.split()
                for j in range(0, len(parts), 4):
                    if parts[j] == ext:
                        n = sh.first_index + k
                        self.shard_of[n], self.offset[n], self.size[n] = s, int(parts[j + 1]), int(parts[j + 2])
                        break
                else:
                    raise ArtifactError(f"{sh.dali_index.path}: sample {k} has no .{ext} member")
        self._fds: dict[int, int] = {}
        self._npy_header: int | None = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_fds"] = {}
        return state

    def _fd(self, s: int) -> int:
        fd = self._fds.get(s)
        if fd is None:
            fd = self._fds[s] = os.open(self.paths[s], os.O_RDONLY)
        return fd

    def read(self, i: int) -> bytes:
        s, off, size = int(self.shard_of[i]), int(self.offset[i]), int(self.size[i])
        data = os.pread(self._fd(s), size, off)
        if len(data) != size:
            raise ArtifactError(f"{self.paths[s]} is truncated: sample {i} needs bytes {off}..{off + size}")
        return data

    def pixels(self, i: int) -> np.ndarray:
        """Decoded uint8 HWC pixels (npy without unpickling; png/jpg through PIL)."""
        data = self.read(i)
        if self.encoding == "npy":
            if self._npy_header is None:
                arr = np.load(io.BytesIO(data), allow_pickle=False)
                self._npy_header = len(data) - arr.nbytes
                return arr
            return np.frombuffer(data, np.uint8, offset=self._npy_header).reshape(self.shape)
        from PIL import Image
        with Image.open(io.BytesIO(data)) as im:
            arr = np.asarray(im)
        return arr[:, :, None] if arr.ndim == 2 else arr

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
