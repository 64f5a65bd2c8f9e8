"""Where a run's weights start: fresh (seeded), or another run's trained weights (a warm start).

A warm start takes only the weights (the EMA's when that run kept one, as evaluation does), never
the optimizer, schedule or loader position: it is a new run with its own budget, not a resume.
The architecture must match exactly; anything else is refused naming what differs.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from sluice.errors import CheckpointMismatch
from sluice.storage.checkpoint import load_checkpoint

# What must match for another run's weights to load into this run's model.
ARCHITECTURE = ("model", "model_kwargs", "in_channels", "num_classes")


def trained_weights(state: dict[str, Any], use_ema: bool = True) -> dict[str, torch.Tensor]:
    """The model's weights in a checkpoint (its EMA's when kept), without DDP/EMA prefixes."""
    weights = state["model"]
    ema = state.get("ema")
    if use_ema and isinstance(ema, dict) and ema:
        inner = {k[len("module."):]: v for k, v in ema.items() if k.startswith("module.")}
        if inner:
            weights = inner
    return {k[len("module."):] if k.startswith("module.") else k: v for k, v in weights.items()}


def architecture_of(config: dict[str, Any]) -> dict[str, Any]:
    """The fields of a (dumped) train config that decide the weights' shapes."""
    defaults = {"model": "small_cnn", "model_kwargs": {}, "in_channels": 1, "num_classes": 10}
    return {k: config.get(k, defaults[k]) for k in ARCHITECTURE}


def load_initial_weights(model: torch.nn.Module, checkpoint: str | os.PathLike,
                         expected: dict[str, Any]) -> None:
    """Load ``checkpoint``'s trained weights into ``model``, built from ``expected`` (a train
    config dump); refuse a checkpoint of another architecture."""
    state = load_checkpoint(checkpoint)  # weights_only=True inside
    theirs, ours = architecture_of(state.get("config") or {}), architecture_of(expected)
    differ = {k: (theirs[k], ours[k]) for k in ARCHITECTURE if theirs[k] != ours[k]}
    if differ:
        raise CheckpointMismatch(f"cannot start from {checkpoint}: its architecture differs in "
                                 + ", ".join(f"{k} ({a!r} there, {b!r} here)" for k, (a, b) in differ.items()))
    try:
        model.load_state_dict(trained_weights(state))
    except RuntimeError as e:
        raise CheckpointMismatch(f"cannot start from {checkpoint}: {e}") from None
