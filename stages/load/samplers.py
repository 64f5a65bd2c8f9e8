"""Samplers decide the order; loader backends follow it.

A sampler turns (split size, scores, epoch, seed) into the global index sequence of one epoch,
always of the same length, and ``partition`` gives each rank a disjoint, equal-length slice of it.
Uneven epochs are made even explicitly: ``pad`` repeats the first few indices of the epoch so
every sample is seen; ``drop`` leaves the last few out of this epoch (a different few each epoch
for shuffling samplers).
"""
from __future__ import annotations

import math
import os
from typing import Callable, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from sluice.errors import LoaderError
from sluice.stages.contracts import Sampler
from sluice.stages.load.epochs import pad_to_world


def partition(order: np.ndarray, rank: int, world_size: int, mode: Literal["pad", "drop"] = "pad") -> np.ndarray:
    """This rank's strided slice of the epoch, equal in length on every rank."""
    if not 0 <= rank < world_size:
        raise LoaderError(f"rank {rank} is outside world size {world_size}")
    return np.ascontiguousarray(pad_to_world(order, world_size, mode)[rank::world_size])


def _rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch])


class SequentialSampler:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def epoch_order(self, epoch: int) -> np.ndarray:
        return np.arange(self.n, dtype=np.int64)


class ShuffleSampler:
    """A fresh uniform permutation each epoch, the same on every rank for the same seed."""

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed = n, seed

    def __len__(self) -> int:
        return self.n

    def epoch_order(self, epoch: int) -> np.ndarray:
        return _rng(self.seed, epoch).permutation(self.n).astype(np.int64)


class ShardBlockSampler:
    """Shuffle for streaming: the shards in a random order, then the samples of each window of
    ``window`` consecutive shards shuffled together. A reader needs only ``window`` shards at a
    time and reads each shard whole, once per epoch (object storage, datasets beyond memory);
    ``window`` = all shards is the global shuffle. Every sample appears once per epoch."""

    def __init__(self, shard_sizes: list[int] | np.ndarray, window: int = 4, seed: int = 0):
        sizes = np.asarray(shard_sizes, dtype=np.int64)
        if sizes.ndim != 1 or len(sizes) == 0 or (sizes < 0).any():
            raise LoaderError(f"shard_block needs the split's shard sizes, got {sizes!r}")
        if window < 1:
            raise LoaderError(f"shard_block window must be >= 1 shard, got {window}")
        self.starts = np.concatenate([[0], np.cumsum(sizes)])
        self.n, self.window, self.seed = int(self.starts[-1]), window, seed

    def __len__(self) -> int:
        return self.n

    def epoch_order(self, epoch: int) -> np.ndarray:
        rng = _rng(self.seed, epoch)
        shards = rng.permutation(len(self.starts) - 1)
        parts = []
        for w in range(0, len(shards), self.window):
            block = np.concatenate([np.arange(self.starts[s], self.starts[s + 1]) for s in shards[w:w + self.window]])
            parts.append(rng.permutation(block))
        return np.concatenate(parts).astype(np.int64)


class WeightedSampler:
    """Samples drawn in proportion to ``weights``: with replacement (``num_samples`` draws), or
    without (every sample once, heavier ones earlier: Efraimidis–Spirakis keys)."""

    def __init__(self, weights: np.ndarray, replacement: bool = True, num_samples: int | None = None, seed: int = 0):
        w = np.asarray(weights, dtype=np.float64)
        if w.ndim != 1 or len(w) == 0:
            raise LoaderError(f"weights must be a non-empty 1-D array, got shape {w.shape}")
        if not np.isfinite(w).all() or (w < 0).any():
            raise LoaderError("weights must be finite and non-negative")
        if w.sum() <= 0:
            raise LoaderError("weights sum to zero")
        if not replacement and num_samples not in (None, len(w)):
            raise LoaderError("without replacement an epoch holds every sample once: leave num_samples unset")
        self.weights, self.replacement, self.seed = w, replacement, seed
        self.num_samples = num_samples or len(w)

    def __len__(self) -> int:
        return self.num_samples

    def set_weights(self, weights: np.ndarray) -> None:
        """Importance sampling updates the weights between epochs."""
        if len(weights) != len(self.weights):
            raise LoaderError(f"{len(weights)} weights for a split of {len(self.weights)} samples")
        self.weights = np.asarray(weights, dtype=np.float64)

    def epoch_order(self, epoch: int) -> np.ndarray:
        rng = _rng(self.seed, epoch)
        p = self.weights / self.weights.sum()
        if self.replacement:
            return rng.choice(len(p), size=self.num_samples, replace=True, p=p).astype(np.int64)
        u = rng.random(len(p))
        with np.errstate(divide="ignore"):
            keys = np.where(p > 0, np.log(u) / p, -np.inf)
        return np.argsort(-keys, kind="stable").astype(np.int64)


