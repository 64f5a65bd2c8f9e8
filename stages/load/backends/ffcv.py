"""``ffcv``: FFCV's compiled reader over the split's ``.beton``, driven by our order; a readahead
thread reads the next batches' bytes (``stages/load/readahead.py``), so storage reads are timed
apart from FFCV's decode."""
from __future__ import annotations

import os
import time
from typing import Iterator

import numpy as np
import torch

from sluice.errors import ArtifactError, LoaderError, require
from sluice.stages.load.backends.base import (LOADER_BACKENDS, Backend, RawBatch, Timings, batch_slices,
                                              decoded_sample_bytes)
from sluice.stages.load.integrity import Damage, Guard, check_rows
from sluice.stages.load.readahead import Readahead
from sluice.storage.sums import row_sums
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
        return cls(artifact, split, max(1, workers), config.batch_size, Guard.for_config(artifact, split, config))

    @classmethod
    def working_bytes(cls, artifact, split, config) -> int | None:
        """The loader's batches in flight plus FFCV's own decode buffers: ``batches_ahead + 2``
        whole batches at the stored resolution, allocated up front (with 256×256 RGB images and
        batch 256, 200 MB)."""
        base, sample = super().working_bytes(artifact, split, config), decoded_sample_bytes(artifact)
        return None if base is None or sample is None else base + (cls.batches_ahead + 2) * config.batch_size * sample

    def __init__(self, artifact: DatasetArtifact, split: str, workers: int, batch_size: int,
                 guard: Guard | None = None):
        self.guard = guard if guard is not None else Guard(artifact, split)
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
        self.file = rec.ffcv.path
        self.ndarray = artifact.manifest.fields.image.ffcv_field == "ndarray"
        image = NDArrayDecoder() if self.ndarray else SimpleRGBImageDecoder()
        self.workers, self.batch_size = workers, batch_size
        try:
            self.loader = Loader(self.path, batch_size=batch_size, num_workers=workers, order=OrderOption.SEQUENTIAL,
                                 drop_last=False, batches_ahead=self.batches_ahead,
                                 pipelines={"image": [image], "label": [IntDecoder()], "index": [IntDecoder()],
                                            "key": None})
        except Exception as e:  # noqa: BLE001 - a damaged header or table: named, not FFCV's internal error
            raise ArtifactError(f"{rec.ffcv.path} of {artifact.root}: FFCV cannot open it ({type(e).__name__}: "
                                f"{e}); the file is damaged: re-shard (remove {artifact.root} and run `sluice "
                                f"shard` on its source again)") from None
        self.timings = Timings()
        advise_random(self.loader, self.path)
        self.labels = artifact.labels(split)
        self._sums = self.guard.column("ffcv")
        table = np.sort(self.loader.reader.alloc_table, order="sample_id")
        # A JPEG field is checked from its stored bytes, which the readahead thread reads anyway:
        # it takes their CRC-32 as it reads them (``image_ranges``), and reads only the rest here.
        self._image = None if self._sums is None or self.ndarray else image_ranges(self.loader.reader)
        if self._image is not None:
            table = table[~np.isin(table["ptr"], self._image[0][self._image[2]])]
        self._alloc = table
        self._starts = np.searchsorted(table["sample_id"], np.arange(rec.count + 1))

    def _check(self, x: np.ndarray, y: np.ndarray, idx: np.ndarray, want: np.ndarray,
               stored: np.ndarray | None) -> list[Damage]:
        """What FFCV decoded against what was written: each image's bytes (an ndarray field is
        copied out unchanged, so its checksum is the stored one; a JPEG field's stored bytes were
        checksummed by the readahead as it read them: ``stored``), each label against labels.npy,
        each index against the order asked for."""
        if self._sums is None:
            return []
        if len(idx) != len(want) or (idx != want).any():
            return [Damage(int(w), self.file, f"the record says index {int(i)}")
                    for i, w in zip(idx, want) if i != w] or [Damage(int(want[0]), self.file, "records missing")]
        damage = []
        if self.ndarray:
            damage += check_rows(self.guard, self._sums, row_sums(x), idx, self.file, "image field")
        else:
            found = self._image[2][idx]
            damage += [Damage(int(i), self.file, "its record points at no stored image") for i in idx[~found]]
            got = np.where(found, stored, self._sums[idx])  # a missing image is named once, above
            damage += check_rows(self.guard, self._sums, got, idx, self.file, "image field")
        wrong = np.flatnonzero(y != self.labels[idx])
        damage += [Damage(int(idx[k]), self.file, f"label {int(y[k])}, labels.npy says {int(self.labels[idx[k]])}")
                   for k in wrong]
        return damage

    @property
    def _image_spans(self):
        """For a checked JPEG field: ``idx`` -> (offsets, sizes) of those samples' stored images."""
        if self._image is None:
            return None
        ptr, size, _ = self._image
        return lambda idx: (ptr[idx].tolist(), size[idx].tolist())

    def _ranges(self, idx: np.ndarray) -> list[tuple[int, int]]:
        """(offset, size) of every allocation (image bytes, key) of these samples (a checked
        JPEG field's image bytes apart: ``_image_spans``)."""
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
        ahead = Readahead(self.path, self._ranges, self.timings, checked=self._image_spans)
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
                lo, hi = spans[taken]
                t = time.perf_counter()
                stored = ahead.crcs(taken) if self._image is not None else None
                damage = self._check(*out, order[lo:hi], stored)
                if damage:
                    self.guard.take(damage)  # fail: raised here, before the batch is yielded
                    keep = ~np.isin(out[2], [d.index for d in damage])
                    out = (out[0][keep], out[1][keep], out[2][keep])
                self.timings.add("check", time.perf_counter() - t)
                taken += 1
                ahead.taken(taken)
                yield out
        finally:
            ahead.stop()
            it.close()


def image_ranges(reader) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For a JPEG (RGB) image field: each sample's stored image bytes where FFCV reads them (the
    data pointer in its metadata record, the size from the allocation table), as (offsets,
    sizes, found); a record whose pointer is no allocation's is not ``found`` (size 0)."""
    meta = reader.metadata
    ptr = np.asarray(meta[meta.dtype.names[0]]["data_ptr"], np.int64)  # the image is the first field
    table = reader.alloc_table
    by_ptr = np.argsort(table["ptr"])
    at = np.minimum(np.searchsorted(table["ptr"][by_ptr], ptr), len(table) - 1)
    found = table["ptr"][by_ptr][at].astype(np.int64) == ptr
    size = np.where(found, table["size"][by_ptr][at], 0).astype(np.int64)
    return np.where(found, ptr, 0), size, found


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
