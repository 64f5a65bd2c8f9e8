"""The loader's augment part: a backend's raw uint8 batches become tensors on the device,
augmented with draws seeded per (epoch, batch), so every backend and every resumed run augments
batch b of epoch e alike. On CUDA the copy and augmentation run on a side stream, overlapping
the caller's compute (``OnStream``); a backend that augments itself (DALI) yields its batches
finished. A backend may hand over batches already on the device (the memory backend's split
held on the GPU) or in pinned memory; either way no float32 crosses PCIe."""
from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator, NamedTuple

import numpy as np
import torch

from sluice.errors import LoaderError
from sluice.stages.contracts import Batch
from sluice.stages.load.augment import TorchAugment, batch_seed
from sluice.stages.load.backends import Backend, Timings
from sluice.stages.load.backends.base import with_index
from sluice.stages.load.config import LoaderConfig
from sluice.storage.artifact import DatasetArtifact


def check_resolution(config: LoaderConfig, artifact: DatasetArtifact) -> None:
    """Refuse, before anything is read, a resolution or crop size above the stored images'."""
    shape = artifact.manifest.fields.image.shape
    wanted = [config.resolution.end] if config.resolution else []
    if config.augment:
        wanted += [op.size for op in config.augment.ops if getattr(op, "size", None) and op.op == "random_resized_crop"]
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


def device_batches(backend: Backend, order: np.ndarray, epoch: int, start: int, drop_last: bool, *,
                   batch_size: int, seed: int, resolution: int | None, device: torch.device,
                   augment: TorchAugment, timings: Timings) -> Iterator[Batch | OnStream]:
    """Batches of ``order`` from batch ``start`` on, on ``device`` and augmented; on CUDA each
    comes as an ``OnStream`` for the caller to ``hand_over``. ``transfer`` and ``augment``
    seconds go to ``timings``. On CUDA the backend's own work for a batch (a gather on the
    GPU, a gather into pinned memory) runs on the side stream too; only uint8 crosses PCIe."""
    if backend.augments:  # DALI: augmentation and transfer happen inside, with the same draws
        yield from (Batch(*b) for b in backend.epoch(order, batch_size, drop_last, start,
                                                     resolution=resolution, epoch=epoch))
        return
    device = with_index(device)
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
            x = augment(x, resolution)
            timings.add("augment", time.perf_counter() - t1)
            ready = stream.record_event() if cuda else None
        b += 1
        batch = Batch(x, y, i)
        yield batch if ready is None else OnStream(batch, ready)


class OnStream(NamedTuple):
    """A CUDA batch made on the loader's side stream, and the event (``ready``) marking it done."""
    batch: Batch
    ready: Any

    def hand_over(self, device: torch.device) -> Batch:
        """The batch for the caller's stream: it waits for ``ready``; the memory outlives its use."""
        cur = torch.cuda.current_stream(device)
        cur.wait_event(self.ready)
        for t in self.batch:
            t.record_stream(cur)
        return self.batch
