"""Evaluate a checkpoint on a split of a dataset artifact: one process, every sample once.

The promotion decision compares candidate and champion with this function on the same split,
so neither DDP padding nor a training-time EMA choice changes which model wins.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

from sluice.stages.load.augment import AugmentSpec, Normalize
from sluice.stages.models import build_model
from sluice.storage.checkpoint import load_checkpoint


def model_from_checkpoint(checkpoint: str | os.PathLike, use_ema: bool = True) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The trained model (its EMA weights when the run kept them) and its training config."""
    state = load_checkpoint(checkpoint)  # weights_only=True inside
    cfg = state.get("config") or {}
    model = build_model(cfg.get("model", "small_cnn"), cfg.get("in_channels", 1), cfg.get("num_classes", 10),
                        **cfg.get("model_kwargs", {}))
    weights = state["model"]
    ema = state.get("ema")
    if use_ema and isinstance(ema, dict) and ema:
        inner = {k[len("module."):]: v for k, v in ema.items() if k.startswith("module.")}
        if inner:
            weights = inner
    weights = {k[len("module."):] if k.startswith("module.") else k: v for k, v in weights.items()}
    model.load_state_dict(weights)
    model.eval()
    return model, cfg


@torch.no_grad()
def evaluate_checkpoint(checkpoint: str | os.PathLike, artifact: str | os.PathLike, split: str = "test",
                        batch_size: int = 1000, backend: str = "auto") -> dict[str, float]:
    """Accuracy and mean cross-entropy of a checkpoint over every sample of ``split``."""
    from sluice.stages.load.loader import Loader, LoaderConfig
    from sluice.stages.load.samplers import SamplerConfig
    model, cfg = model_from_checkpoint(checkpoint)
    spec = AugmentSpec(ops=[Normalize(mean=cfg.get("normalize_mean", [0.5]), std=cfg.get("normalize_std", [0.5]))])
    loader = Loader(artifact, LoaderConfig(split=split, batch_size=batch_size, backend=backend, augment=spec,
                                           sampler=SamplerConfig(kind="sequential"), prefetch=1))
    hits, loss, n = 0, 0.0, 0
    for x, y, _ in loader:
        out = model(x).float()
        hits += int((out.argmax(1) == y).sum())
        loss += float(F.cross_entropy(out, y, reduction="sum"))
        n += len(y)
    return {"acc": hits / max(n, 1), "loss": loss / max(n, 1), "n": n}
