"""Random access to samples inside the WebDataset shards, by split index.

The DALI index files written beside each shard give every member's byte offset and size, so a
sample's image bytes are one ``pread`` away: this is how the DALI and WebDataset backends follow
any sampler's order exactly instead of streaming tars front to back.
"""
from __future__ import annotations

import io
import os
import time
import zlib
from collections import OrderedDict

import numpy as np

from sluice.errors import ArtifactError, CorruptSample
from sluice.stages.load.integrity import Damage, mismatch
from sluice.stages.load.timings import Timings
from sluice.storage.artifact import DatasetArtifact
from sluice.storage.manifest import FileRecord

MAX_OPEN = 16  # shard files kept open per process


class SampleIndex:
    """Offsets of each sample's image member; ``read(i)`` returns its bytes, ``pixels(i)`` the
    decoded uint8 HWC array. Safe to pickle into worker processes (files reopen lazily).

    Storage reads and decodes are timed into ``timings`` ("read", "decode"). Shard files are
    located on first use (``artifact.local``): for an artifact on object storage that fetches
    the shard into the verified local cache, so nothing unverified is ever read.

    With ``sums`` (the ``tar`` column of ``storage/sums.py``), ``read`` checks every sample's bytes
    and raises ``CorruptSample`` (``.reason`` says what) for damaged ones, before any decode."""

    def __init__(self, artifact: DatasetArtifact, split: str, timings: Timings | None = None,
                 sums: np.ndarray | None = None):
        self.sums = sums
        self.timings = timings if timings is not None else Timings()
        self._locate = artifact.locator()
        m = artifact.manifest
        rec = m.split(split)
        self.encoding = m.fields.image.encoding
        self.shape = m.fields.image.shape
        self.nbytes = int(np.prod(self.shape)) if self.shape is not None else None  # decoded bytes per sample
        self.count = rec.count
        self.tars: list[FileRecord] = []
        self.shard_of = np.empty(rec.count, np.int32)
        self.offset = np.empty(rec.count, np.int64)
        self.size = np.empty(rec.count, np.int64)
        ext = self.encoding
        for s, sh in enumerate(rec.shards):
            if sh.dali_index is None:
                raise ArtifactError(f"split {split!r} has no DALI index files (formats={m.formats}); "
                                    "re-shard with the dali format for indexed access")
            self.tars.append(sh.tar)
            lines = self._locate(sh.dali_index).read_text().split("\n")
            header = lines[0].split()
            if len(header) != 2 or header[0] != "v1.2" or int(header[1]) != sh.count:
                raise ArtifactError(f"{sh.dali_index.path}: bad index header {lines[0]!r} (expected 'v1.2 {sh.count}')")
            for k, line in enumerate(lines[1:1 + sh.count]):
                parts = line.split()
                for j in range(0, len(parts), 4):
                    if parts[j] == ext:
                        n = sh.first_index + k
                        try:
                            self.shard_of[n], self.offset[n], self.size[n] = s, int(parts[j + 1]), int(parts[j + 2])
                        except (ValueError, IndexError):
                            raise ArtifactError(f"{sh.dali_index.path}: line {k + 2} is damaged ({line[:80]!r}); "
                                                "re-shard the artifact") from None
                        break
                else:
                    raise ArtifactError(f"{sh.dali_index.path}: sample {k} has no .{ext} member")
        self._fds: OrderedDict[int, int] = OrderedDict()

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_fds"] = OrderedDict()
        return state

    def path(self, s: int) -> str:
        """Local path of shard ``s`` (fetched into the cache first for a remote artifact)."""
        return str(self._locate(self.tars[s]))

    def _fd(self, s: int) -> int:
        fd = self._fds.get(s)
        if fd is None:
            t = time.perf_counter()
            path = self.path(s)
            self.timings.add("read", time.perf_counter() - t)  # a cache fetch is a storage read
            fd = self._fds[s] = os.open(path, os.O_RDONLY)
            while len(self._fds) > MAX_OPEN:  # an evicted cache file is freed once it is closed
                os.close(self._fds.popitem(last=False)[1])
        else:
            self._fds.move_to_end(s)
        return fd

    def read(self, i: int) -> bytes:
        """Sample ``i``'s stored bytes, checked against its checksum (``CorruptSample`` if not)."""
        (data,), damage = self.read_batch([i])
        if damage:
            raise self.damaged(i, damage[0].reason)
        return data

    def read_batch(self, idx) -> tuple[list[bytes | None], list[Damage]]:
        """``read`` for a whole batch: each sample's bytes (None for a damaged one) and the damage
        found, in order. Reads go shard by shard (each file descriptor is used while it is open:
        at most ``MAX_OPEN`` stay open), one ``pread`` and one CRC a sample; the checksums are
        compared in one vectorised step and the read time is added once."""
        idx = np.asarray(idx, np.int64).reshape(-1)
        shards, offs, sizes = self.shard_of[idx], self.offset[idx], self.size[idx]
        datas: list[bytes | None] = [None] * len(idx)
        pread, spent = os.pread, 0.0
        by_shard = np.argsort(shards, kind="stable")
        for group in np.split(by_shard, np.flatnonzero(np.diff(shards[by_shard])) + 1) if len(idx) else []:
            s = int(shards[group[0]])
            fd = self._fd(s)  # opened (or fetched, timed by itself) before the clock starts
            t = time.perf_counter()
            for k in group.tolist():
                datas[k] = pread(fd, int(sizes[k]), int(offs[k]))
            spent += time.perf_counter() - t
            for k in group.tolist():
                if len(datas[k]) != sizes[k]:
                    o, n = int(offs[k]), int(sizes[k])
                    raise ArtifactError(f"{self.tars[s].path} is truncated: sample {int(idx[k])} needs bytes "
                                        f"{o}..{o + n}")
        self.timings.add("read", spent)
        damage: list[Damage] = []
        if self.sums is not None and len(idx):
            got = np.fromiter(map(zlib.crc32, datas), np.uint32, len(datas))
            want = self.sums[idx]
            for k in np.flatnonzero(got != want).tolist():
                damage.append(mismatch(idx[k], self.tars[int(shards[k])].path, got[k], want[k]))
                datas[k] = None
        return datas, damage

    def damaged(self, i: int, reason: str) -> CorruptSample:
        e = CorruptSample(f"{self.tars[int(self.shard_of[i])].path}: the sample at split index {i} is damaged: "
                          f"{reason}", file=self.tars[int(self.shard_of[i])].path, index=i)
        e.reason = reason
        return e

    def pixels(self, i: int) -> np.ndarray:
        """Decoded uint8 HWC pixels (npy without unpickling; png/jpg through PIL). Bytes that no
        longer decode (an artifact without checksums) are a ``CorruptSample``, not a parser's error."""
        data = self.read(i)
        try:
            return self.decode(data)
        except Exception as e:  # noqa: BLE001 - any parser's failure on stored bytes is damage
            raise self.damaged(i, f"cannot decode its {self.encoding} bytes ({type(e).__name__}: {e})") from None

    def decode(self, data: bytes) -> np.ndarray:
        t = time.perf_counter()
        try:
            return self.decode_untimed(data)
        finally:
            self.timings.add("decode", time.perf_counter() - t)

    def decode_untimed(self, data: bytes) -> np.ndarray:
        """``decode`` without adding to ``timings`` (a caller timing a whole batch)."""
        if self.encoding == "npy":  # fixed shape: the pixels are the member's last bytes, no header parsed
            return np.frombuffer(data, np.uint8, offset=len(data) - self.nbytes).reshape(self.shape)
        from PIL import Image
        with Image.open(io.BytesIO(data)) as im:
            arr = np.asarray(im)
        return arr[:, :, None] if arr.ndim == 2 else arr

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