PACINGS = ("linear", "root", "geometric")


def pacing_fraction(kind: str, step: int, total_steps: int, start: float, growth: float = 2.0) -> float:
    """The fraction of the easiest data available at ``step`` (Hacohen & Weinshall 2019).

    linear: start → 1 over ``total_steps``; root: sqrt-shaped, fast early; geometric: start,
    then ×``growth`` every ``total_steps / log_growth(1/start)`` steps (a step function).
    """
    if total_steps <= 0:
        return 1.0
    t = min(max(step, 0) / total_steps, 1.0)
    if kind == "linear":
        f = start + (1 - start) * t
    elif kind == "root":
        f = math.sqrt(start ** 2 + (1 - start ** 2) * t)
    elif kind == "geometric":
        n_steps = max(1, math.ceil(math.log(1 / start, growth)))
        f = start * growth ** math.floor(t * n_steps)
    else:
        raise LoaderError(f"unknown pacing {kind!r}; use one of {PACINGS}")
    return min(1.0, f)


class CurriculumSampler:
    """Easiest first: each global batch is drawn from the easiest ``pacing(t)`` fraction.

    ``difficulty`` is a per-sample array (lower = easier) or a callable returning one.
    ``batch_size`` is the global batch (per-rank batch × world size), so every rank's step t
    draws from the same pool. ``anti=True`` reverses the order (hardest first).
    """

    def __init__(self, difficulty: np.ndarray | Callable[[], np.ndarray], batch_size: int, ramp_steps: int,
                 pacing: str = "linear", start_fraction: float = 0.2, growth: float = 2.0,
                 anti: bool = False, seed: int = 0):
        d = np.asarray(difficulty() if callable(difficulty) else difficulty, dtype=np.float64)
        if d.ndim != 1 or not len(d):
            raise LoaderError(f"difficulty must be a non-empty 1-D array, got shape {d.shape}")
        if not np.isfinite(d).all():
            raise LoaderError("difficulty scores contain NaN or inf")
        if pacing not in PACINGS:
            raise LoaderError(f"unknown pacing {pacing!r}; use one of {PACINGS}")
        if not 0 < start_fraction <= 1:
            raise LoaderError("start_fraction must be in (0, 1]")
        self.rank_order = np.argsort(-d if anti else d, kind="stable").astype(np.int64)
        self.n, self.batch_size, self.ramp_steps = len(d), batch_size, ramp_steps
        self.pacing, self.start, self.growth, self.seed = pacing, start_fraction, growth, seed

    def __len__(self) -> int:
        return self.n

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.n / self.batch_size)

    def fraction(self, step: int) -> float:
        return pacing_fraction(self.pacing, step, self.ramp_steps, self.start, self.growth)

    def epoch_order(self, epoch: int) -> np.ndarray:
        rng = _rng(self.seed, epoch)
        out = np.empty(self.n, np.int64)
        for b in range(self.steps_per_epoch):
            lo, hi = b * self.batch_size, min((b + 1) * self.batch_size, self.n)
            pool = max(hi - lo, int(round(self.fraction(epoch * self.steps_per_epoch + b) * self.n)))
            pool = min(pool, self.n)
            out[lo:hi] = self.rank_order[rng.choice(pool, hi - lo, replace=False)]
        return out


