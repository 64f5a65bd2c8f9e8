"""Loader backends: each yields raw uint8 NHWC batches for any index order, exactly in order.

``memory``: the whole split decoded once into a uint8 array; a batch is one fancy index.
``ffcv``: FFCV's compiled reader over the ``.beton``, driven by our order.
``webdataset``: the tar shards read by offset (DALI index files) in torch DataLoader workers;
or, as an explicit ``streaming`` mode, plain WebDataset streaming with shard shuffle.
The DALI backend (``sluice.stages.load.dali``) also augments on its side and yields finished batches.
"""
from __future__ import annotations

import os
import time
from typing import Iterator

import numpy as np
import torch

from sluice.errors import require
from sluice.stages.procs import fork_safe
from sluice.stages.load.sample_index import SampleIndex
from sluice.storage.artifact import DatasetArtifact

RawBatch = tuple[np.ndarray | torch.Tensor, np.ndarray | torch.Tensor, np.ndarray | torch.Tensor]


def batch_slices(n: int, batch_size: int, drop_last: bool, start_batch: int) -> list[tuple[int, int]]:
    stop = (n // batch_size) * batch_size if drop_last else n
    return [(lo, min(lo + batch_size, stop)) for lo in range(start_batch * batch_size, stop, batch_size)]


class Timings(dict):
    """Cumulative seconds per loading stage (read / decode / augment / transfer / wait)."""

    def add(self, key: str, seconds: float) -> None:
        self[key] = self.get(key, 0.0) + seconds


def _pixels(si: SampleIndex, i: int) -> np.ndarray:
    """``si.pixels(i)``, with baseline JPEGs decoded by OpenCV (the same libjpeg-turbo defaults
    as PIL, so the same pixels; about 2× faster for small images). Anything unusual (CMYK, no
    OpenCV, a decode failure) goes through PIL as before."""
    if si.encoding in ("jpg", "jpeg"):
        from sluice.stages.load.augment import _cv2
        cv2 = _cv2()
        data = si.read(i)
        if cv2 is not None and _jpeg_components(data) in (1, 3):
            arr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED | cv2.IMREAD_IGNORE_ORIENTATION)
            if arr is not None and arr.dtype == np.uint8:
                if arr.ndim == 2:
                    return arr[:, :, None]
                if arr.ndim == 3 and arr.shape[2] == 3:
                    return cv2.cvtColor(arr, cv2.COLOR_BGR2RGB)
    return si.pixels(i)


def _jpeg_components(data: bytes) -> int | None:
    """Colour components of a Huffman baseline/extended/progressive JPEG (from its SOF0-2
    header); None for anything else, which is then left to PIL."""
    if data[:2] != b"\xff\xd8":
        return None
    pos, end = 2, len(data) - 9
    while pos < end:
        if data[pos] != 0xFF:
            return None
        m = data[pos + 1]
        if m == 0xFF:  # fill byte
            pos += 1
            continue
        if m in (0xC0, 0xC1, 0xC2):
            return data[pos + 9]
        if 0xC3 <= m <= 0xCF and m not in (0xC4, 0xC8, 0xCC) or m == 0xDA:
            return None  # lossless / arithmetic coding, or scan data before any SOF
        if m == 0x01 or 0xD0 <= m <= 0xD7:
            pos += 2
            continue
        pos += 2 + ((data[pos + 2] << 8) | data[pos + 3])
    return None


