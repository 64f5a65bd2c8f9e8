"""The loader's augment part: a backend's raw uint8 batches become tensors on the device,
augmented with draws seeded per (epoch, batch), so every backend and every resumed run augments
batch b of epoch e alike. On CUDA the copy and augmentation run on a side stream, overlapping
the caller's compute (``OnStream``); a backend that augments itself (DALI) yields its batches
finished."""
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


def device_batches(backend: Backend, order: np.ndarray, epoch: int, start: int, drop_last: bool, *,
                   batch_size: int, seed: int, resolution: int | None, device: torch.device,
                   augment: TorchAugment, timings: Timings) -> Iterator[Batch | OnStream]:
    """Batches of ``order`` from batch ``start`` on, on ``device`` and augmented; on CUDA each
    comes as an ``OnStream`` for the caller to ``hand_over``. ``transfer`` and ``augment``
    seconds go to ``timings``."""
    if backend.augments:  # DALI: augmentation and transfer happen inside, with the same draws
        yield from (Batch(*b) for b in backend.epoch(order, batch_size, drop_last, start,
                                                     resolution=resolution, epoch=epoch))
        return
    pin = device.type == "cuda"
    stream = torch.cuda.Stream(device) if pin else None
    b = start
    for imgs, labels, idx in backend.epoch(order, batch_size, drop_last, start):
        with torch.cuda.stream(stream) if pin else contextlib.nullcontext():
            t = time.perf_counter()
            x = torch.as_tensor(imgs)
            y = torch.as_tensor(labels, dtype=torch.int64)
            i = torch.as_tensor(idx, dtype=torch.int64)
            if pin:
                x = x.pin_memory().to(device, non_blocking=True)
                y = y.pin_memory().to(device, non_blocking=True)
                i = i.pin_memory().to(device, non_blocking=True)
            t1 = time.perf_counter()
            timings.add("transfer", t1 - t)
            # Seeded per (epoch, batch), as on every backend: a resumed run augments its
            # batches exactly as before.
            augment.reseed(batch_seed(seed, epoch, b))
            x = augment(x, resolution)
            timings.add("augment", time.perf_counter() - t1)
        b += 1
        batch = Batch(x, y, i)
        yield batch if stream is None else OnStream(batch, stream.record_event())


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
