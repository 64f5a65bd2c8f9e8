"""The contracts between stages: what a batch is, and what the training loop needs from a loader,
a sampler and a selector.

They live below every stage so that loading and selection never depend on the trainer: every
loader yields one typed :class:`Batch` (images and token rows alike), a selector returns
:class:`SelectedBatch`, and the loop accepts anything that honours :class:`ResumableLoader` and
:class:`Selector` (``sluice.stages.load``'s loaders, the selection methods, or a user's own).
"""
from __future__ import annotations

import dataclasses
from collections.abc import MutableMapping
from typing import Any, Iterator, Protocol, runtime_checkable

import numpy as np
import torch


@dataclasses.dataclass
class Batch:
    """One model-ready batch, whatever the kind of data: what every loader yields and what the
    trainer reads, by field (never by probing).

    ``inputs``: the model's inputs by name. Images: ``{"images": float NCHW}``, normalised by the
    loader (uint8 only where the loader was given no normalisation: a plain loop may normalise
    itself, the trainer refuses it). Token rows: ``{"input_ids": (B, L) int64}`` plus the
    per-token fields the loader was asked for (``segment_ids``, ``position_ids``).
    ``targets``: labels (B,) int64, or next tokens (B, L) int64 (``ignore_index`` where nothing is
    learnt). ``indices``: (B,) int64, each sample's stable index in the loader's index space (a
    split index; over several sources ``offset[source] + split index``); a token row's start in
    its epoch's stream (-1 for a padding row).

    Declared optional fields: ``sources``, each sample's (B,) or token's (B, L) source number in
    the loader's ``names`` (-1 for padding), where the loader keeps a per-source breakdown;
    ``source_counts``, this batch's samples (or input tokens) per source, with ``sources``;
    ``doc_keys``, token rows: each input token's document as one key over all sources (-1 where
    the token counts for nothing), where the loader was asked for them (selection by document).

    For a plain loop a batch unpacks as ``(input, targets, indices)``, its first input first:
    ``for images, labels, indices in loader``.
    """
    inputs: dict[str, torch.Tensor]
    targets: torch.Tensor
    indices: torch.Tensor
    sources: torch.Tensor | None = None
    source_counts: torch.Tensor | None = None
    doc_keys: torch.Tensor | None = None

    @classmethod
    def of_images(cls, images: torch.Tensor, labels: torch.Tensor, indices: torch.Tensor, **fields: Any) -> "Batch":
        """A batch of images (``inputs["images"]``)."""
        return cls({"images": images}, labels, indices, **fields)

    @property
    def input(self) -> torch.Tensor:
        """The first input (the images; a token batch's ``input_ids``)."""
        return next(iter(self.inputs.values()))

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter((self.input, self.targets, self.indices))

    def __len__(self) -> int:
        return len(self.targets)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the batch holds (a CUDA stream hand-over records each)."""
        extra = (self.sources, self.source_counts, self.doc_keys)
        return [*self.inputs.values(), self.targets, self.indices, *(t for t in extra if t is not None)]


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
    """What a selector returns: the samples to train on (the model's input, the targets and the
    indices it was handed, cut to the chosen rows), optional per-sample loss weights
    (the loop then minimises ``(per_sample_loss * weights).mean()``), and statistics: floats or
    0-dim tensors (on any device), which the loop averages on the device and reads only with
    its metrics record (``log_every_steps``), so a selector need not wait for the device."""
    inputs: torch.Tensor | Any  # the model's input: images, or token rows (TokenInputs)
    targets: torch.Tensor
    indices: torch.Tensor
    weights: torch.Tensor | None = None
    stats: MutableMapping = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class LoaderReport:
    """What a loader tells the run's summary, for this rank (the trainer sums the counts over
    ranks): the backend it read with and why, the verdict on what bounds it, the damaged samples
    it skipped, and what it served each source since the run began (None: one source, no
    breakdown) with the mixture changes it recorded."""
    backend: str | None = None
    choice: str | None = None
    verdict: str | None = None
    summary: str | None = None
    corrupt_skipped: int = 0
    served_unit: str = "samples"
    served: dict[str, int] | None = None
    changes: list[dict[str, Any]] = dataclasses.field(default_factory=list)


@runtime_checkable
class ResumableLoader(Protocol):
    """What the training loop needs from a loader (``sluice.stages.load.base.LoaderBase`` is
    this contract, implemented once for every Sluice loader; subclass it for your own).

    Iterating yields :class:`Batch`; ``len`` is the batches of the current epoch on this rank
    (equal on every rank); ``set_epoch(e)`` goes to epoch ``e``'s first batch (PyTorch's
    ``DistributedSampler`` convention), and iterating again without it continues with the next
    epoch; ``state_dict`` resumes mid-epoch at exactly the next batch (Sluice's loaders also
    resume another world size's state: the rest of the epoch, re-cut, which ``train.resize``
    relies on). ``epoch`` is the epoch it is in, ``names`` its sources' names (per-source
    metrics), ``device`` where its batches are made, ``report()`` what it tells the run's summary.
    """
    names: list[str]
    device: Any

    @property
    def epoch(self) -> int: ...
    def __iter__(self) -> Iterator[Batch]: ...
    def __len__(self) -> int: ...
    def set_epoch(self, epoch: int) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def report(self) -> LoaderReport: ...


class PassThroughLoader:
    """A loader that is ``self.loader`` with one thing changed (a subclass overrides
    ``__iter__``, say): every member of :class:`ResumableLoader` delegated by name. Not through
    ``__getattr__`` alone: from Python 3.12 ``isinstance`` against a runtime protocol looks members
    up statically, and a wrapper that only forwards unknown attributes is refused (one was, on the
    GPU machine's 3.12). Anything else a loader offers still forwards through ``__getattr__``."""
    loader: Any

    def __init__(self, loader: Any):
        self.loader = loader

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def names(self) -> list[str]:
        return self.loader.names

    @property
    def device(self) -> Any:
        return self.loader.device

    @property
    def epoch(self) -> int:
        return self.loader.epoch

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def report(self) -> LoaderReport:
        return self.loader.report()

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)


