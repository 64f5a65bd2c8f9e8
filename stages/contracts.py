"""The contracts between stages: what a batch is, and what the training loop needs from a loader,
a sampler and a selector.

They live below every stage so that loading and selection never depend on the trainer: the
loader yields :class:`Batch`, a selector returns :class:`SelectedBatch`, and the loop accepts
anything that honours :class:`ResumableLoader` and :class:`Selector` (``sluice.stages.load``'s
``Loader`` and ``ArrayLoader``, the selection methods, or a user's own).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator, NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch


class Batch(NamedTuple):
    """One batch: images (uint8 NCHW, or float NCHW already augmented and normalised), int64
    labels and int64 indices — each sample's stable index within its split."""
    images: torch.Tensor
    labels: torch.Tensor
    indices: torch.Tensor


@dataclasses.dataclass
class SelectedBatch:
    """What a selector returns: the samples to train on, optional per-sample loss weights
    (the loop then minimises ``(per_sample_loss * weights).mean()``), and statistics."""
    images: torch.Tensor
    labels: torch.Tensor
    indices: torch.Tensor
    weights: torch.Tensor | None = None
    stats: dict[str, float] = dataclasses.field(default_factory=dict)


@runtime_checkable
class ResumableLoader(Protocol):
    """What the training loop needs from a loader.

    Iterating yields :class:`Batch`-shaped tuples; ``len`` is the batches per epoch on this rank
    (equal on every rank); ``state_dict`` resumes mid-epoch at exactly the next batch. Sluice's
    loaders also resume another world size's state (``load.epochs``: the rest of the epoch,
    re-cut), which ``train.resize`` relies on.
    """
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]: ...
    def __len__(self) -> int: ...
    def set_epoch(self, epoch: int) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Sampler(Protocol):
    """The order of one epoch: the same global sequence on every rank for the same epoch."""
    def __len__(self) -> int: ...
    def epoch_order(self, epoch: int) -> np.ndarray: ...


@runtime_checkable
class Selector(Protocol):
    """``selector(model, images, labels, indices) -> SelectedBatch``: picks what to train on.

    Images are on the model's device, float and normalised; indices are split indices. Optional
    methods the loop calls when present: ``observe(indices, losses)`` after every step whose
    losses were finite on all ranks (loss tables, importance estimates; it may all-gather, so
    every rank calls it); ``set_progress(fraction)`` before each selection with the fraction of
    the budget done; ``state_dict()`` / ``load_state_dict()`` for the rank's checkpoint part.
    """
    def __call__(self, model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor,
                 indices: torch.Tensor) -> SelectedBatch: ...
