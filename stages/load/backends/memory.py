"""``memory``: the whole split decoded once into a uint8 array; a batch is one fancy index."""
from __future__ import annotations

import time
from typing import Iterator

import numpy as np

from sluice.errors import LoaderError
from sluice.stages.load.backends.base import (LOADER_BACKENDS, Backend, RawBatch, Timings, batch_slices,
                                              decoded_sample_bytes)
from sluice.stages.load.budget import memory_budget
from sluice.stages.load.decode import pixels
from sluice.stages.load.sample_index import SampleIndex
from sluice.storage.artifact import DatasetArtifact


@LOADER_BACKENDS.register("memory")
class MemoryBackend(Backend):
    """Decode the split once into RAM; then every batch is a numpy gather (~µs per sample)."""
    name = "memory"
    holds = "the decoded split"

    @classmethod
    def open(cls, artifact, split, config, device, workers) -> "MemoryBackend":
        return cls(artifact, split, workers, config.memory_budget_bytes)

    @classmethod
    def working_bytes(cls, artifact, split, config) -> int | None:
        """The whole split, decoded."""
        sample = decoded_sample_bytes(artifact)
        return None if sample is None else artifact.manifest.split(split).count * sample

    def __init__(self, artifact: DatasetArtifact, split: str, workers: int, max_bytes: int | None = None):
        self.labels = artifact.labels(split)
        shape = artifact.manifest.fields.image.shape
        n = len(self.labels)
        if shape is None:
            raise LoaderError("the memory backend needs a fixed image shape; this split has variable sizes "
                              "(use ffcv, dali or webdataset, or re-shard with shard.image_size)")
        need = n * decoded_sample_bytes(artifact)
        budget = max_bytes if max_bytes is not None else memory_budget().bytes
        if need > budget:
            why = "loader.memory_budget_bytes" if max_bytes is not None else memory_budget().explain()
            raise LoaderError(f"split {split!r} needs {need / 1e9:.2f} GB decoded, more than the "
                              f"{budget / 1e9:.2f} GB the loader may use ({why}); use the ffcv, "
                              "webdataset or dali backend, which stream from storage")
        self.timings = Timings()
        self.images = decode_split(artifact, split, shape, workers, self.timings)

    def epoch(self, order: np.ndarray, batch_size: int, drop_last: bool, start_batch: int = 0, *,
              resolution: int | None = None, epoch: int = 0) -> Iterator[RawBatch]:
        for lo, hi in batch_slices(len(order), batch_size, drop_last, start_batch):
            t = time.perf_counter()
            idx = order[lo:hi]
            out = (self.images[idx], self.labels[idx], idx)
            self.timings.add("gather", time.perf_counter() - t)
            yield out


def decode_split(artifact: DatasetArtifact, split: str, shape, workers: int,
                 timings: Timings | None = None) -> np.ndarray:
    """The whole split as one uint8 array (storage reads and decode timed into ``timings``)."""
    timings = timings if timings is not None else Timings()
    si = SampleIndex(artifact, split, timings)
    out = np.empty((si.count, *shape), np.uint8)
    if si.encoding == "npy":
        # One read per shard, then a strided view: no per-sample decode at all.
        rec = artifact.manifest.split(split)
        for s, sh in enumerate(rec.shards):
            t = time.perf_counter()
            buf = np.fromfile(si.path(s), dtype=np.uint8)
            timings.add("read", time.perf_counter() - t)
            first = sh.first_index
            si.pixels(first)  # learns the header length
            for k in range(sh.count):
                off = int(si.offset[first + k]) + si._npy_header
                out[first + k] = buf[off: off + out[0].nbytes].reshape(shape)
        return out
    from concurrent.futures import ThreadPoolExecutor  # PIL releases the GIL while decoding
    def fill(lo_hi):
        for i in range(*lo_hi):
            out[i] = pixels(si, i)  # times its read ("read") and its decode ("decode")
    step = max(1, si.count // (4 * max(workers, 1)) + 1)
    with ThreadPoolExecutor(max(workers, 1)) as ex:
        list(ex.map(fill, [(lo, min(lo + step, si.count)) for lo in range(0, si.count, step)]))
    return out