class Sampler(Protocol):
    """The order of one epoch: the same global sequence on every rank for the same epoch."""
    def __len__(self) -> int: ...
    def epoch_order(self, epoch: int) -> np.ndarray: ...


@runtime_checkable
class Selector(Protocol):
    """``selector(model, inputs, targets, indices) -> SelectedBatch``: picks what to train on.

    ``inputs`` are the model's input on its device (images: float and normalised; token rows:
    ``TokenInputs``); indices are what selection keys on: split indices, or on token rows each
    token's document (``doc_keys``, (B, L), -1 where the token counts for nothing). The loop calls
    every hook (``SelectorHooks`` gives each a default): ``set_progress(fraction)`` and
    ``set_epoch(epoch)`` before each selection; ``observe(indices, losses)`` after every step, on
    every rank (loss tables, importance estimates; it may all-gather), with the losses left on
    the device (per sample; per token on token rows): a loss that is NaN/inf (all of a step's,
    when any rank's loss was) must leave its entry unchanged, decided on the device, so the loop
    never waits to know; ``state_dict()`` / ``load_state_dict()`` for the rank's checkpoint part;
    ``for_token_rows()``, the selector's form for packed token rows (or a refusal saying why).
    """
    def __call__(self, model: torch.nn.Module, inputs: Any, targets: torch.Tensor,
                 indices: torch.Tensor) -> SelectedBatch: ...
    def set_progress(self, fraction: float) -> None: ...
    def set_epoch(self, epoch: int) -> None: ...
    def observe(self, indices: torch.Tensor, losses: torch.Tensor) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def for_token_rows(self) -> "Selector": ...


class SelectorHooks:
    """The ``Selector`` hooks with defaults that do nothing: a selector of your own subclasses
    this and implements ``__call__`` (and the hooks it needs)."""

    def set_progress(self, fraction: float) -> None:
        """The fraction of the budget done (annealing)."""

    def set_epoch(self, epoch: int) -> None:
        """The loop's epoch (a threshold fixed per epoch)."""

    def observe(self, indices: torch.Tensor, losses: torch.Tensor) -> None:
        """The trained samples' losses after the step (loss tables, importance estimates)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()``'s output."""

    def for_token_rows(self) -> "SelectorHooks":
        """This selector for packed token rows: as it is (it gets (B, L) document keys and
        per-token losses)."""
        return self
