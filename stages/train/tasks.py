"""What a rank trains a model for, and so how a batch becomes the model's input, a loss per
sample and an evaluation: ``classify`` (images → class logits: one loss per image, accuracy) or
``language_model`` (packed token rows → next-token logits: one loss per row, the mean over its
tokens; evaluation in tokens). A task is an entry of the ``TASKS`` registry; the model says
which it is trained for (``models.model_task``: a ``task`` on its class, ``classify`` by
default), and a kind of data names the task its batches are for, so the loop, the step and
evaluation stay the same for every kind.

Every batch is a ``contracts.Batch``, read by its fields: ``inputs`` (already model-ready: the
loader normalises), ``targets``, ``indices``, and the declared optional ``sources`` (per-source
metrics) and ``doc_keys`` (selection by document). Selection follows the task too
(``selector_for``, ``losses``): an image selector keys samples by index and observes per-image
losses; on token rows the keys are each token's document (stable across epochs where a row is
not) and a selector observes per-token losses, so only a method with a form for token rows
(``infobatch``, by document) can select them."""
from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F

from sluice.errors import TrainError
from sluice.plugins import PluginRegistry
from sluice.stages.contracts import Batch, Selector, TokenInputs
from sluice.stages.load.tokens import source_losses
from sluice.stages.models import model_task
from sluice.stages.pixels import channels_last
from sluice.stages.train.config import TrainConfig

IGNORE = -100  # a target that counts for nothing (padding, a masked boundary)


