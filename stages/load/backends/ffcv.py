"""``ffcv``: FFCV's compiled reader over the split's ``.beton`` files, driven by our order; a
readahead thread per file reads the next batches' bytes (``stages/load/readahead.py``), so
storage reads are timed apart from FFCV's decode.

A split written in incremental versions has several ``.beton`` parts (``SplitRecord.ffcv_files``),
each holding a contiguous range of split indices under FFCV sample ids from 0. Each part gets
its own FFCV reader; an epoch runs, per part, the sub-sequence of the order that falls in its
range, and each batch takes its rows from every part's stream and puts them back at their
positions in the order. A split of one part reads its stream as it comes, no reassembly."""
from __future__ import annotations

import time
from typing import Iterator

import numpy as np
import torch

from sluice.errors import ArtifactError, LoaderError, require
from sluice.stages.load.backends.base import (LOADER_BACKENDS, Backend, RawBatch, Timings, batch_slices,
                                              decoded_sample_bytes)
from sluice.stages.load.canvas import encoded, stack_or_canvas, stored_channels
from sluice.stages.load.device_decode import decode_cpu, to_channels
from sluice.stages.load.integrity import Damage, Guard, mismatch
from sluice.stages.load.readahead import Readahead
from sluice.storage.artifact import DatasetArtifact
from sluice.storage.manifest import FfcvPart
from sluice.storage.sums import row_sums
from sluice.stages.host import usable_cores

# One part's rows of a batch: images, labels and indices as their records hold them, the CRC-32
# of each image's stored bytes (None: unchecked) and whether its record points at stored bytes.
Rows = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]


