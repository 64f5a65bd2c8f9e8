"""Evaluation: accuracy and mean loss of a model over a loader (every rank its shard, summed),
and of a checkpoint over every sample of a split (one process) — the latter is what the
promotion decision compares, so neither DDP padding nor a training-time EMA choice changes
which model wins."""
from __future__ import annotations

import os
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from sluice.stages.compute import autocast
from sluice.stages.contracts import ResumableLoader
from sluice.stages.load import AugmentSpec, Loader, LoaderConfig, SamplerConfig
from sluice.stages.load.augment import Normalize
from sluice.stages.load.backends.base import with_index
from sluice.stages.load.samplers import SequentialSampler, SubsetSampler
from sluice.stages.models import build_model
from sluice.stages.train.dist import DistContext
from sluice.stages.train.init import trained_weights
from sluice.storage.checkpoint import load_checkpoint

Prepare = Callable[[Any], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def predict(model: torch.nn.Module, x: torch.Tensor, tta: str = "none") -> torch.Tensor:
    """Float logits; with ``tta="flip"`` the mean of the image's and its mirror image's."""
    out = model(x).float()
    if tta == "flip":
        out = (out + model(x.flip(-1)).float()) / 2
    return out


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: ResumableLoader, prep: Prepare, amp: str,
             d: DistContext, tta: str = "none") -> dict[str, float]:
    """Accuracy and mean loss over ``loader`` (each rank its shard, summed across ranks)."""
    was = model.training
    model.eval()
    tot = d.tensor([0.0, 0.0, 0.0])
    loader.set_epoch(0)
    with autocast(amp, d.device):
        for batch in loader:
            x, y, _ = prep(batch)
            out = predict(model, x, tta)
            tot[0] += (out.argmax(1) == y).sum()
            tot[1] += F.cross_entropy(out, y, reduction="sum")
            tot[2] += len(y)
    if d.on:
        dist.all_reduce(tot)
    model.train(was)
    n = max(tot[2].item(), 1.0)
    return {"acc": tot[0].item() / n, "loss": tot[1].item() / n, "n": int(tot[2].item())}


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
        model.to(memory_format=torch.channels_last)
    return model, cfg


def _checkpoint_batches(checkpoint: str | os.PathLike, artifact: str | os.PathLike, split: str, batch_size: int,
                        backend: str, device: str | torch.device, sampler: Any = None) -> Iterator[tuple]:
    """The checkpoint's model and config, and a function giving its float logits for every
    batch of ``split`` (normalised as trained, no augmentation, on ``device``, the run's TTA)."""
    dev = scoring_device(device)
    model, cfg = model_from_checkpoint(checkpoint, device=dev)
    spec = AugmentSpec(ops=[Normalize(mean=cfg.get("normalize_mean", [0.5]), std=cfg.get("normalize_std", [0.5]))])
    loader = Loader(artifact, LoaderConfig(split=split, batch_size=batch_size, backend=backend, augment=spec,
                                           sampler=SamplerConfig(kind="sequential"), drop_last=False, prefetch=1,
                                           device=str(dev)),
                    custom_sampler=sampler)
    layout = torch.channels_last if cfg.get("channels_last") else torch.contiguous_format
    tta = cfg.get("eval_tta", "none")
    for x, y, idx in loader:
        yield predict(model, x.contiguous(memory_format=layout), tta), y, idx


@torch.no_grad()
def evaluate_checkpoint(checkpoint: str | os.PathLike, artifact: str | os.PathLike,
                        split: str = "test", batch_size: int = 1000,
                        backend: str = "auto", device: str | torch.device = "auto") -> dict[str, float]:
    """Accuracy and mean cross-entropy of a checkpoint over every sample of ``split``, on
    ``device`` (auto: this process's GPU where there is one)."""
    hits, loss, n = 0, 0.0, 0
    for out, y, _ in _checkpoint_batches(checkpoint, artifact, split, batch_size, backend, device):
        hits += int((out.argmax(1) == y).sum())
        loss += float(F.cross_entropy(out, y, reduction="sum"))
        n += len(y)
    return {"acc": hits / max(n, 1), "loss": loss / max(n, 1), "n": n}


@torch.no_grad()
def per_sample_losses(checkpoint: str | os.PathLike, artifact: str | os.PathLike, split: str,
                      indices: np.ndarray, batch_size: int = 1000, backend: str = "auto",
                      device: str | torch.device = "auto") -> np.ndarray:
    """A checkpoint's cross-entropy on each of ``indices`` (split indices), in that order: what
    a replay policy weighs old samples by. No augmentation, the evaluation's TTA."""
    order = np.asarray(indices, dtype=np.int64)
    out = np.empty(order.size, dtype=np.float32)
    pos = {int(i): k for k, i in enumerate(order)}
    sampler = SubsetSampler(SequentialSampler(order.size), order)
    for logits, y, idx in _checkpoint_batches(checkpoint, artifact, split, batch_size, backend, device, sampler):
        loss = F.cross_entropy(logits, y, reduction="none")
        out[[pos[int(i)] for i in idx.tolist()]] = loss.float().cpu().numpy()
    return out
