"""An in-memory loader over numpy arrays that honours the training loop's loader contract.

Used by tests, benchmarks and notebooks: each epoch's order comes from the same samplers the
artifact ``Loader`` uses (a seeded permutation, the same on every rank, or the natural order),
split into disjoint per-rank shards by the same ``partition``, so DDP ranks always run the same
number of steps. With ``drop_last=False`` the order is padded by repeating its first indices
(like ``DistributedSampler``) so nothing is dropped; with ``even=False`` (evaluation) shards are
``order[rank::world]`` without padding. ``state_dict()`` is the epoch position
(``epochs.EpochCursor``): it resumes at the exact next batch, or — at another world size or
batch — with the rest of the epoch. The arrays are held as the ``memory`` backend holds a decoded
split (``backends.held_split.HeldSplit``): with a CUDA ``device``, on the GPU where they fit, else pinned.
With ``normalize`` (mean and std, as the ``normalize`` augmentation op takes them) the batches
are model-ready floats, ``(x/255 − mean) / std`` (``pixels.normalize_uint8``), made where the
arrays are held.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from sluice.errors import ArtifactError, LoaderError
from sluice.stages.contracts import Batch
from sluice.stages.data.sources.idx import read_idx
from sluice.stages.load.augment.normalize import Normalize
from sluice.stages.load.base import LoaderBase, as_device
from sluice.stages.load.epochs import EpochCursor
from sluice.stages.load.backends.held_split import HeldSplit
from sluice.stages.load.samplers import SequentialSampler, ShuffleSampler
from sluice.stages.load.timings import Timings
from sluice.stages.pixels import channel_values, normalize_uint8
from sluice.storage.artifact import DatasetArtifact, open_artifact
from sluice.stages.host import usable_cores


class _UnevenCursor:
    """An evaluation's place in its epochs when ranks take ``order[rank::world]`` unpadded
    (their batch counts may differ by one): the same moves as ``epochs.EpochCursor``."""

    def __init__(self, n: int, rank: int, world: int, batch: int):
        self.n_batches = -(-len(range(rank, n, world)) // batch)
        self.epoch, self.next_batch = 0, 0

    def batches(self) -> int:
        return self.n_batches

    def restart(self, epoch: int) -> None:
        self.epoch, self.next_batch = int(epoch), 0

    def iteration_start(self) -> tuple[int, int]:
        if self.next_batch >= self.n_batches:
            self.restart(self.epoch + 1)
        return self.epoch, self.next_batch

    def advance(self) -> None:
        self.next_batch += 1

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "next_batch": self.next_batch}

    def load_state_dict(self, state: dict[str, Any], world: int, batch: int) -> None:
        self.epoch, self.next_batch = int(state["epoch"]), int(state["next_batch"])


class ArrayLoader(LoaderBase):
    """Batches of NHWC uint8 arrays as ``contracts.Batch``: images NCHW float, normalised by
    ``normalize``'s mean and std (default 0.5 and 0.5: pixels to [-1, 1]; None: the uint8 pixels
    as they are), labels int64, indices int64."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, batch_size: int,
                 shuffle: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1,
                 drop_last: bool = True, even: bool = True, delay_s: float = 0.0,
                 device: str | torch.device = "cpu",
                 normalize: Normalize | dict | None = Normalize(mean=[0.5], std=[0.5])):
        if images.ndim == 3:  # N H W -> N H W 1
            images = images[..., None]
        if images.ndim != 4:
            raise LoaderError(f"images must be NHWC (or NHW), got shape {images.shape}")
        if len(images) != len(labels):
            raise LoaderError(f"{len(images)} images but {len(labels)} labels")
        if batch_size < 1:
            raise LoaderError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise LoaderError(f"rank {rank} outside world of size {world_size}")
        self.device = as_device(device)
        self.names = ["arrays"]
        # NCHW once, so batches are cheap slices
        nchw = np.array(images.transpose(0, 3, 1, 2), order="C")
        self.held = HeldSplit(nchw, np.asarray(labels, dtype=np.int64), self.device)
        n = len(labels)
        self.sampler = ShuffleSampler(n, seed) if shuffle else SequentialSampler(n)
        self.batch_size, self.seed = batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.drop_last, self.even = drop_last, even
        self.delay_s = delay_s  # simulated storage latency per batch (stall measurements)
        norm = Normalize.model_validate(normalize) if isinstance(normalize, dict) else normalize
        c = nchw.shape[1]
        self.normalize = None if norm is None else (channel_values(norm.mean, c, self.held.device, "normalize.mean"),
                                                    channel_values(norm.std, c, self.held.device, "normalize.std"))
        self.timings = Timings()
        self.cursor = EpochCursor(lambda epoch, _g: self.sampler.epoch_order(epoch), n, rank=rank,
                                  world=world_size, batch=batch_size, drop_last=drop_last,
                                  mode="drop" if drop_last else "pad") if even else \
            _UnevenCursor(n, rank, world_size, batch_size)
        if len(self) == 0:
            raise LoaderError(f"{n} samples give no batch of {batch_size} per rank with "
                              f"{world_size} ranks")

    @property
    def position(self) -> int:
        """Batches already served in this epoch."""
        return self.cursor.next_batch

    def _shard(self, epoch: int) -> np.ndarray:
        if self.even:
            return self.cursor.rank_order(epoch)[0]
        return self.sampler.epoch_order(epoch)[self.rank::self.world_size]

    def _produce(self, epoch: int, start: int) -> Iterator[Batch]:
        idx = self._shard(epoch).astype(np.int64)
        gather = self.held.gather(idx)
        while self.position < len(self):
            b = self.position
            lo, hi = b * self.batch_size, min((b + 1) * self.batch_size, len(idx))
            if self.delay_s:
                time.sleep(self.delay_s)
            self.cursor.advance()
            x, y, i = gather(idx[lo:hi], lo, hi, True)
            x = torch.as_tensor(x)
            if self.normalize is not None:
                x = normalize_uint8(x, *self.normalize)
            yield Batch.of_images(x, torch.as_tensor(y), torch.as_tensor(i))

    def state_dict(self) -> dict[str, Any]:
        return {**self.cursor.state_dict(), "position": self.position, "seed": self.seed,
                "world_size": self.world_size, "rank": self.rank, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the exact next batch (at another world size: the rest of the epoch);
        refuses a state from another seed (another order)."""
        if "seed" in state and state["seed"] != self.seed:
            raise LoaderError(f"loader state has seed={state['seed']}, this loader {self.seed}")
        state = {"next_batch": state.get("position"), **state}
        self.cursor.load_state_dict(state, world=int(state.get("world_size", self.world_size)),
                                    batch=int(state.get("batch_size", self.batch_size)))


def named_arrays(path: str) -> tuple[np.ndarray, np.ndarray]:
    """``images``/``labels`` from an ``.npz`` (no pickles), or ``fashion-mnist:train|test``."""
    if path.startswith("fashion-mnist:"):
        return fashion_mnist(path.split(":", 1)[1])
    try:
        with np.load(path, allow_pickle=False) as z:
            if "images" not in z or "labels" not in z:
                raise LoaderError(f"{path} must hold arrays 'images' and 'labels', has {list(z)}")
            return z["images"], z["labels"]
    except (OSError, ValueError) as e:
        raise LoaderError(f"cannot read arrays from {path}: {e}") from None


def fashion_mnist(split: str = "train", root: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST from its gz IDX files (in ``root``, default ``data.ingest.fashion_mnist_dir()``):
    uint8 (N, 28, 28) and int64 labels."""
    if root is None:
        from sluice.stages.data.ingest import fashion_mnist_dir
        root = fashion_mnist_dir()
    prefix = {"train": "train", "test": "t10k"}.get(split)
    if prefix is None:
        raise LoaderError(f"fashion-mnist split must be 'train' or 'test', got {split!r}")
    r = Path(root)
    return (read_idx(r / f"{prefix}-images-idx3-ubyte.gz"),
            read_idx(r / f"{prefix}-labels-idx1-ubyte.gz").astype(np.int64))


def split_arrays(artifact: str | os.PathLike | DatasetArtifact, split: str,
                 live_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The whole split as (uint8 NHWC images, int64 labels), index-aligned: for scorers such as
    the irreducible-loss model that want every sample at once. ``live_only``: without the
    samples a later version removed (what a model may train on; no longer index-aligned)."""
    art = artifact if isinstance(artifact, DatasetArtifact) else open_artifact(artifact)
    if split in art.manifest.splits and art.manifest.split(split).count == 0:
        raise ArtifactError(f"split {split!r} of {art.root} is empty" + (
            " (shard with prepare.ingest.holdout_fraction > 0 for a holdout)" if split == "holdout" else ""))
    be = _memory_backend()(art, split, usable_cores())
    if live_only and art.manifest.split(split).removed:
        live = art.live(split)
        return be.held.images[live], be.labels[live]
    return be.held.images, be.labels


def _memory_backend():
    from sluice.stages.load.backends import LOADER_BACKENDS
    return LOADER_BACKENDS.get("memory")