@LOADER_BACKENDS.register("ffcv")
class FfcvBackend(Backend):
    """FFCV's reader and JIT-compiled decoders, fed our order directly (an EpochIterator per
    epoch and ``.beton`` part), so no length is fixed from the first epoch and any order or
    resume point works."""
    name = "ffcv"
    holds = "its decode buffers and the batches in flight"
    batches_ahead = 2  # FFCV decodes this many batches ahead, into batches_ahead + 2 buffers

    @classmethod
    def open(cls, artifact, split, config, device, workers) -> "FfcvBackend":
        return cls(artifact, split, max(1, workers), config.batch_size, Guard.for_config(artifact, split, config),
                   decode=config.decode)

    @classmethod
    def working_bytes(cls, artifact, split, config) -> int | None:
        """The loader's batches in flight plus FFCV's own decode buffers: ``batches_ahead + 2``
        whole batches at the stored resolution per ``.beton`` part, allocated up front (with
        256×256 RGB images and batch 256, 200 MB a part)."""
        base, sample = super().working_bytes(artifact, split, config), decoded_sample_bytes(artifact)
        parts = max(1, len(artifact.manifest.split(split).ffcv_files()))
        return None if base is None or sample is None else \
            base + parts * (cls.batches_ahead + 2) * config.batch_size * sample

    def __init__(self, artifact: DatasetArtifact, split: str, workers: int, batch_size: int,
                 guard: Guard | None = None, decode: str = "cpu"):
        """``decode="device"`` (a JPEG field): FFCV reads the labels and indices only, the
        readahead reads and checks each image's bytes and hands them over (``Encoded``) for the
        loader to decode. Variable sizes, which FFCV's decoder cannot batch, are read that way
        too and decoded here with OpenCV onto a ``Canvas``."""
        self.guard = guard if guard is not None else Guard(artifact, split)
        threads = torch.get_num_threads()
        require("ffcv", "ffcv", "ffcv", "the ffcv loader backend")
        keep_torch_threads()
        torch.set_num_threads(threads)  # importing FFCV set torch to 1 thread, process-wide
        rec = artifact.manifest.split(split)
        if rec.ffcv is None:
            raise LoaderError(f"split {split!r} has no FFCV file (formats={artifact.manifest.formats}); "
                              "re-shard with the ffcv format or pick another backend")
        self.ndarray = artifact.manifest.fields.image.ffcv_field == "ndarray"
        jpeg = artifact.manifest.fields.image.encoding == "jpg"
        self.hands_encoded = decode == "device" and jpeg and not self.ndarray
        self.variable = artifact.manifest.fields.image.shape is None
        self.as_bytes = self.hands_encoded or (self.variable and not self.ndarray)  # FFCV decodes no image
        self.channels = stored_channels(artifact)
        self._pool = None  # threads decoding variable-size images (OpenCV releases the GIL)
        self.workers, self.batch_size = workers, batch_size
        self.timings = Timings()
        self.labels = artifact.labels(split)  # what a batch carries: relabels take effect
        # what the records hold: labels.npy but for the samples relabelled since they were written
        self._stored = artifact.stored_labels(split, self.labels)
        self._sums = self.guard.column("ffcv")
        self.parts = [_Part(artifact, p, self) for p in rec.ffcv_files()]
        self._firsts = np.array([p.first for p in self.parts], np.int64)
        self.file = self.parts[0].name
        self._checking = 0.0  # seconds the streams spent getting image checksums (timed as ``check``)

    def sample_file(self, index: int) -> str:
        return self._file_of(index)

    def _file_of(self, index: int) -> str:
        if len(self.parts) == 1:
            return self.file
        return self.parts[int(np.searchsorted(self._firsts, index, side="right")) - 1].name

    def _check(self, y: np.ndarray, idx: np.ndarray, want: np.ndarray, crc: np.ndarray | None,
               found: np.ndarray | None) -> list[Damage]:
        """What FFCV read against what was written: each image's stored bytes (checksummed by
        the readahead as it read them: ``crc``; an ndarray field's are the raw pixels FFCV copies
        out unchanged, a JPEG field's the bytes it decodes), each label against the label its
        record was written with, each index against the order asked for."""
        if self._sums is None:
            return []
        if len(idx) != len(want) or (idx != want).any():
            return [Damage(int(w), self._file_of(w), f"the record says index {int(i)}")
                    for i, w in zip(idx, want) if i != w] or \
                [Damage(int(want[0]), self._file_of(want[0]), "records missing")]
        damage = []
        if crc is not None:
            damage += [Damage(int(i), self._file_of(i), "its record points at no stored image")
                       for i in idx[~found]]
            want_crc = self._sums[idx]
            got = np.where(found, crc, want_crc)  # a missing image is named once, above
            damage += [mismatch(idx[k], self._file_of(idx[k]), got[k], want_crc[k], "image field")
                       for k in np.flatnonzero(got != want_crc)]
        wrong = np.flatnonzero(y != self._stored[idx])
        damage += [Damage(int(idx[k]), self._file_of(idx[k]),
                          f"label {int(y[k])}, written as {int(self._stored[idx[k]])}") for k in wrong]
        return damage

    def epoch(self, order: np.ndarray, batch_size: int, drop_last: bool, start_batch: int = 0, *,
              resolution: int | None = None, epoch: int = 0) -> Iterator[RawBatch]:
        from ffcv.pipeline.compiler import Compiler
        if batch_size != self.batch_size:
            raise LoaderError("the ffcv backend was built for another batch size")
        spans = batch_slices(len(order), batch_size, drop_last, start_batch)
        if not spans:
            return
        Compiler.set_num_threads(self.workers)
        start = spans[0][0]
        todo = np.asarray(order[start: spans[-1][1]], np.int64)
        one = len(self.parts) == 1
        which = None if one else np.searchsorted(self._firsts, todo, side="right") - 1  # each position's part
        streams: list[_Stream | None] = []
        try:
            for k, part in enumerate(self.parts):
                local = todo if one else todo[which == k]
                streams.append(_Stream(part, local - part.first, self) if len(local) else None)
            for lo, hi in spans:
                want = todo[lo - start: hi - start]
                t, checked = time.perf_counter(), self._checking
                if one:
                    rows = streams[0].take(hi - lo)
                else:
                    rows = self._assemble(streams, which[lo - start: hi - start])
                checked = self._checking - checked  # getting the image checksums, within the pulls
                self.timings.add("decode", time.perf_counter() - t - checked)  # storage reads: the readaheads'
                x, y, idx, crc, found = rows
                t = time.perf_counter() - checked
                damage = self._check(y, idx, want, crc, found)
                if damage:
                    self.guard.take(damage)  # fail: raised here, before the batch is yielded
                    keep = ~np.isin(want, [d.index for d in damage])
                    x, idx = x[keep], idx[keep]
                self.timings.add("check", time.perf_counter() - t)
                if self.as_bytes:
                    x, idx = self._images(x, idx)
                yield x, self.labels[idx], idx
        finally:
            for s in streams:
                if s is not None:
                    s.close()

    def _images(self, x: np.ndarray, idx: np.ndarray):
        """Rows read as bytes (an object array of uint8 arrays): ``Encoded`` for the loader to
        decode, or decoded here (OpenCV; raw records reshaped) onto a ``Canvas``, the samples
        that do not decode handed to the guard."""
        if self.hands_encoded:
            return encoded(list(x)), idx
        t = time.perf_counter()

        def one(data: np.ndarray, i: int) -> np.ndarray | Damage:
            part = self.parts[0] if len(self.parts) == 1 else self.parts[int(np.searchsorted(self._firsts, i, "right")) - 1]
            mode, h, w = (int(v[i - part.first]) for v in part.meta)
            try:
                return to_channels(decode_cpu(data, self.channels) if mode == 0 else data.reshape(h, w, 3),
                                   self.channels)
            except Exception as e:  # noqa: BLE001 - stored bytes that no longer decode are damage, named
                return Damage(i, self._file_of(i), f"cannot decode its jpg bytes ({type(e).__name__}: {e})")
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="sluice-decode")
        out = list(self._pool.map(one, x, idx.tolist()))
        keep = [k for k, r in enumerate(out) if not isinstance(r, Damage)]
        imgs = [out[k] for k in keep]
        self.guard.take([r for r in out if isinstance(r, Damage)])
        self.timings.add("decode", time.perf_counter() - t)
        return stack_or_canvas(imgs, (1, 1, self.channels)), idx[keep]

    def _assemble(self, streams: list["_Stream | None"], which: np.ndarray) -> Rows:
        """One batch from several parts: each part's next rows, put back at its positions."""
        n = len(which)
        x = None
        y, idx = np.empty(n, np.int64), np.empty(n, np.int64)
        checked = self._sums is not None
        crc = np.empty(n, np.uint32) if checked else None
        found = np.empty(n, bool) if checked else None
        for k in np.unique(which):
            pos = np.flatnonzero(which == k)
            rx, ry, ridx, rcrc, rfound = streams[k].take(len(pos))
            if x is None:
                x = np.empty((n, *rx.shape[1:]), rx.dtype)
            x[pos], y[pos], idx[pos] = rx, ry, ridx
            if checked:
                crc[pos], found[pos] = rcrc, rfound
        return x, y, idx, crc, found


