"""Finishing a backend's raw batches (``BatchFinisher``): decoded where they are still bytes,
moved to the loader's device (the CPU or a GPU) and augmented with draws seeded per (epoch,
batch), so every backend and every resumed run augments batch b of epoch e alike. On CUDA the copy and augmentation run on a side stream, overlapping
the caller's compute (``OnStream``); a backend that augments itself (DALI) yields its batches
finished. A backend may hand over batches already on the device (the memory backend's split
held on the GPU) or in pinned memory; either way no float32 crosses PCIe."""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Iterator, NamedTuple

import numpy as np
import torch

from sluice.errors import LoaderError
from sluice.stages.contracts import Batch
from sluice.stages.load.augment import TorchAugment, batch_seed
from sluice.stages.load.backends import Backend, Timings
from sluice.stages.load.backends.base import with_index
from sluice.stages.load.canvas import Canvas, Encoded
from sluice.stages.load.config import LoaderConfig
from sluice.stages.load.device_decode import CpuDecoder, JpegDecoder, decode_batch
from sluice.storage.artifact import DatasetArtifact


def check_resolution(config: LoaderConfig, artifact: DatasetArtifact) -> None:
    """Refuse, before anything is read, a resolution or crop size (of an op that makes one size:
    ``random_resized_crop``, ``center_crop``) above the stored images': it would only upsample."""
    shape = artifact.manifest.fields.image.shape
    wanted = [config.resolution.end] if config.resolution else []
    if config.augment:
        wanted += [op.size for op in config.augment.ops if op.makes_one_size and getattr(op, "size", None)]
    if shape is not None:
        for w in wanted:
            if w > max(shape[0], shape[1]):
                raise LoaderError(f"requested resolution {w} is above the stored {shape[0]}×{shape[1]}; "
                                  "re-shard at a higher resolution")


def on_side_stream(device: torch.device, stream: Any) -> contextlib.AbstractContextManager:
    """The rank's device and the loader's side stream, for the work of one batch (nothing on CPU).
    The prefetch thread's current device is cuda:0 unless set, hence the device as well."""
    if stream is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.cuda.device(device))
    stack.enter_context(torch.cuda.stream(stream))
    return stack


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``, copied without blocking: as it is where it is already there (a split
    held on the GPU), straight from pinned memory, else through a pinned copy."""
    if t.device == device:
        return t
    if not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


@dataclasses.dataclass
class BatchFinisher:
    """What finishing a loader's batches needs, fixed for the loader's life: its ``device``, its
    ``augment`` and the ``seed`` of its draws, the ``decoder`` for bytes (None: the CPU's), the
    stored ``image`` (H, W, C) — (1, 1, C) for variable sizes: the decode's channels, an empty
    batch's shape — its ``batch_size`` and where the seconds go (``timings``)."""
    device: torch.device
    augment: TorchAugment
    seed: int
    batch_size: int
    timings: Timings
    decoder: JpegDecoder | None = None
    image: tuple[int, int, int] = (1, 1, 3)

    def batches(self, backend: Backend, order: np.ndarray, epoch: int, start: int, drop_last: bool,
                resolution: int | None = None) -> Iterator[Batch | OnStream]:
        """Batches of ``order`` from batch ``start`` on, on ``device`` and augmented; on CUDA each
        comes as an ``OnStream`` for the caller to ``hand_over``. ``transfer`` and ``augment``
        seconds go to ``timings``. On CUDA the backend's own work for a batch (a gather on the
        GPU, a gather into pinned memory) runs on the side stream too; only uint8 crosses PCIe.

        A backend's batch may be a ``Canvas`` (images of different sizes, augmented with their
        sizes) or ``Encoded`` (JPEG bytes): those are decoded here by ``decoder`` (``decode``
        seconds), on ``device`` where it is a device decoder, so only the bytes cross PCIe."""
        batch_size, seed, augment, timings, image = self.batch_size, self.seed, self.augment, self.timings, self.image
        decoder = self.decoder
        if backend.augments:  # DALI: augmentation and transfer happen inside, with the same draws
            yield from (Batch.of_images(*b) for b in backend.epoch(order, batch_size, drop_last, start,
                                                         resolution=resolution, epoch=epoch))
            return
        device = with_index(self.device)
        cuda = device.type == "cuda"
        stream = torch.cuda.Stream(device) if cuda else None
        raw = iter(backend.epoch(order, batch_size, drop_last, start))
        b = start
        while True:
            with on_side_stream(device, stream):
                item = next(raw, None)
                if item is None:
                    break
                imgs, labels, idx = item
                sizes = None
                if isinstance(imgs, Encoded):
                    t = time.perf_counter()
                    if decoder is None:
                        decoder = CpuDecoder(torch.device("cpu"))
                    imgs, sizes, labels, idx = decode_batch(decoder, imgs, labels, idx, backend.guard,
                                                            backend.sample_file, image[2], image)
                    timings.add("decode", time.perf_counter() - t)
                elif isinstance(imgs, Canvas):
                    imgs, sizes = imgs
                t = time.perf_counter()
                x = torch.as_tensor(imgs)
                y = torch.as_tensor(labels, dtype=torch.int64)
                i = torch.as_tensor(idx, dtype=torch.int64)
                if cuda:
                    x, y, i = to_device(x, device), to_device(y, device), to_device(i, device)
                t1 = time.perf_counter()
                timings.add("transfer", t1 - t)
                # Seeded per (epoch, batch), as on every backend: a resumed run augments its
                # batches exactly as before.
                augment.reseed(batch_seed(seed, epoch, b))
                x = augment(x, resolution) if sizes is None else augment(x, resolution, sizes)
                timings.add("augment", time.perf_counter() - t1)
                ready = stream.record_event() if cuda else None
            b += 1
            batch = Batch.of_images(x, y, i)
            yield batch if ready is None else OnStream(batch, ready)


class OnStream(NamedTuple):
    """A CUDA batch made on the loader's side stream, and the event (``ready``) marking it done."""
    batch: Batch
    ready: Any

    def hand_over(self, device: torch.device) -> Batch:
        """The batch for the caller's stream: it waits for ``ready``; the memory outlives its use."""
        cur = torch.cuda.current_stream(device)
        cur.wait_event(self.ready)
        for t in self.batch.tensors():
            t.record_stream(cur)
        return self.batch
