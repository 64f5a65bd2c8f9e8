"""The contracts between stages: what a batch is, and what the training loop needs from a loader,
a sampler and a selector.

They live below every stage so that loading and selection never depend on the trainer: the
loader yields :class:`Batch`, a selector returns :class:`SelectedBatch`, and the loop accepts
anything that honours :class:`ResumableLoader` and :class:`Selector` (``sluice.stages.load``'s
``Loader`` and ``ArrayLoader``, the selection methods, or a user's own).
"""
from __future__ import annotations

import dataclasses
from collections.abc import MutableMapping
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
class TokenInputs:
    """A batch of packed token rows as a model takes them: ``input_ids`` (B, L) int64,
    ``segment_ids`` (B, L) (the document's number within its row, -1 for padding: attention stays
    within a document) and ``position_ids`` (B, L) (each token's position within its document).
    Rows index and move together, so a selector treats it as it treats a batch of images."""
    input_ids: torch.Tensor
    segment_ids: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.input_ids.shape

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def __len__(self) -> int:
        return len(self.input_ids)

    def _each(self, fn: Any) -> "TokenInputs":
        return TokenInputs(*(fn(t) if t is not None else None
                             for t in (self.input_ids, self.segment_ids, self.position_ids)))

    def __getitem__(self, rows: Any) -> "TokenInputs":
        return self._each(lambda t: t[rows])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "TokenInputs":
        return self._each(lambda t: t.to(device, non_blocking=non_blocking))


class SelectionStats(MutableMapping):
    """A selector's statistics, whose values may be (0-dim) device tensors.

    Reading them would make selection wait for the device, so the training loop takes them as
    they are (``raw``), averages them on the device and reads them with its metrics record.
    Reading a value here (a script, a test) materialises every tensor at once, as floats.
    """

    def __init__(self, values: dict[str, float | torch.Tensor] | None = None):
        self._values: dict[str, float | torch.Tensor] = dict(values or {})

    def raw(self) -> dict[str, float | torch.Tensor]:
        """The values as given: floats and unread tensors."""
        return self._values

    def __getitem__(self, key: str) -> float:
        v = self._values[key]
        if isinstance(v, torch.Tensor):
            self._materialise()
        return self._values[key]

    def _materialise(self) -> None:
        keys = [k for k, v in self._values.items() if isinstance(v, torch.Tensor)]
        dev = self._values[keys[0]].device
        read = torch.stack([self._values[k].detach().reshape(()).to(dev, torch.float64)
                            for k in keys]).tolist()
        self._values.update(zip(keys, read))

    def __setitem__(self, key: str, value: float | torch.Tensor) -> None:
        self._values[key] = value

    def __delitem__(self, key: str) -> None:
        del self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"SelectionStats({self._values!r})"


def raw_stats(stats: Any) -> dict[str, float | torch.Tensor]:
    """A selector's statistics without reading any device tensor among them."""
    return stats.raw() if isinstance(stats, SelectionStats) else dict(stats)


@dataclasses.dataclass
class SelectedBatch:
    """What a selector returns: the samples to train on, optional per-sample loss weights
    (the loop then minimises ``(per_sample_loss * weights).mean()``), and statistics: floats or
    0-dim tensors (on any device), which the loop averages on the device and reads only with
    its metrics record (``log_every_steps``), so a selector need not wait for the device."""
    images: torch.Tensor
    labels: torch.Tensor
    indices: torch.Tensor
    weights: torch.Tensor | None = None
    stats: MutableMapping = dataclasses.field(default_factory=dict)


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
    methods the loop calls when present: ``observe(indices, losses)`` after every step, on
    every rank (loss tables, importance estimates; it may all-gather), with the losses left on
    the device: a loss that is NaN/inf (all of a step's, when any rank's loss was) must leave
    its entry unchanged, decided on the device, so the loop never waits to know; ``set_progress(fraction)`` before each selection with the fraction of
    the budget done; ``set_epoch(epoch)`` before each selection with the loop's epoch;
    ``state_dict()`` / ``load_state_dict()`` for the rank's checkpoint part. On token rows
    (``train.tasks.TokenTask``) indices are each token's document (``doc_keys``, (B, L), -1 where
    the token counts for nothing) and ``observe`` gets (B, L) per-token losses.
    """
    def __call__(self, model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor,
                 indices: torch.Tensor) -> SelectedBatch: ...