class _Part:
    """One ``.beton`` of the split: FFCV's reader over it, and where each sample's bytes lie
    (by FFCV sample id, the split index less ``first``)."""

    def __init__(self, artifact: DatasetArtifact, part: FfcvPart, backend: FfcvBackend):
        from ffcv.fields.basics import IntDecoder
        from ffcv.fields.ndarray import NDArrayDecoder
        from ffcv.fields.rgb_image import SimpleRGBImageDecoder
        from ffcv.loader import Loader, OrderOption
        rec = part.file
        self.path = str(artifact.local(rec))
        self.name = rec.path if rec.version is None else f"{rec.version}/{rec.path}"
        self.first, self.count = part.first_index, part.count
        image = None if backend.as_bytes else NDArrayDecoder() if backend.ndarray else SimpleRGBImageDecoder()
        try:
            self.loader = Loader(self.path, batch_size=backend.batch_size, num_workers=backend.workers,
                                 order=OrderOption.SEQUENTIAL, drop_last=False, batches_ahead=backend.batches_ahead,
                                 pipelines={"image": None if image is None else [image], "label": [IntDecoder()], "index": [IntDecoder()],
                                            "key": None})
        except Exception as e:  # noqa: BLE001 - a damaged header or table: named, not FFCV's internal error
            raise ArtifactError(f"{self.name} of {artifact.root}: FFCV cannot open it ({type(e).__name__}: "
                                f"{e}); the file is damaged: re-shard (remove {artifact.root} and run `sluice "
                                f"shard` on its source again)") from None
        if int(self.loader.reader.num_samples) != self.count:
            raise ArtifactError(f"{self.name} of {artifact.root} holds {int(self.loader.reader.num_samples)} "
                                f"samples, the manifest says {self.count}; re-shard, or restore the original "
                                "manifest")
        advise_random(self.loader, self.path)
        # Where each sample's image is stored: all FFCV reads of a sample (its label and index
        # live in the metadata, loaded at open; its key is not decoded). The readahead reads
        # exactly these bytes; with checksums it takes their CRC-32 as it reads them, off the
        # loader's thread, for an ndarray field (raw pixels) as for a JPEG one.
        nbytes = image_nbytes(self.loader.reader) if backend.ndarray else None
        self.image = image_ranges(self.loader.reader, nbytes)
        self.checked = backend._sums is not None
        self.ndarray = backend.ndarray
        self.as_bytes = backend.as_bytes  # FFCV reads no image: the readahead hands over its bytes
        rgb = self.loader.reader.metadata[self.loader.reader.metadata.dtype.names[0]]
        self.meta = (rgb["mode"], rgb["height"], rgb["width"]) if self.as_bytes else None

    def spans(self, ids: np.ndarray) -> tuple[list[int], list[int]]:
        """Sample ids -> (offsets, sizes) of their stored images."""
        ptr, size, _ = self.image
        return ptr[ids].tolist(), size[ids].tolist()

    def ranges(self, ids: np.ndarray) -> list[tuple[int, int]]:
        """What the readahead reads beyond the checked ranges: the images themselves when
        unchecked, else nothing."""
        return [] if self.checked or self.as_bytes else list(zip(*self.spans(ids)))