class MemoryBackend:
    """Decode the split once into RAM; then every batch is a numpy gather (~µs per sample)."""
    name = "memory"
    augments = False

    def __init__(self, artifact: DatasetArtifact, split: str, workers: int, max_bytes: int | None = None):
        self.labels = artifact.labels(split)
        shape = artifact.manifest.fields.image.shape
        n = len(self.labels)
        if shape is None:
            raise ValueError("the memory backend needs a fixed image shape; this split has variable sizes "
                             "(use ffcv, dali or webdataset, or re-shard with shard.image_size)")
        need = n * int(np.prod(shape))
        budget = max_bytes if max_bytes is not None else _available_memory() // 2
        if need > budget:
            raise MemoryError(f"split {split!r} needs {need / 1e9:.1f} GB decoded, more than the "
                              f"{budget / 1e9:.1f} GB budget; use the ffcv or dali backend")
        self.timings = Timings()
        t = time.perf_counter()
        self.images = _decode_all(artifact, split, shape, workers)
        self.timings.add("decode", time.perf_counter() - t)

    def epoch(self, order: np.ndarray, batch_size: int, drop_last: bool, start_batch: int = 0) -> Iterator[RawBatch]:
        for lo, hi in batch_slices(len(order), batch_size, drop_last, start_batch):
            t = time.perf_counter()
            idx = order[lo:hi]
            out = (self.images[idx], self.labels[idx], idx)
            self.timings.add("read", time.perf_counter() - t)
            yield out


def _available_memory() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 << 30


