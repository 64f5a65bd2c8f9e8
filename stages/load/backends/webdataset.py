"""``webdataset``: the tar shards read by byte offset (from the DALI index files) in torch
DataLoader workers, in exactly the sampler's order; or, as an explicit ``streaming`` mode, plain
WebDataset streaming with shard shuffle."""
from __future__ import annotations

import contextlib
import time
import zlib
from typing import Iterator

import numpy as np
import torch
from pydantic import Field

from sluice.errors import ArtifactError, SluiceError, require
from sluice.plugins import EntryParams
from sluice.process_rules import fork_safe
from sluice.stages.load.backends.base import (LOADER_BACKENDS, Backend, RawBatch, Timings, batch_slices,
                                              decoded_sample_bytes)
from sluice.stages.load.canvas import encoded, stack_or_canvas, stored_channels
from sluice.stages.load.decode import opencv, pixels_batch
from sluice.stages.load.device_decode import to_channels
from sluice.stages.load.integrity import Damage, Guard, mismatch
from sluice.stages.load.sample_index import SampleIndex
from sluice.storage.artifact import DatasetArtifact
from sluice.stages.host import workers_or_cores


class _IndexedTarDataset(torch.utils.data.Dataset):
    def __init__(self, si: SampleIndex, labels: np.ndarray, encoded: bool = False, channels: int = 3):
        self.si, self.labels, self.encoded, self.channels = si, labels, encoded, channels

    def __len__(self) -> int:
        return self.si.count

    def __getitem__(self, batch: np.ndarray):  # a whole batch per call: one IPC round trip
        self.si.timings = Timings()  # this batch's read and decode seconds travel with it
        # each sample's bytes are checked as read; the damaged ones go back named
        if self.encoded:  # decode: device: read and check only; the loader decodes the batch
            datas, damage = self.si.read_batch(batch)
            good = [k for k, d in enumerate(datas) if d is not None]
            batch = np.asarray(batch).reshape(-1)[good]
            x = encoded([datas[k] for k in good])
            return x, self.labels[batch], batch, dict(self.si.timings), damage
        imgs, keep, damage = pixels_batch(self.si, batch)
        batch = np.asarray(keep, dtype=np.asarray(batch).dtype)
        if self.si.shape is None:  # variable sizes: one channel count, on a canvas
            imgs = [to_channels(im, self.channels) for im in imgs]
        x = stack_or_canvas(imgs, self.si.shape or (1, 1, self.channels))
        return x, self.labels[batch], batch, dict(self.si.timings), damage


class WebDatasetParams(EntryParams):
    """``loader.backend_params.webdataset``."""
    streaming: bool = Field(False, description="plain WebDataset streaming with shard shuffle: inexact "
                            "order, resume only at epoch boundaries")
    shuffle_buffer: int = Field(1000, ge=1, description="streaming: samples in WebDataset's shuffle buffer")


