"""Evaluation: accuracy and mean loss of a model over a loader (every rank its shard, summed),
and of a checkpoint over every sample of a split (one process) — the latter is what the
promotion decision compares, so neither DDP padding nor a training-time EMA choice changes
which model wins."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from sluice.stages.precision import autocast
from sluice.stages.contracts import ResumableLoader
from sluice.stages.load import AugmentSpec, Loader, LoaderConfig, SamplerConfig
from sluice.stages.load.augment import Normalize, eval_resize
from sluice.stages.load.backends.base import with_index
from sluice.stages.load.samplers import SequentialSampler, SubsetSampler
from sluice.stages.models import build_model, model_task
from sluice.stages.pixels import channels_last
from sluice.stages.train.dist import DistContext
from sluice.stages.train.initial_weights import trained_weights
from sluice.stages.load.mixture import MixtureConfig
from sluice.stages.load.tokens import TokenLoader, TokenLoaderConfig, TokenSource
from sluice.stages.train.tasks import Task, TokenTask
from sluice.storage.checkpoint import load_checkpoint

def predict(model: torch.nn.Module, x: torch.Tensor, tta: str = "none") -> torch.Tensor:
    """Float logits; with ``tta="flip"`` the mean of the image's and its mirror image's."""
    out = model(x).float()
    if tta == "flip":
        out = (out + model(x.flip(-1)).float()) / 2
    return out


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: ResumableLoader, task: Task, amp: str,
             d: DistContext, tta: str = "none") -> dict[str, float]:
    """Accuracy and mean loss over ``loader`` (each rank its shard, summed across ranks): per
    image, or per token for a language model (``n`` counts the same unit), and then also the
    loss of each source of the loader's mixture (``loss_by_source``; for images also
    ``acc_by_source``)."""
    was = model.training
    model.eval()
    tot = d.tensor([0.0, 0.0, 0.0])
    by_source = None  # [summed loss, count(, correct)] per mixture source
    loader.set_epoch(0)
    n_sources = len(loader.names)
    with autocast(amp, d.device):
        for batch in loader:
            x, y, _ = task.prep(batch)
            out = predict(model, x, tta)
            sums, part = task.eval_batch(out, y, batch, n_sources)
            tot += sums
            if part is not None:
                by_source = part if by_source is None else by_source + part
    if d.on:
        dist.all_reduce(tot)
        if by_source is not None:
            dist.all_reduce(by_source)
    model.train(was)
    n = max(tot[2].item(), 1.0)
    out = {"acc": tot[0].item() / n, "loss": tot[1].item() / n, "n": int(tot[2].item())}
    if by_source is not None:
        names = loader.names
        rows = by_source.tolist()  # summed loss, count[, correct] per source
        out["loss_by_source"] = {name: s / c for name, s, c in zip(names, rows[0], rows[1]) if c}
        if len(rows) > 2:
            out["acc_by_source"] = {name: r / c for name, r, c in zip(names, rows[2], rows[1]) if c}
    return out


def scoring_device(device: str | torch.device = "auto") -> torch.device:
    """Where a checkpoint is graded or scored: ``auto`` = the GPU this process trains on where
    there is one (its current device), else the CPU."""
    if str(device) != "auto":
        return torch.device(device)
    return with_index("cuda") if torch.cuda.is_available() else torch.device("cpu")


def model_from_checkpoint(checkpoint: str | os.PathLike, use_ema: bool = True,
                          device: str | torch.device = "cpu") -> tuple[torch.nn.Module, dict[str, Any]]:
    """The trained model (its EMA weights when the run kept them) on ``device``, in the memory
    layout it trained in, and its training config."""
    state = load_checkpoint(checkpoint)  # weights_only=True inside
    cfg = state.get("config") or {}
    model = build_model(cfg.get("model", "small_cnn"), cfg.get("in_channels", 1),
                        cfg.get("num_classes", 10), **cfg.get("model_kwargs", {}))
    model.load_state_dict(trained_weights(state, use_ema))
    model.to(device).eval()
    if cfg.get("channels_last"):  # as trained: channels-last convolutions are ~2x faster on CPU
        channels_last(model)
    return model, cfg


def _checkpoint_batches(checkpoint: str | os.PathLike, artifact: str | os.PathLike, split: str, batch_size: int,
                        backend: str, device: str | torch.device, sampler: Any = None) -> Iterator[tuple]:
    """The checkpoint's float logits, labels and split indices for every batch of ``split``
    (normalised as trained, no augmentation, on ``device``, the run's TTA)."""
    dev = scoring_device(device)
    model, cfg = model_from_checkpoint(checkpoint, device=dev)
    spec = AugmentSpec(ops=eval_resize(cfg.get("input_size")) + [
        Normalize(mean=cfg.get("normalize_mean", [0.5]), std=cfg.get("normalize_std", [0.5]))])
    loader = Loader(artifact, LoaderConfig(split=split, batch_size=batch_size, backend=backend, augment=spec,
                                           sampler=SamplerConfig(kind="sequential"), drop_last=False, prefetch=1,
                                           device=str(dev)),
                    custom_sampler=sampler)
    layout = channels_last if cfg.get("channels_last") else torch.Tensor.contiguous
    tta = cfg.get("eval_tta", "none")
    for x, y, idx in loader:
        yield predict(model, layout(x), tta), y, idx


@dataclass(frozen=True)
class CheckpointPass:
    """What one pass of a checkpoint over samples of a split measured."""
    metrics: dict[str, float]  # acc, loss (mean cross-entropy), n
    losses: np.ndarray  # float32: the cross-entropy of each of the indices asked for, in that order


@torch.no_grad()
def checkpoint_pass(checkpoint: str | os.PathLike, artifact: str | os.PathLike, split: str,
                    indices: np.ndarray | None = None, *, batch_size: int = 1000, backend: str = "auto",
                    device: str | torch.device = "auto") -> CheckpointPass:
    """Accuracy and mean cross-entropy of a checkpoint over every sample of ``split`` (or of
    ``indices``, split indices; then each one's loss too), on ``device`` (auto: this process's
    GPU where there is one). No augmentation, the evaluation's TTA."""
    order = np.empty(0, np.int64) if indices is None else np.asarray(indices, dtype=np.int64)
    losses = np.empty(order.size, dtype=np.float32)
    pos = {int(i): k for k, i in enumerate(order)}
    sampler = None if indices is None else SubsetSampler(SequentialSampler(order.size), order)
    hits, loss, n = 0, 0.0, 0
    for out, y, idx in _checkpoint_batches(checkpoint, artifact, split, batch_size, backend, device, sampler):
        hits += int((out.argmax(1) == y).sum())
        loss += float(F.cross_entropy(out, y, reduction="sum"))
        n += len(y)
        if indices is not None:
            each = F.cross_entropy(out, y, reduction="none")
            losses[[pos[int(i)] for i in idx.tolist()]] = each.float().cpu().numpy()
    return CheckpointPass({"acc": hits / max(n, 1), "loss": loss / max(n, 1), "n": n}, losses)


def evaluate_checkpoint(checkpoint: str | os.PathLike, artifact: str | os.PathLike,
                        split: str = "test", batch_size: int = 1000,
                        backend: str = "auto", device: str | torch.device = "auto") -> dict[str, float]:
    """Accuracy and mean cross-entropy of a checkpoint over every sample of ``split``: what the
    promotion decision compares."""
    return checkpoint_pass(checkpoint, artifact, split, batch_size=batch_size, backend=backend,
                           device=device).metrics


def per_sample_losses(checkpoint: str | os.PathLike, artifact: str | os.PathLike, split: str,
                      indices: np.ndarray, batch_size: int = 1000, backend: str = "auto",
                      device: str | torch.device = "auto") -> np.ndarray:
    """A checkpoint's cross-entropy on each of ``indices`` (split indices), in that order: what
    a replay policy weighs old samples by."""
    return checkpoint_pass(checkpoint, artifact, split, indices, batch_size=batch_size, backend=backend,
                           device=device).losses


@torch.no_grad()
def token_checkpoint_pass(checkpoint: str | os.PathLike, sources: Sequence[tuple[str, TokenSource]], *,
                          seq_len: int, batch_size: int = 16, device: str | torch.device = "auto") -> dict[str, Any]:
    """A language model's loss per token (and next-token accuracy) over every document of each
    ``(name, token source)`` once (a token split, or its documents re-tokenised), overall and per
    source, in fp32 on ``device``. The rows are a pure function of the sources, ``seq_len`` and
    ``batch_size`` (the mixture ``repeat: 1`` in a fixed order), so two checkpoints graded with
    the same arguments are graded on the very same rows."""
    dev = scoring_device(device)
    model, cfg = model_from_checkpoint(checkpoint, device=dev)
    if model_task(cfg.get("model", "small_cnn")) != "language_model":
        raise TypeError(f"{checkpoint} holds a {type(model).__name__}, not a language model")
    mix = MixtureConfig(sources=[{"name": name, "repeat": 1.0} for name, _ in sources])
    loader = TokenLoader([src for _, src in sources], TokenLoaderConfig(seq_len=seq_len, batch_size=batch_size,
                                                                        mixture=mix, prefetch=0))
    task = TokenTask(None, dev)  # it reads only the device
    tot = torch.zeros(3, dtype=torch.float64, device=dev)
    by_source = torch.zeros(2, len(sources), dtype=torch.float64, device=dev)
    for batch in loader:
        x, y, _ = task.prep(batch)
        out = model(x).float()
        sums, part = task.eval_batch(out, y, batch, len(sources))
        tot += sums.to(torch.float64)
        by_source += part
    n = max(tot[2].item(), 1.0)
    sums, counts = by_source.tolist()
    return {"loss": tot[1].item() / n, "acc": tot[0].item() / n, "n": int(tot[2].item()), "seq_len": seq_len,
            "loss_by_source": {name: s / c for (name, _), s, c in zip(sources, sums, counts) if c},
            "tokens_by_source": {name: int(c) for (name, _), c in zip(sources, counts)}}
