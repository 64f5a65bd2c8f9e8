"""What a rank trains a model for, and so how a batch becomes inputs, a loss per sample and an
evaluation: ``classify`` (images → class logits: one loss per image, accuracy) or
``language_model`` (packed token rows → next-token logits: one loss per row, the mean over its
tokens; evaluation in tokens). The model says which (a ``task`` attribute on its class; images by
default), so the loop, the step and evaluation stay the same for both.

Selection follows the task too (``selector_for``, ``losses``): an image selector keys samples by
split index and observes per-image losses; on token rows the indices are each token's document
(``doc_keys``, stable across epochs where a row is not) and a selector observes per-token losses,
so only a method keying its table by document (``infobatch``) can select them."""
from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F

from sluice.errors import SelectionError, TrainError
from sluice.stages.contracts import TokenInputs
from sluice.stages.load.tokens import source_losses
from sluice.stages.select.infobatch_tokens import token_row_selector
from sluice.stages.models import MODELS
from sluice.stages.pixels import channel_values, channels_last, normalize_uint8
from sluice.stages.train.config import TrainConfig

IGNORE = -100  # a target that counts for nothing (padding, a masked boundary)


class Task(Protocol):
    name: str

    def prep(self, batch: Any) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """(inputs on the device as the model takes them, targets, sample indices)."""

    def per_sample(self, out: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
        """One float loss per sample (B,)."""

    def losses(self, out: torch.Tensor, targets: torch.Tensor,
               label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(``per_sample``, what a selector observes, aligned to the indices ``prep`` gave), from
        one loss computation."""

    def selector_for(self, selector: Any, loader: Any) -> Any:
        """The selector this task's batches can be handed to (or a clear refusal)."""

    def eval_sums(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """[correct, summed loss, count] of one evaluation batch, on the device."""

    def eval_batch(self, out: torch.Tensor, targets: torch.Tensor, batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``eval_sums``, and the (2, sources) summed loss and counted targets per mixture source
        where the batch has sources (else None), from one loss computation."""


class ImageTask:
    """Moves a batch to the device and turns uint8 pixels into normalised float; cross-entropy
    per image."""
    name = "classify"

    def __init__(self, cfg: TrainConfig, device: torch.device):
        c = cfg.in_channels
        self.mean = channel_values(cfg.normalize_mean, c, device, "normalize_mean")
        self.std = channel_values(cfg.normalize_std, c, device, "normalize_std")
        self.device, self.channels_last, self.c = device, cfg.channels_last, c

    def prep(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        try:
            images, labels, indices = batch
        except (TypeError, ValueError):
            raise TrainError("a loader batch must be (images, labels, indices)") from None
        if images.ndim != 4 or images.shape[1] != self.c:
            raise TrainError(f"images must be NCHW with {self.c} channels (train.in_channels), got "
                             f"{tuple(images.shape)}")
        nb = self.device.type == "cuda"
        x = images.to(self.device, non_blocking=nb)
        x = normalize_uint8(x, self.mean, self.std) if x.dtype == torch.uint8 else x.float()
        if self.channels_last:
            x = channels_last(x)
        return (x, labels.to(self.device, torch.int64, non_blocking=nb),
                indices.to(self.device, torch.int64, non_blocking=nb))

    def per_sample(self, out: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
        return F.cross_entropy(out.float(), targets, reduction="none", label_smoothing=label_smoothing)

    def losses(self, out: torch.Tensor, targets: torch.Tensor,
               label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """A selector observes the per-image losses themselves."""
        per = self.per_sample(out, targets, label_smoothing)
        return per, per

    def selector_for(self, selector: Any, loader: Any) -> Any:
        """Every selection method takes images as they are."""
        return selector

    def eval_batch(self, out: torch.Tensor, targets: torch.Tensor, batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``eval_sums``, and for a mixture's batch (``image_mixture.MixtureBatch``: each image's
        ``sources``) the (3, sources) summed loss, images and correct ones per source."""
        sources, n = getattr(batch, "sources", None), len(getattr(batch, "source_samples", ()))
        if sources is None or n < 1:
            return self.eval_sums(out, targets), None
        per = F.cross_entropy(out.float(), targets, reduction="none")
        correct = out.argmax(1) == targets
        sums = torch.stack([correct.sum().to(out.dtype), per.sum().to(out.dtype),
                            torch.tensor(float(len(targets)), device=out.device, dtype=out.dtype)])
        src = sources.to(out.device, non_blocking=out.device.type == "cuda")
        loss_sum, count = source_losses(per.double(), src, n)
        right = torch.zeros(n, dtype=torch.float64, device=out.device).index_add_(
            0, src.clamp_min(0).long(), (correct & (src >= 0)).double())
        return sums, torch.stack([loss_sum, count, right])

    def eval_sums(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.stack([(out.argmax(1) == targets).sum().to(out.dtype),
                            F.cross_entropy(out, targets, reduction="sum"),
                            torch.tensor(float(len(targets)), device=out.device, dtype=out.dtype)])


class TokenTask:
    """Packed token rows (``stages/load/tokens.TokenBatch``, or ``(input_ids, targets,
    sample_ids)``): next-token cross-entropy, one loss per row (the mean over its counted tokens),
    evaluated per token. A batch with ``doc_keys`` (the loader's ``doc_keys=True``) gives them as
    its indices, -1 where the target counts for nothing, for selection by document."""
    name = "language_model"

    def __init__(self, cfg: TrainConfig, device: torch.device):
        self.device = device

    def prep(self, batch: Any) -> tuple[TokenInputs, torch.Tensor, torch.Tensor]:
        nb = self.device.type == "cuda"
        if hasattr(batch, "input_ids"):
            x = TokenInputs(batch.input_ids, getattr(batch, "segment_ids", None), getattr(batch, "position_ids", None))
            keys = getattr(batch, "doc_keys", None)
            y, idx = batch.targets, batch.sample_ids if keys is None else keys
        else:
            try:
                ids, y, idx = batch
            except (TypeError, ValueError):
                raise TrainError("a token batch must be a TokenBatch or (input_ids, targets, indices)") from None
            x = TokenInputs(ids)
        if x.input_ids.ndim != 2:
            raise TrainError(f"token inputs must be (rows, length), got {tuple(x.input_ids.shape)}")
        y, idx = y.to(self.device, torch.int64, non_blocking=nb), idx.to(self.device, torch.int64, non_blocking=nb)
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

    def selector_for(self, selector: Any, loader: Any) -> Any:
        """The selector's form for packed rows (``token_row_selector``: infobatch keyed by
        document; another method refuses, saying why), checked against a token loader: it must
        yield ``doc_keys`` and the table must hold its ``n_doc_keys`` documents. A selector of your
        own (no ``for_token_rows``) gets the (B, L) document keys and per-token losses as they are."""
        if getattr(selector, "for_token_rows", None) is None:
            return selector
        selector = token_row_selector(selector)
        config = getattr(loader, "config", None)
        if config is not None and getattr(config, "doc_keys", True) is False:
            raise SelectionError(f"selection method {selector.config.method!r} on token rows keys documents: "
                                 "build the token loader with doc_keys=True")
        n_docs, table = getattr(loader, "n_doc_keys", None), getattr(selector, "n", None)
        if n_docs is not None and table is not None and n_docs != table:
            raise SelectionError(f"selection method {selector.config.method!r} keeps a table of {table} "
                                 f"documents, the token loader has {n_docs}: build it with "
                                 "split_size=loader.n_doc_keys")
        return selector

    def eval_sums(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.eval_batch(out, targets, None)[0]

    def eval_batch(self, out: torch.Tensor, targets: torch.Tensor, batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The batch's sums, and per mixture source where the batch says each token's source
        (``TokenBatch.sources``): the per-token losses computed once for both."""
        valid = targets != IGNORE
        per_token = self.per_token(out, targets)
        sums = torch.stack([((out.argmax(-1) == targets) & valid).sum().to(out.dtype),
                            per_token.sum().to(out.dtype), valid.sum().to(out.dtype)])
        sources, n = getattr(batch, "sources", None), len(getattr(batch, "source_tokens", ()))
        if sources is None or n < 1:
            return sums, None
        sources = sources.to(out.device, non_blocking=out.device.type == "cuda")
        by_source = source_losses(per_token.to(torch.float64), sources, n, valid=valid)
        return sums, torch.stack(by_source)


def build_task(cfg: TrainConfig, device: torch.device) -> ImageTask | TokenTask:
    """The task ``cfg.model`` is trained for (its class's ``task``; images by default)."""
    kind = getattr(MODELS.get(cfg.model), "task", "classify")
    return TokenTask(cfg, device) if kind == "language_model" else ImageTask(cfg, device)