class Task(Protocol):
    name: str

    def prep(self, batch: Batch) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """(the model's input on the device, targets, what selection keys on)."""

    def per_sample(self, out: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
        """One float loss per sample (B,)."""

    def losses(self, out: torch.Tensor, targets: torch.Tensor,
               label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(``per_sample``, what a selector observes, aligned to the keys ``prep`` gave), from
        one loss computation."""

    def selector_for(self, selector: Selector) -> Selector:
        """The selector this task's batches can be handed to (or a clear refusal)."""

    def eval_sums(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """[correct, summed loss, count] of one evaluation batch, on the device."""

    def eval_batch(self, out: torch.Tensor, targets: torch.Tensor, batch: Batch,
                   n_sources: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``eval_sums``, and the per-source sums where the batch has ``sources`` (else None),
        from one loss computation."""


TASKS: PluginRegistry[type[Task]] = PluginRegistry("tasks", "task")


def as_batch(batch: Any) -> Batch:
    """``batch`` when it is a ``contracts.Batch``; a clear error otherwise."""
    if not isinstance(batch, Batch):
        raise TrainError(f"a loader batch must be a sluice.stages.contracts.Batch, got {type(batch).__name__} "
                         "(Batch.of_images(images, labels, indices) makes one of a tuple)")
    return batch


@TASKS.register("classify")
class ImageTask:
    """Moves a batch of normalised images to the device (channels-last where configured);
    cross-entropy per image."""
    name = "classify"

    def __init__(self, cfg: TrainConfig, device: torch.device):
        self.device, self.channels_last, self.c = device, cfg.channels_last, cfg.in_channels

    def prep(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        images = as_batch(batch).inputs.get("images")
        if images is None:
            raise TrainError(f"an image model reads inputs['images']; this batch holds {sorted(batch.inputs)}")
        if images.ndim != 4 or images.shape[1] != self.c:
            raise TrainError(f"images must be NCHW with {self.c} channels (train.in_channels), got "
                             f"{tuple(images.shape)}")
        if images.dtype == torch.uint8:
            raise TrainError("images arrive as uint8 pixels: batches reach the trainer normalised, by the loader "
                             "(the normalize augmentation op; ArrayLoader(normalize=...))")
        nb = self.device.type == "cuda"
        x = images.to(self.device, non_blocking=nb).float()
        if self.channels_last:
            x = channels_last(x)
        return (x, batch.targets.to(self.device, torch.int64, non_blocking=nb),
                batch.indices.to(self.device, torch.int64, non_blocking=nb))

    def per_sample(self, out: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
        return F.cross_entropy(out.float(), targets, reduction="none", label_smoothing=label_smoothing)

    def losses(self, out: torch.Tensor, targets: torch.Tensor,
               label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """A selector observes the per-image losses themselves."""
        per = self.per_sample(out, targets, label_smoothing)
        return per, per

    def selector_for(self, selector: Selector) -> Selector:
        """Every selection method takes images as they are."""
        return selector

    def eval_batch(self, out: torch.Tensor, targets: torch.Tensor, batch: Batch,
                   n_sources: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``eval_sums``, and for a batch with ``sources`` (a mixture's) the (3, sources) summed
        loss, images and correct ones per source."""
        if batch.sources is None or n_sources < 1:
            return self.eval_sums(out, targets), None
        per = F.cross_entropy(out.float(), targets, reduction="none")
        correct = out.argmax(1) == targets
        sums = torch.stack([correct.sum().to(out.dtype), per.sum().to(out.dtype),
                            torch.tensor(float(len(targets)), device=out.device, dtype=out.dtype)])
        src = batch.sources.to(out.device, non_blocking=out.device.type == "cuda")
        loss_sum, count = source_losses(per.double(), src, n_sources)
        right = torch.zeros(n_sources, dtype=torch.float64, device=out.device).index_add_(
            0, src.clamp_min(0).long(), (correct & (src >= 0)).double())
        return sums, torch.stack([loss_sum, count, right])

    def eval_sums(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.stack([(out.argmax(1) == targets).sum().to(out.dtype),
                            F.cross_entropy(out, targets, reduction="sum"),
                            torch.tensor(float(len(targets)), device=out.device, dtype=out.dtype)])


@TASKS.register("language_model")
class TokenTask:
    """Packed token rows: next-token cross-entropy, one loss per row (the mean over its counted
    tokens), evaluated per token. Selection keys each token's document (``doc_keys``, from a
    token loader built with ``doc_keys=True``), -1 where the target counts for nothing; without
    them, each row's start (``indices``)."""
    name = "language_model"

    def __init__(self, cfg: TrainConfig | None, device: torch.device):
        self.device = device

    def prep(self, batch: Batch) -> tuple[TokenInputs, torch.Tensor, torch.Tensor]:
        inputs = as_batch(batch).inputs
        ids = inputs.get("input_ids")
        if ids is None or ids.ndim != 2:
            raise TrainError(f"token inputs must be input_ids of (rows, length), got {sorted(inputs)}"
                             + (f" with input_ids {tuple(ids.shape)}" if ids is not None else ""))
        nb = self.device.type == "cuda"
        x = TokenInputs(ids, inputs.get("segment_ids"), inputs.get("position_ids"))
        idx = batch.indices if batch.doc_keys is None else batch.doc_keys
        y, idx = batch.targets.to(self.device, torch.int64, non_blocking=nb), idx.to(self.device, torch.int64, non_blocking=nb)
        if idx.ndim == 2:  # documents: a token whose target is ignored counts for nothing
            idx = torch.where(y == IGNORE, -1, idx)
        return x.to(self.device, non_blocking=nb), y, idx

    def per_token(self, out: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
        """(B, L) losses, 0 where the target is ignored."""
        B, L, V = out.shape
        return F.cross_entropy(out.float().reshape(B * L, V), targets.reshape(B * L), reduction="none",
                               ignore_index=IGNORE, label_smoothing=label_smoothing).view(B, L)

    def per_sample(self, out: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
        return self.losses(out, targets, label_smoothing)[0]

    def losses(self, out: torch.Tensor, targets: torch.Tensor,
               label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(one loss per row, the (B, L) per-token losses a selector by document observes)."""
        counted = (targets != IGNORE).sum(1).clamp_min(1)
        per_token = self.per_token(out, targets, label_smoothing)
        return per_token.sum(1) / counted, per_token

    def selector_for(self, selector: Selector) -> Selector:
        """The selector's form for packed rows (``for_token_rows``: infobatch keyed by document;
        another method refuses, saying why; a selector of your own, as it is)."""
        return selector.for_token_rows()

    def eval_sums(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        valid = targets != IGNORE
        return torch.stack([((out.argmax(-1) == targets) & valid).sum().to(out.dtype),
                            self.per_token(out, targets).sum().to(out.dtype), valid.sum().to(out.dtype)])

    def eval_batch(self, out: torch.Tensor, targets: torch.Tensor, batch: Batch,
                   n_sources: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The batch's sums, and per mixture source where the batch says each token's source
        (``sources``): the per-token losses computed once for both."""
        valid = targets != IGNORE
        per_token = self.per_token(out, targets)
        sums = torch.stack([((out.argmax(-1) == targets) & valid).sum().to(out.dtype),
                            per_token.sum().to(out.dtype), valid.sum().to(out.dtype)])
        if batch.sources is None or n_sources < 1:
            return sums, None
        sources = batch.sources.to(out.device, non_blocking=out.device.type == "cuda")
        by_source = source_losses(per_token.to(torch.float64), sources, n_sources, valid=valid)
        return sums, torch.stack(by_source)


def build_task(cfg: TrainConfig, device: torch.device) -> Task:
    """The task ``cfg.model`` is trained for (``models.model_task``)."""
    return TASKS.get(model_task(cfg.model))(cfg, device)
