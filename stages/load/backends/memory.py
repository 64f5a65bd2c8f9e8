"""``memory``: the whole split decoded once into a uint8 array; a batch is one fancy index.

The decoded split is a ``HeldSplit`` (``stages/load/backends/held_split.py``): on a CUDA device it stays on
the GPU where it fits the device's budget, else in (pinned) host RAM."""
from __future__ import annotations

import time
import zlib
from typing import Iterator

import numpy as np
import torch

from sluice.errors import CorruptSample, LoaderError
from sluice.stages.load.backends.base import (LOADER_BACKENDS, Backend, RawBatch, Timings, batch_slices,
                                              decoded_sample_bytes)
from sluice.stages.load.budget import memory_budget
from sluice.stages.load.decode import pixels
from sluice.stages.load.backends.held_split import HeldSplit
from sluice.stages.load.integrity import Damage, Guard, mismatch
from sluice.stages.load.sample_index import SampleIndex
from sluice.storage.artifact import DatasetArtifact


@LOADER_BACKENDS.register("memory")
class MemoryBackend(Backend):
    """Decode the split once into RAM (or GPU memory); then every batch is one gather (~µs per
    sample)."""
    name = "memory"
    holds = "the decoded split"

    @classmethod
    def open(cls, artifact, split, config, device, workers) -> "MemoryBackend":
        return cls(artifact, split, workers, config.memory_budget_bytes, Guard.for_config(artifact, split, config),
                   device=device, device_budget_bytes=config.device_memory_budget_bytes)

    @classmethod
    def working_bytes(cls, artifact, split, config) -> int | None:
        """The whole split, decoded."""
        sample = decoded_sample_bytes(artifact)
        return None if sample is None else artifact.manifest.split(split).count * sample

    def __init__(self, artifact: DatasetArtifact, split: str, workers: int, max_bytes: int | None = None,
                 guard: Guard | None = None, *, device: str | torch.device = "cpu",
                 device_budget_bytes: int | None = None):
        self.guard = guard if guard is not None else Guard(artifact, split)
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
        damage: list[Damage] = []
        images = decode_split(artifact, split, shape, workers, self.timings, self.guard.column("tar"), damage)
        damage.sort(key=lambda d: d.index)
        self.guard.found(damage)  # fail: before the first batch; skip: counted against the threshold
        self.damaged = np.zeros(n, bool)
        self.damaged[[d.index for d in damage]] = True
        self.held = HeldSplit(images, self.labels, device, max_bytes=max_bytes,
                              device_budget_bytes=device_budget_bytes, timings=self.timings)
        self.device, self.placement = self.held.device, self.held.placement

    def epoch(self, order: np.ndarray, batch_size: int, drop_last: bool, start_batch: int = 0, *,
              resolution: int | None = None, epoch: int = 0) -> Iterator[RawBatch]:
        any_damaged = bool(self.damaged.any())
        gather = self.held.gather(order)
        for lo, hi in batch_slices(len(order), batch_size, drop_last, start_batch):
            t = time.perf_counter()
            idx = order[lo:hi]
            whole = True
            if any_damaged:  # skip: drop the damaged samples this batch would hold
                bad = self.damaged[idx]
                if bad.any():
                    self.guard.dropped(int(bad.sum()))
                    idx = idx[~bad]
                    whole = False
            out = gather(idx, lo, hi, whole)
            self.timings.add("gather", time.perf_counter() - t)
            yield out

def decode_split(artifact: DatasetArtifact, split: str, shape, workers: int,
                 timings: Timings | None = None, sums: np.ndarray | None = None,
                 damage: list[Damage] | None = None) -> np.ndarray:
    """The whole split as one uint8 array (storage reads and decode timed into ``timings``).
    With ``sums`` (the ``tar`` checksums) every sample's stored bytes are checked; a damaged one
    is left zero and appended to ``damage`` (without ``damage``: raised)."""
    timings = timings if timings is not None else Timings()
    si = SampleIndex(artifact, split, timings, sums)
    out = np.empty((si.count, *shape), np.uint8)
    found: list[Damage] = damage if damage is not None else []
    if si.encoding == "npy":
        # One read per shard, then a strided view: no per-sample decode at all. The header's
        # length follows from the member's size (the pixels are its last prod(shape) bytes), so
        # a damaged header is caught by its checksum, never handed to a parser.
        rec = artifact.manifest.split(split)
        nbytes = out[0].nbytes
        for s, sh in enumerate(rec.shards):
            t = time.perf_counter()
            buf = np.fromfile(si.path(s), dtype=np.uint8)
            timings.add("read", time.perf_counter() - t)
            view = memoryview(buf)  # checksummed in place: no copy of the shard
            for i in range(sh.first_index, sh.first_index + sh.count):
                off, size = int(si.offset[i]), int(si.size[i])
                if off + size > len(buf) or size < nbytes:
                    found.append(Damage(i, sh.tar.path, f"its member ({size} bytes at {off}) is not in the file"))
                    out[i] = 0
                    continue
                if sums is not None:
                    got = zlib.crc32(view[off:off + size])
                    if got != sums[i]:
                        found.append(mismatch(i, sh.tar.path, got, sums[i]))
                        out[i] = 0
                        continue
                head = off + size - nbytes
                out[i] = buf[head: head + nbytes].reshape(shape)
        if found and damage is None:
            raise CorruptSample(f"{found[0].file}: split index {found[0].index} is damaged: {found[0].reason}",
                                file=found[0].file, index=found[0].index)
        return out
    from concurrent.futures import ThreadPoolExecutor  # PIL releases the GIL while decoding
    def fill(lo_hi):
        for i in range(*lo_hi):
            try:
                out[i] = pixels(si, i)  # times its read ("read") and its decode ("decode")
            except CorruptSample as e:
                if damage is None:
                    raise
                found.append(Damage(i, e.file, getattr(e, "reason", str(e))))
                out[i] = 0
    step = max(1, si.count // (4 * max(workers, 1)) + 1)
    with ThreadPoolExecutor(max(workers, 1)) as ex:
        list(ex.map(fill, [(lo, min(lo + step, si.count)) for lo in range(0, si.count, step)]))
    return out