class ResolutionSchedule(BaseModel):
    """Progressive resizing: low resolution early, full resolution for the final epochs.

    Resolution rises linearly from ``start`` (at ``start_epoch``) to ``end`` (at ``end_epoch``),
    rounded down to a multiple of ``multiple``; from ``end_epoch`` on it is ``end``.
    """
    model_config = ConfigDict(extra="forbid")
    start: int = Field(16, ge=4)
    end: int = Field(28, ge=4)
    start_epoch: int = Field(0, ge=0)
    end_epoch: int = Field(3, ge=0)
    multiple: int = Field(4, ge=1)

    @model_validator(mode="after")
    def _check(self) -> "ResolutionSchedule":
        if self.end < self.start:
            raise ValueError("resolution end must be >= start (low to high)")
        if self.end_epoch < self.start_epoch:
            raise ValueError("end_epoch must be >= start_epoch")
        return self

    def at(self, epoch: int) -> int:
        if epoch >= self.end_epoch:
            return self.end
        if epoch <= self.start_epoch:
            t = 0.0
        else:
            t = (epoch - self.start_epoch) / (self.end_epoch - self.start_epoch)
        r = self.start + t * (self.end - self.start)
        return max(self.start, int(r // self.multiple * self.multiple))


class SubsetSampler:
    """Another sampler's order over a subset of the split (e.g. a warm start's new samples plus
    its replay): the inner sampler orders positions in ``subset``, which map to split indices,
    so per-sample state stays aligned to the split index."""

    def __init__(self, inner: Sampler, subset: np.ndarray):
        self.inner, self.subset = inner, subset

    def __len__(self) -> int:
        return len(self.inner)

    def epoch_order(self, epoch: int) -> np.ndarray:
        return self.subset[self.inner.epoch_order(epoch)]


class LiveSampler:
    """Another sampler's order with the removed indices dropped: for ``shard_block`` (whose
    blocks follow the shards' index ranges, so it orders the whole split first) and for a
    caller's own sampler. Its length is that of epoch 0's filtered order (a permutation's:
    the live count)."""

    def __init__(self, inner: Sampler, live: np.ndarray, n: int):
        self.inner, self.mask = inner, np.zeros(n, bool)
        self.mask[live] = True
        first = inner.epoch_order(0)
        self.n = int(self.mask[first].sum())

    def __len__(self) -> int:
        return self.n

    def epoch_order(self, epoch: int) -> np.ndarray:
        order = self.inner.epoch_order(epoch)
        return order[self.mask[order]]


def load_subset(path: str, n: int) -> np.ndarray:
    """Split indices to draw from: distinct, in range, sorted, not empty."""
    if not os.path.exists(path):
        raise LoaderError(f"sampler subset file not found: {path}")
    arr = np.load(path, allow_pickle=False)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise LoaderError(f"sampler subset {path} must be a non-empty 1-d array of split indices; "
                          f"got {arr.dtype} {arr.shape}")
    sub = np.unique(arr.astype(np.int64))
    if sub.size != arr.size or sub[0] < 0 or sub[-1] >= n:
        raise LoaderError(f"sampler subset {path} has repeated indices or indices outside the split's "
                          f"0..{n - 1}")
    return sub


class SamplerConfig(BaseModel):
    """How the loader orders each epoch; arrays come from a .npy path or the Python call."""
    model_config = ConfigDict(extra="forbid")
    kind: Literal["sequential", "shuffle", "shard_block", "weighted", "curriculum"] = "shuffle"
    seed: int = 0
    window: int = Field(4, ge=1, description="shard_block: shards shuffled together (held at once)")
    partition: Literal["pad", "drop"] = "pad"
    scores: str | None = Field(None, description=".npy file of per-sample weights or difficulty (split-aligned)")
    replacement: bool = True
    num_samples: int | None = None
    pacing: Literal["linear", "root", "geometric"] = "linear"
    start_fraction: float = Field(0.2, gt=0, le=1)
    growth: float = Field(2.0, gt=1)
    ramp_epochs: float = Field(1.0, gt=0, description="curriculum reaches all data after this many epochs")
    anti: bool = False
    subset: str | None = Field(None, description=".npy of split indices: draw only these (a warm start's "
                               "new samples and replay); the epoch is the subset")


def load_scores(path: str, n: int, what: str) -> np.ndarray:
    if not os.path.exists(path):
        raise LoaderError(f"{what} file not found: {path}")
    arr = np.load(path, allow_pickle=False)
    if arr.ndim != 1 or len(arr) != n:
        raise LoaderError(f"{what} in {path} has shape {arr.shape}; the split has {n} samples")
    return arr


def build_sampler(cfg: SamplerConfig, n: int, global_batch: int, scores: np.ndarray | None = None,
                  shard_sizes: list[int] | None = None, live: np.ndarray | None = None) -> Sampler:
    """The sampler for a split of ``n`` samples; ``scores`` overrides ``cfg.scores``;
    ``shard_sizes`` (samples per shard, in split-index order) is what ``shard_block`` needs;
    ``live`` (sorted split indices) are the only ones it may yield: a version that removed
    samples (``SplitRecord.removed``) keeps their indices, and no order ever holds them."""
    if n == 0:
        raise LoaderError("the split is empty: nothing to sample")
    if live is not None and live.size < n:
        if live.size == 0:
            raise LoaderError("every sample of the split was removed: nothing to sample")
        if cfg.kind == "shard_block":
            return LiveSampler(build_sampler(cfg, n, global_batch, scores, shard_sizes), live, n)
        sub = live
        if cfg.subset:
            sub = np.intersect1d(load_subset(cfg.subset, n), live)
            if sub.size == 0:
                raise LoaderError(f"every index of the sampler subset {cfg.subset} was removed from the split")
        return _over_subset(cfg, n, global_batch, scores, sub)
    if cfg.subset:
        if cfg.kind in ("shard_block", "curriculum"):
            raise LoaderError(f"the {cfg.kind} sampler orders the whole split; a subset needs sequential, "
                              "shuffle or weighted")
        return _over_subset(cfg, n, global_batch, scores, load_subset(cfg.subset, n))
    if cfg.kind == "shard_block":
        if not shard_sizes or sum(shard_sizes) != n:
            raise LoaderError(f"the shard_block sampler needs the split's shard sizes summing to {n}; "
                              f"got {shard_sizes} (re-shard with the webdataset format)")
        return ShardBlockSampler(shard_sizes, cfg.window, cfg.seed)
    if cfg.kind in ("weighted", "curriculum"):
        if scores is None:
            if not cfg.scores:
                raise LoaderError(f"the {cfg.kind} sampler needs per-sample scores (sampler.scores or an array)")
            scores = load_scores(cfg.scores, n, "scores")
        scores = np.asarray(scores)
        if scores.ndim != 1 or len(scores) != n:
            raise LoaderError(f"scores have shape {scores.shape}; the split has {n} samples")
    if cfg.kind == "sequential":
        return SequentialSampler(n)
    if cfg.kind == "shuffle":
        return ShuffleSampler(n, cfg.seed)
    if cfg.kind == "weighted":
        return WeightedSampler(scores, cfg.replacement, cfg.num_samples, cfg.seed)
    ramp = max(1, int(cfg.ramp_epochs * math.ceil(n / global_batch)))
    return CurriculumSampler(scores, global_batch, ramp, cfg.pacing, cfg.start_fraction, cfg.growth,
                             cfg.anti, cfg.seed)


def _over_subset(cfg: SamplerConfig, n: int, global_batch: int, scores: np.ndarray | None,
                 sub: np.ndarray) -> Sampler:
    """The configured sampler over the split indices ``sub`` (their scores, in their order)."""
    if cfg.kind == "shard_block":
        raise LoaderError("the shard_block sampler orders the whole split; a subset needs sequential, "
                          "shuffle, weighted or curriculum")
    if scores is None and cfg.scores:
        scores = load_scores(cfg.scores, n, "scores")
    inner_cfg = cfg.model_copy(update={"subset": None, "scores": None})
    inner = build_sampler(inner_cfg, sub.size, global_batch, None if scores is None else np.asarray(scores)[sub])
    return SubsetSampler(inner, sub)