class _Stream:
    """One part's share of an epoch: its sample ids in order, run through FFCV's EpochIterator
    in FFCV batches (the readahead's batches too); ``take(n)`` hands out the next ``n`` rows,
    keeping the rest of an FFCV batch for the next call."""

    def __init__(self, part: _Part, ids: np.ndarray, backend: FfcvBackend):
        from ffcv.loader.epoch_iterator import EpochIterator
        self.part, self.backend = part, backend
        bs = backend.batch_size
        self.chunks = [ids[i:i + bs] for i in range(0, len(ids), bs)]
        self.ahead = Readahead(part.path, part.ranges, backend.timings,
                               checked=part.spans if part.checked or part.as_bytes else None,
                               keep=part.as_bytes, crc=part.checked)
        self.ahead.start(self.chunks)
        self.it = None
        try:
            self.it = EpochIterator(part.loader, ids.astype(np.uint64))
        except BaseException:
            self.ahead.stop()
            raise
        self.pulled = 0
        self.buf: Rows | None = None
        self.at = 0

    def _pull(self) -> Rows:
        try:
            out = next(self.it)
        except StopIteration:
            raise LoaderError(f"FFCV's reader of {self.part.name} ended before the samples asked of it") from None
        b = self.pulled
        x, (y, idx) = (None, out) if self.part.as_bytes else (out[0], out[1:])
        t = time.perf_counter()
        if self.part.as_bytes:  # the images' bytes, as the readahead read (and checked) them
            crc, datas = self.ahead.kept(b)
            x = np.empty(len(datas), object)
            for k, d in enumerate(datas):
                x[k] = np.frombuffer(d, np.uint8)
        # FFCV reuses its output buffers a few batches later: copy out.
        rows = (np.array(x), np.array(y).reshape(-1).astype(np.int64), np.array(idx).reshape(-1).astype(np.int64))
        if self.part.as_bytes:
            found = self.part.image[2][self.chunks[b]] if self.part.checked else None
        elif self.part.checked:
            crc = self.ahead.poll(b) if self.part.ndarray else self.ahead.crcs(b)
            if crc is None:  # the readahead is behind: an ndarray's decoded pixels are its stored bytes
                crc = row_sums(rows[0])
            found = self.part.image[2][self.chunks[b]]
        else:
            crc = found = None
        self.backend._checking += time.perf_counter() - t
        self.pulled += 1
        self.ahead.taken(self.pulled)
        return (*rows, crc, found)

    def take(self, n: int) -> Rows:
        pieces = []
        while n:
            if self.buf is None or self.at == len(self.buf[0]):
                self.buf, self.at = self._pull(), 0
            m = min(n, len(self.buf[0]) - self.at)
            pieces.append(tuple(None if a is None else a[self.at:self.at + m] for a in self.buf))
            self.at, n = self.at + m, n - m
        if len(pieces) == 1:
            return pieces[0]
        return tuple(None if p[0] is None else np.concatenate(p) for p in zip(*pieces))

    def close(self) -> None:
        self.ahead.stop()
        if self.it is not None:
            self.it.close()


def image_nbytes(reader) -> int:
    """Bytes of one sample of an ndarray image field (the first field): its fixed shape's."""
    field = reader.handlers[reader.field_names[0]]
    return int(np.dtype(field.dtype).itemsize * int(np.prod(field.shape)))


def image_ranges(reader, nbytes: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each sample's stored image bytes where FFCV reads them, as (offsets, sizes, found): the
    data pointer in its metadata record (the image is the first field: a JPEG (RGB) field's
    record holds it as ``data_ptr``; an ndarray field's record is the pointer itself, ``nbytes``
    the fixed size FFCV copies out), the size from the allocation table. A record whose pointer
    is no allocation's (or, for an ndarray field, one of another size) is not ``found`` (size 0)."""
    meta = reader.metadata
    col = meta[meta.dtype.names[0]]
    ptr = np.asarray(col if nbytes is not None else col["data_ptr"], np.int64)
    table = reader.alloc_table
    if len(table) == 0:  # no samples (or a table that lost them all): nothing found
        return np.zeros(len(ptr), np.int64), np.zeros(len(ptr), np.int64), np.zeros(len(ptr), bool)
    by_ptr = np.argsort(table["ptr"])
    at = np.minimum(np.searchsorted(table["ptr"][by_ptr], ptr), len(table) - 1)
    found = table["ptr"][by_ptr][at].astype(np.int64) == ptr
    size = np.where(found, table["size"][by_ptr][at], 0).astype(np.int64)
    if nbytes is not None:  # FFCV copies what the table says: it must be the image's size
        found &= size == nbytes
        size = np.where(found, size, 0)
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
        n = n if n >= 1 else usable_cores()
        cls.num_threads = n
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    Compiler.set_num_threads = classmethod(set_num_threads)
    Compiler._sluice_patched = True