@LOADER_BACKENDS.register("webdataset")
class WebDatasetBackend(Backend):
    """Exact-order reads from the tar shards (byte offsets from the DALI index files), decoded in
    ``workers`` DataLoader processes. ``streaming=True`` is plain WebDataset instead: shards
    shuffled, a shuffle buffer, no exact order and resume only at epoch boundaries."""
    name = "webdataset"
    Params = WebDatasetParams
    reads_shards = True
    batches_per_worker = 2  # DataLoader's prefetch_factor: decoded batches each worker keeps ready

    @classmethod
    def open(cls, artifact, split, config, device, workers) -> "WebDatasetBackend":
        p = WebDatasetParams.model_validate(config.params_for("webdataset"))
        return cls(artifact, split, workers, p.streaming, p.shuffle_buffer, config.seed,
                   Guard.for_config(artifact, split, config), decode=config.decode)

    @classmethod
    def working_bytes(cls, artifact, split, config) -> int | None:
        """The batches the DataLoader workers keep ready, plus the one being augmented and the
        caller's (a backend that forks its workers runs without the loader's prefetch thread)."""
        sample = decoded_sample_bytes(artifact)
        workers = workers_or_cores(config.workers)
        return None if sample is None else (workers * cls.batches_per_worker + 2) * config.batch_size * sample

    def __init__(self, artifact: DatasetArtifact, split: str, workers: int, streaming: bool = False,
                 shuffle_buffer: int = 1000, seed: int = 0, guard: Guard | None = None, decode: str = "cpu"):
        """``decode="device"``: the workers only read and check each batch's JPEG bytes and hand
        them over (``Encoded``) for the loader to decode; the streaming mode decodes itself."""
        self.artifact, self.split, self.workers = artifact, split, workers
        self.channels = stored_channels(artifact)
        self.guard = guard if guard is not None else Guard(artifact, split)
        self.labels = artifact.labels(split)
        self.streaming, self.shuffle_buffer, self.seed = streaming, shuffle_buffer, seed
        self.si = None if streaming else SampleIndex(artifact, split, sums=self.guard.column("tar"))
        self.hands_encoded = decode == "device" and self.si is not None and self.si.encoding in ("jpg", "jpeg")
        if self.si is not None and self.si.encoding in ("jpg", "jpeg"):
            opencv()  # imported once here, not in every epoch's freshly forked workers
        self.timings = Timings()
        self.forks_per_epoch = workers > 0 and not streaming

    def epoch(self, order: np.ndarray, batch_size: int, drop_last: bool, start_batch: int = 0, *,
              resolution: int | None = None, epoch: int = 0) -> Iterator[RawBatch]:
        if self.streaming:
            yield from self._stream(order, batch_size, drop_last)
            return
        spans = batch_slices(len(order), batch_size, drop_last, start_batch)
        batches = [order[lo:hi] for lo, hi in spans]
        ds = _IndexedTarDataset(self.si, self.labels, self.hands_encoded, self.channels)
        dl = torch.utils.data.DataLoader(ds, batch_size=None,
                                         sampler=batches, num_workers=self.workers,
                                         prefetch_factor=self.batches_per_worker if self.workers else None,
                                         persistent_workers=False)
        # DataLoader forks its workers when the iterator starts (none: no fork, nothing to guard)
        with fork_safe() if self.workers else contextlib.nullcontext():
            it = iter(dl)
        for imgs, labels, idx, spent, damage in it:
            self.timings.merge(spent)  # worker-seconds of storage reads and decodes
            self.guard.take(damage)  # fail: raised here, before this batch is yielded
            yield imgs, labels, idx

    def sample_file(self, index: int) -> str:
        return "?" if self.si is None else self.si.tars[int(self.si.shard_of[index])].path

    def _stream(self, order: np.ndarray, batch_size: int, drop_last: bool) -> Iterator[RawBatch]:
        """Plain WebDataset: as many samples as this rank's share, in stream order."""
        wds = require("webdataset", "webdataset", "webdataset", "the webdataset streaming mode")
        import io
        shards = self.artifact.manifest.split(self.split).shards
        urls = [str(self.artifact.local(sh.tar)) for sh in shards]
        named = {u: sh.tar.path for u, sh in zip(urls, shards)}  # damage names the artifact's file
        ext = self.artifact.manifest.fields.image.encoding
        sums, count = self.guard.column("tar"), len(self.labels)
        variable, channels = self.artifact.manifest.fields.image.shape is None, self.channels

        def decode(sample):
            data = sample[ext]
            idx = int.from_bytes(sample["idx"], "little", signed=True) if len(sample.get("idx", b"")) == 8 else -1
            where = named.get(sample.get("__url__"), sample.get("__url__", "?"))
            if not 0 <= idx < count:
                return Damage(-1, where, f"member {sample.get('__key__')!r} has no valid split index")
            got = zlib.crc32(data) if sums is not None else None
            if got is not None and got != sums[idx]:
                return mismatch(idx, where, got, sums[idx])
            if ext == "npy":
                img = np.load(io.BytesIO(data), allow_pickle=False)
            else:
                from PIL import Image
                img = np.asarray(Image.open(io.BytesIO(data)))
                img = img[:, :, None] if img.ndim == 2 else img
                if variable:
                    img = to_channels(img, channels)
            return img, int(self.labels[idx]), idx  # labels.npy, verified at open

        ds = (wds.WebDataset(urls, shardshuffle=len(urls), seed=self.seed, nodesplitter=None, empty_check=False)
              .shuffle(self.shuffle_buffer, seed=self.seed).map(decode))
        buf: list = []
        emitted = 0
        t = time.perf_counter()
        stream = iter(ds)
        while True:  # webdataset reads and decodes in one stream: not split
            try:
                item = next(stream)
            except StopIteration:
                break
            except SluiceError:
                raise
            except Exception as e:  # noqa: BLE001 - a damaged tar header, a cut member: named, not a parser's error
                raise ArtifactError(f"the tar shards of split {self.split!r} of {self.artifact.root} are damaged "
                                    f"({type(e).__name__}: {e}); `sluice verify {self.artifact.root}` names the "
                                    "file; re-shard it") from None
            self.timings.add("read+decode", time.perf_counter() - t)
            if isinstance(item, Damage):
                self.guard.take([item])
                t = time.perf_counter()
                continue
            buf.append(item)
            if len(buf) == batch_size:
                yield self._collate(buf)
                emitted += len(buf)
                buf = []
                if emitted >= len(order):
                    return
            t = time.perf_counter()
        if buf and not drop_last:
            yield self._collate(buf)

    def _collate(self, buf):
        return (stack_or_canvas([b[0] for b in buf], (1, 1, self.channels)), np.array([b[1] for b in buf], np.int64),
                np.array([b[2] for b in buf], np.int64))
