"""``memory``: the whole split decoded once into a uint8 array; a batch is one fancy index."""
from __future__ import annotations

import os
import time
from typing import Iterator

import numpy as np

from sluice.errors import LoaderError
from sluice.stages.load.backends.base import LOADER_BACKENDS, Backend, RawBatch, Timings, batch_slices
from sluice.stages.load.decode import pixels
from sluice.stages.load.sample_index import SampleIndex
from sluice.storage.artifact import DatasetArtifact


@LOADER_BACKENDS.register("memory")
class MemoryBackend(Backend):
    """Decode the split once into RAM; then every batch is a numpy gather (~µs per sample)."""
    name = "memory"

    @classmethod
    def open(cls, artifact, split, config, device, workers) -> "MemoryBackend":
        return cls(artifact, split, workers, config.memory_budget_bytes)

    def __init__(self, artifact: DatasetArtifact, split: str, workers: int, max_bytes: int | None = None):
        self.labels = artifact.labels(split)
        shape = artifact.manifest.fields.image.shape
        n = len(self.labels)
        if shape is None:
            raise LoaderError("the memory backend needs a fixed image shape; this split has variable sizes "
                              "(use ffcv, dali or webdataset, or re-shard with shard.image_size)")
        need = n * int(np.prod(shape))
        budget = max_bytes if max_bytes is not None else available_memory() // 2
        if need > budget:
            raise LoaderError(f"split {split!r} needs {need / 1e9:.1f} GB decoded, more than the "
                              f"{budget / 1e9:.1f} GB budget; use the ffcv or dali backend")
        self.timings = Timings()
        t = time.perf_counter()
        self.images = decode_split(artifact, split, shape, workers)
        self.timings.add("decode", time.perf_counter() - t)

    def epoch(self, order: np.ndarray, batch_size: int, drop_last: bool, start_batch: int = 0, *,
              resolution: int | None = None, epoch: int = 0) -> Iterator[RawBatch]:
        for lo, hi in batch_slices(len(order), batch_size, drop_last, start_batch):
            t = time.perf_counter()
            idx = order[lo:hi]
            out = (self.images[idx], self.labels[idx], idx)
            self.timings.add("read", time.perf_counter() - t)
            yield out


def available_memory() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 << 30


def decode_split(artifact: DatasetArtifact, split: str, shape, workers: int) -> np.ndarray:
    si = SampleIndex(artifact, split)
    out = np.empty((si.count, *shape), np.uint8)
    if si.encoding == "npy":
        # One read per shard, then a strided view: no per-sample decode at all.
        rec = artifact.manifest.split(split)
        for s, sh in enumerate(rec.shards):
            buf = np.fromfile(si.paths[s], dtype=np.uint8)
            first = sh.first_index
            si.pixels(first)  # learns the header length
            for k in range(sh.count):
                off = int(si.offset[first + k]) + si._npy_header
                out[first + k] = buf[off: off + out[0].nbytes].reshape(shape)
        return out
    from concurrent.futures import ThreadPoolExecutor  # PIL releases the GIL while decoding
    def fill(lo_hi):
        for i in range(*lo_hi):
            out[i] = pixels(si, i)
    step = max(1, si.count // (4 * max(workers, 1)) + 1)
    with ThreadPoolExecutor(max(workers, 1)) as ex:
        list(ex.map(fill, [(lo, min(lo + step, si.count)) for lo in range(0, si.count, step)]))
    return out