def _decode_all(artifact: DatasetArtifact, split: str, shape, workers: int) -> np.ndarray:
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
            out[i] = _pixels(si, i)
    step = max(1, si.count // (4 * max(workers, 1)) + 1)
    with ThreadPoolExecutor(max(workers, 1)) as ex:
        list(ex.map(fill, [(lo, min(lo + step, si.count)) for lo in range(0, si.count, step)]))
    return out


class FfcvBackend:
    """FFCV's reader and JIT-compiled decoders, fed our order directly (an EpochIterator per
    epoch), so no length is fixed from the first epoch and any order or resume point works."""
    name = "ffcv"
    augments = False

    def __init__(self, artifact: DatasetArtifact, split: str, workers: int, batch_size: int):
        threads = torch.get_num_threads()
        require("ffcv", "ffcv", "ffcv", "the ffcv loader backend")
        _keep_torch_threads()
        torch.set_num_threads(threads)  # importing FFCV set torch to 1 thread, process-wide
        from ffcv.fields.basics import IntDecoder
        from ffcv.fields.ndarray import NDArrayDecoder
        from ffcv.fields.rgb_image import SimpleRGBImageDecoder
        from ffcv.loader import Loader, OrderOption
        rec = artifact.manifest.split(split)
        if rec.ffcv is None:
            raise ValueError(f"split {split!r} has no FFCV file (formats={artifact.manifest.formats})")
        self.path = str(artifact.local(rec.ffcv))
        image = NDArrayDecoder() if artifact.manifest.fields.image.ffcv_field == "ndarray" else SimpleRGBImageDecoder()
        self.workers, self.batch_size = workers, batch_size
        self.loader = Loader(self.path, batch_size=batch_size, num_workers=workers, order=OrderOption.SEQUENTIAL,
                             drop_last=False, batches_ahead=2,
                             pipelines={"image": [image], "label": [IntDecoder()], "index": [IntDecoder()], "key": None})
        self.timings = Timings()

    def epoch(self, order: np.ndarray, batch_size: int, drop_last: bool, start_batch: int = 0) -> Iterator[RawBatch]:
        from ffcv.loader.epoch_iterator import EpochIterator
        from ffcv.pipeline.compiler import Compiler
        if batch_size != self.batch_size:
            raise ValueError("the ffcv backend was built for another batch size")
        spans = batch_slices(len(order), batch_size, drop_last, start_batch)
        if not spans:
            return
        Compiler.set_num_threads(self.workers)
        it = EpochIterator(self.loader, order[spans[0][0]: spans[-1][1]].astype(np.uint64))
        try:
            while True:
                t = time.perf_counter()
                try:
                    x, y, idx = next(it)
                except StopIteration:
                    return
                # FFCV reuses its output buffers a few batches later: copy out.
                out = (np.array(x), np.array(y).reshape(-1).astype(np.int64), np.array(idx).reshape(-1).astype(np.int64))
                self.timings.add("read+decode", time.perf_counter() - t)
                yield out
        finally:
            it.close()


def _keep_torch_threads() -> None:
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


class _IndexedTarDataset(torch.utils.data.Dataset):
    def __init__(self, si: SampleIndex, labels: np.ndarray):
        self.si, self.labels = si, labels

    def __len__(self) -> int:
        return self.si.count

    def __getitem__(self, batch: np.ndarray):  # a whole batch per call: one IPC round trip
        imgs = np.stack([_pixels(self.si, int(i)) for i in batch])
        return imgs, self.labels[batch], batch


class WebDatasetBackend:
    """Exact-order reads from the tar shards (byte offsets from the DALI index files), decoded in
    ``workers`` DataLoader processes. ``streaming=True`` is plain WebDataset instead: shards
    shuffled, a shuffle buffer, no exact order and resume only at epoch boundaries."""
    name = "webdataset"
    augments = False

    def __init__(self, artifact: DatasetArtifact, split: str, workers: int, streaming: bool = False,
                 shuffle_buffer: int = 1000, seed: int = 0):
        self.artifact, self.split, self.workers = artifact, split, workers
        self.labels = artifact.labels(split)
        self.streaming, self.shuffle_buffer, self.seed = streaming, shuffle_buffer, seed
        self.si = None if streaming else SampleIndex(artifact, split)
        if self.si is not None and self.si.encoding in ("jpg", "jpeg"):
            from sluice.stages.load.augment import _cv2
            _cv2()  # imported once here, not in every epoch's freshly forked workers
        self.timings = Timings()
        self.forks_per_epoch = workers > 0 and not streaming

    def epoch(self, order: np.ndarray, batch_size: int, drop_last: bool, start_batch: int = 0) -> Iterator[RawBatch]:
        if self.streaming:
            yield from self._stream(order, batch_size, drop_last)
            return
        spans = batch_slices(len(order), batch_size, drop_last, start_batch)
        batches = [order[lo:hi] for lo, hi in spans]
        dl = torch.utils.data.DataLoader(_IndexedTarDataset(self.si, self.labels), batch_size=None,
                                         sampler=batches, num_workers=self.workers,
                                         prefetch_factor=4 if self.workers else None,
                                         persistent_workers=False)
        with fork_safe():  # DataLoader forks its workers when the iterator starts
            it = iter(dl)
        t = time.perf_counter()
        for imgs, labels, idx in it:
            self.timings.add("read+decode", time.perf_counter() - t)
            yield imgs, labels, idx
            t = time.perf_counter()

    def _stream(self, order: np.ndarray, batch_size: int, drop_last: bool) -> Iterator[RawBatch]:
        """Plain WebDataset: as many samples as this rank's share, in stream order."""
        wds = require("webdataset", "webdataset", "webdataset", "the webdataset streaming mode")
        import io
        urls = [str(self.artifact.local(sh.tar)) for sh in self.artifact.manifest.split(self.split).shards]
        ext = self.artifact.manifest.fields.image.encoding

        def decode(sample):
            data = sample[ext]
            if ext == "npy":
                img = np.load(io.BytesIO(data), allow_pickle=False)
            else:
                from PIL import Image
                img = np.asarray(Image.open(io.BytesIO(data)))
                img = img[:, :, None] if img.ndim == 2 else img
            return img, int(sample["cls"]), int.from_bytes(sample["idx"], "little", signed=True)

        ds = (wds.WebDataset(urls, shardshuffle=len(urls), seed=self.seed, nodesplitter=None, empty_check=False)
              .shuffle(self.shuffle_buffer, seed=self.seed).map(decode))
        buf: list = []
        emitted = 0
        t = time.perf_counter()
        for img, label, idx in ds:
            buf.append((img, label, idx))
            if len(buf) == batch_size:
                yield self._collate(buf)
                emitted += len(buf)
                buf = []
                if emitted >= len(order):
                    return
        if buf and not drop_last:
            yield self._collate(buf)
        self.timings.add("read+decode", time.perf_counter() - t)

    @staticmethod
    def _collate(buf):
        return (np.stack([b[0] for b in buf]), np.array([b[1] for b in buf], np.int64),
                np.array([b[2] for b in buf], np.int64))
