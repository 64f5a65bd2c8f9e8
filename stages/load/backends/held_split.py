"""A decoded split held in memory for a loader: on the GPU where it fits the device's budget (a
batch is then a gather there, and nothing crosses PCIe but the indices), else in host RAM, pinned
once where that fits, each batch gathered straight into pinned memory so its uint8 pixels cross
PCIe without a second copy; on the CPU, plain numpy. What the ``memory`` backend holds after
decoding an artifact's split, and what ``ArrayLoader`` holds for arrays you pass it."""
from __future__ import annotations

import contextlib
import time
from typing import Callable

import numpy as np
import torch

from sluice.stages.load.backends.base import RawBatch, with_index
from sluice.stages.load.budget import device_free_bytes, device_placement, memory_budget
from sluice.stages.load.timings import Timings

# One batch: ``idx`` (``order[lo:hi]`` when ``whole``) -> (images, labels, indices)
Gather = Callable[[np.ndarray, int, int, bool], RawBatch]


class HeldSplit:
    """``images`` (uint8, any layout with samples first) and ``labels``, placed for ``device``."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, device: str | torch.device = "cpu", *,
                 max_bytes: int | None = None, device_budget_bytes: int | None = None,
                 timings: Timings | None = None):
        self.labels = labels
        self.device = with_index(device)
        self.timings = timings if timings is not None else Timings()
        # Where the split lives: a numpy array (CPU device, as always), a tensor on the GPU
        # (``resident``), or a host tensor gathered into pinned batches (``staged``).
        self.images: np.ndarray | torch.Tensor = images
        self.resident = self.staged = False
        self.held_labels: torch.Tensor | None = None  # the labels beside a resident split
        self.placement = ""  # where the split lives and why, for the loader's reason and profile
        if self.device.type == "cuda":
            self._place(images, max_bytes, device_budget_bytes)

    def _place(self, images: np.ndarray, max_bytes: int | None, device_budget_bytes: int | None) -> None:
        """On the GPU where it fits the device budget; else in host RAM, pinned where a pinned
        copy fits the host budget (it is made beside the decoded array, then replaces it)."""
        dev, need = self.device, images.nbytes + self.labels.nbytes
        with torch.cuda.device(dev):
            free = device_free_bytes(dev) if device_budget_bytes is None else None
            p = device_placement(need, free, device_budget_bytes)
            if p.on_device:
                t = time.perf_counter()
                self.images = torch.from_numpy(images).to(dev)
                self.held_labels = torch.tensor(self.labels, dtype=torch.int64, device=dev)
                torch.cuda.current_stream(dev).synchronize()
                self.timings.add("upload", time.perf_counter() - t)
                self.resident = True
                self.placement = f"split held on {dev}: {p.explain()}"
                return
            self.staged = True
            room = max_bytes - images.nbytes if max_bytes is not None else memory_budget().bytes
            host = torch.from_numpy(images)
            if images.nbytes > room:
                self.images, how = host, "in host RAM, not pinned (a pinned copy is over the host budget)"
            else:
                try:
                    self.images, how = host.pin_memory(), "in pinned host RAM"
                except RuntimeError as e:  # the driver may refuse to lock that much
                    self.images, how = host, f"in host RAM, not pinned ({e})"
            self.placement = f"split held {how}, batches gathered into pinned memory for {dev}: {p.explain()}"

    def gather(self, order: np.ndarray) -> Gather:
        """How one batch ``idx`` (``order[lo:hi]`` when ``whole``) is gathered, by where the split lives."""
        if self.resident:
            # The epoch's order crosses to the device once; a batch is a slice of it (or, where
            # damaged samples were dropped, its own few indices) and one gather there.
            images, labels = self.images, self.held_labels
            on = torch.as_tensor(order, dtype=torch.int64).to(images.device)

            def resident(idx: np.ndarray, lo: int, hi: int, whole: bool) -> RawBatch:
                i = on[lo:hi] if whole else torch.as_tensor(idx, dtype=torch.int64).to(images.device)
                return images[i], labels[i], i
            return resident
        if self.staged:
            images, cuda = self.images, self.device.type == "cuda"

            def staged(idx: np.ndarray, lo: int, hi: int, whole: bool) -> RawBatch:
                # Straight into pinned memory: the copy to the device needs no pinned copy of
                # its own, and PyTorch's pinned allocator reuses the block only after it is done.
                i = torch.as_tensor(idx, dtype=torch.int64)
                with torch.cuda.device(self.device) if cuda else contextlib.nullcontext():
                    out = torch.empty((len(i), *images.shape[1:]), dtype=images.dtype, pin_memory=cuda)
                torch.index_select(images, 0, i, out=out)
                return out, self.labels[idx], idx
            return staged
        return lambda idx, lo, hi, whole: (self.images[idx], self.labels[idx], idx)
