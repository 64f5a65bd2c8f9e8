"""``ffcv``: FFCV's compiled reader over the split's ``.beton``, driven by our order; a readahead
thread reads the next batches' bytes (``stages/load/readahead.py``), so storage reads are timed
apart from FFCV's decode."""
from __future__ import annotations

import os
import time
from typing import Iterator

import numpy as np
import torch

from sluice.errors import LoaderError, require
from sluice.stages.load.backends.base import (LOADER_BACKENDS, Backend, RawBatch, Timings, batch_slices,
                                              decoded_sample_bytes)
from sluice.stages.load.readahead import Readahead
from sluice.storage.artifact import DatasetArtifact


@LOADER_BACKENDS.register("ffcv")
class FfcvBackend(Backend):
    """FFCV's reader and JIT-compiled decoders, fed our order directly (an EpochIterator per
    epoch), so no length is fixed from the first epoch and any order or resume point works."""
    name = "ffcv"
    holds = "its decode buffers and the batches in flight"
    batches_ahead = 2  # FFCV decodes this many batches ahead, into batches_ahead + 2 buffers

    @classmethod
    def open(cls, artifact, split, config, device, workers) -> "FfcvBackend":
        return cls(artifact, split, max(1, workers), config.batch_size)

    @classmethod
    def working_bytes(cls, artifact, split, config) -> int | None:
        """The loader's batches in flight plus FFCV's own decode buffers: ``batches_ahead + 2``
        whole batches at the stored resolution, allocated up front (with 256×256 RGB images and
        batch 256, 200 MB)."""
        base, sample = super().working_bytes(artifact, split, config), decoded_sample_bytes(artifact)
        return None if base is None or sample is None else base + (cls.batches_ahead + 2) * config.batch_size * sample

    def __init__(self, artifact: DatasetArtifact, split: str, workers: int, batch_size: int):
        threads = torch.get_num_threads()
        require("ffcv", "ffcv", "ffcv", "the ffcv loader backend")
        keep_torch_threads()
        torch.set_num_threads(threads)  # importing FFCV set torch to 1 thread, process-wide
        from ffcv.fields.basics import IntDecoder
        from ffcv.fields.ndarray import NDArrayDecoder
        from ffcv.fields.rgb_image import SimpleRGBImageDecoder
        from ffcv.loader import Loader, OrderOption
        rec = artifact.manifest.split(split)
        if rec.ffcv is None:
            raise LoaderError(f"split {split!r} has no FFCV file (formats={artifact.manifest.formats}); "
                              "re-shard with the ffcv format or pick another backend")
        self.path = str(artifact.local(rec.ffcv))
        image = NDArrayDecoder() if artifact.manifest.fields.image.ffcv_field == "ndarray" else SimpleRGBImageDecoder()
        self.workers, self.batch_size = workers, batch_size
        self.loader = Loader(self.path, batch_size=batch_size, num_workers=workers, order=OrderOption.SEQUENTIAL,
                             drop_last=False, batches_ahead=self.batches_ahead,
                             pipelines={"image": [image], "label": [IntDecoder()], "index": [IntDecoder()], "key": None})
        self.timings = Timings()
        advise_random(self.loader, self.path)
        table = np.sort(self.loader.reader.alloc_table, order="sample_id")
        self._alloc = table
        self._starts = np.searchsorted(table["sample_id"], np.arange(rec.count + 1))

    def _ranges(self, idx: np.ndarray) -> list[tuple[int, int]]:
        """(offset, size) of every allocation (image bytes, key) of these samples."""
        t, st = self._alloc, self._starts
        rows = np.concatenate([np.arange(st[i], st[i + 1]) for i in idx]) if len(idx) else np.arange(0)
        return list(zip(t["ptr"][rows].tolist(), t["size"][rows].tolist()))

    def epoch(self, order: np.ndarray, batch_size: int, drop_last: bool, start_batch: int = 0, *,
              resolution: int | None = None, epoch: int = 0) -> Iterator[RawBatch]:
        from ffcv.loader.epoch_iterator import EpochIterator
        from ffcv.pipeline.compiler import Compiler
        if batch_size != self.batch_size:
            raise LoaderError("the ffcv backend was built for another batch size")
        spans = batch_slices(len(order), batch_size, drop_last, start_batch)
        if not spans:
            return
        Compiler.set_num_threads(self.workers)
        ahead = Readahead(self.path, self._ranges, self.timings)
        ahead.start([order[lo:hi] for lo, hi in spans])
        it = EpochIterator(self.loader, order[spans[0][0]: spans[-1][1]].astype(np.uint64))
        taken = 0
        try:
            while True:
                t = time.perf_counter()
                try:
                    x, y, idx = next(it)
                except StopIteration:
                    return
                # FFCV reuses its output buffers a few batches later: copy out.
                out = (np.array(x), np.array(y).reshape(-1).astype(np.int64), np.array(idx).reshape(-1).astype(np.int64))
                self.timings.add("decode", time.perf_counter() - t)  # storage reads: the readahead's
                taken += 1
                ahead.taken(taken)
                yield out
        finally:
            ahead.stop()
            it.close()


def advise_random(loader, path: str) -> None:
    """Map the ``.beton`` for FFCV ourselves, with ``MADV_RANDOM``: our readahead thread brings in
    exactly the bytes the next batches need, and a fault on a page the kernel evicted meanwhile
    must not pull a whole read-around window (``read_ahead_kb``, 8 MB on this host's disk). Under a
    1 GiB memory limit over a 3.9 GB file, shuffled reads thrashed without it (benchmarks.loader_scale:
    28 GB read at a 200 MB/s throttle for 13k samples, 93 samples/s; with it, 0.6 GB for 26k)."""
    import mmap
    ctx = getattr(loader.memory_manager, "context", None)
    if ctx is None or not hasattr(ctx, "mmap"):  # FFCV's process cache reads pages itself
        return
    if ctx.mmap is None:
        ctx.mmap = np.memmap(path, "uint8", mode="r")
    if hasattr(mmap, "MADV_RANDOM"):
        ctx.mmap._mmap.madvise(mmap.MADV_RANDOM)


def keep_torch_threads() -> None:
    """FFCV's ``Compiler.set_num_threads`` also sets torch's thread count for the whole process
    (and its loader thread calls it every epoch), silently slowing the caller's own torch work.
    Numba's setting is per thread, which is all FFCV needs: patch out the torch part."""
    import numba
    from ffcv.pipeline.compiler import Compiler
    if getattr(Compiler, "_sluice_patched", False):
        return

    def set_num_threads(cls, n: int) -> None:
        n = n if n >= 1 else (os.cpu_count() or 1)
        cls.num_threads = n
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    Compiler.set_num_threads = classmethod(set_num_threads)
    Compiler._sluice_patched = True
