"""An in-memory loader over numpy arrays that honours the train loop's loader contract.

Used by tests, benchmarks and notebooks (and as the reference for ``sluice.stages.load.loader``): each
epoch is one seeded permutation (same on every rank), split into disjoint per-rank shards of
equal length, so DDP ranks always run the same number of steps. With ``drop_last=False`` the
permutation is padded by wrapping around (like ``DistributedSampler``) so nothing is dropped;
with ``even=False`` (evaluation) shards are ``perm[rank::world]`` without padding.
``state_dict()`` is (epoch, batches served), which resumes at the exact next batch.
"""
from __future__ import annotations

import math
import time
from typing import Any, Iterator

import numpy as np
import torch


class ArrayLoader:
    """Batches ``(images NCHW uint8, labels int64, indices int64)`` from NHWC uint8 arrays."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, batch_size: int,
                 shuffle: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1,
                 drop_last: bool = True, even: bool = True, delay_s: float = 0.0):
        if images.ndim == 3:  # N H W -> N H W 1
            images = images[..., None]
        if images.ndim != 4:
            raise ValueError(f"images must be NHWC (or NHW), got shape {images.shape}")
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of size {world_size}")
        # NCHW once, so batches are cheap slices
        self.images = torch.from_numpy(np.array(images.transpose(0, 3, 1, 2), order="C"))
        self.labels = torch.from_numpy(np.asarray(labels, dtype=np.int64))
        self.batch_size = batch_size
        self.shuffle, self.seed = shuffle, seed
        self.rank, self.world_size = rank, world_size
        self.drop_last, self.even = drop_last, even
        self.delay_s = delay_s  # simulated storage latency per batch (stall measurements)
        self.epoch = 0
        self.position = 0  # batches already served in this epoch
        if len(self) == 0:
            raise ValueError(f"{len(images)} samples give no batch of {batch_size} per rank "
                             f"with {world_size} ranks")

    def _shard(self) -> np.ndarray:
        n = len(self.labels)
        if self.shuffle:
            perm = np.random.default_rng([self.seed, self.epoch]).permutation(n)
        else:
            perm = np.arange(n)
        if not self.even:
            return perm[self.rank::self.world_size]
        per_rank = n // self.world_size if self.drop_last else math.ceil(n / self.world_size)
        if self.drop_last:
            per_rank = per_rank // self.batch_size * self.batch_size
        total = per_rank * self.world_size
        if total > n:
            perm = np.concatenate([perm, np.resize(perm, total - n)])
        return perm[:total][self.rank::self.world_size]

    def _per_rank(self) -> int:
        n = len(self.labels)
        if not self.even:
            return len(range(self.rank, n, self.world_size))
        per = n // self.world_size if self.drop_last else math.ceil(n / self.world_size)
        return per // self.batch_size * self.batch_size if self.drop_last else per

    def __len__(self) -> int:
        per = self._per_rank()
        return per // self.batch_size if self.drop_last else math.ceil(per / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first batch (a new permutation)."""
        self.epoch, self.position = int(epoch), 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        idx = self._shard()
        while self.position < len(self):
            b = self.position
            sel = torch.from_numpy(idx[b * self.batch_size:(b + 1) * self.batch_size].astype(np.int64))
            if self.delay_s:
                time.sleep(self.delay_s)
            self.position += 1
            yield self.images[sel], self.labels[sel], sel

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "world_size": self.world_size, "rank": self.rank}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the exact next batch; refuses a state from another sharding."""
        for k in ("seed", "world_size"):
            if k in state and state[k] != getattr(self, k):
                raise ValueError(f"loader state has {k}={state[k]}, this loader {getattr(self, k)}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def load_arrays(path: str) -> tuple[np.ndarray, np.ndarray]:
    """``images``/``labels`` from an ``.npz`` (or ``fashion-mnist:train|test``)."""
    if path.startswith("fashion-mnist:"):
        return fashion_mnist(path.split(":", 1)[1])
    with np.load(path) as z:
        if "images" not in z or "labels" not in z:
            raise ValueError(f"{path} must hold arrays 'images' and 'labels', has {list(z)}")
        return z["images"], z["labels"]


def fashion_mnist(split: str = "train",
                  root: str = "/usr/share/datasets/fashion-mnist") -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST from its gz IDX files: uint8 (N, 28, 28) and int64 labels."""
    from pathlib import Path

    from sluice.stages.data.ingest import read_idx
    prefix = {"train": "train", "test": "t10k"}.get(split)
    if prefix is None:
        raise ValueError(f"fashion-mnist split must be 'train' or 'test', got {split!r}")
    r = Path(root)
    return (read_idx(r / f"{prefix}-images-idx3-ubyte.gz"),
            read_idx(r / f"{prefix}-labels-idx1-ubyte.gz").astype(np.int64))
