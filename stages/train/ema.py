"""An exponential moving average of the weights, evaluated in place of the raw weights.

The decay warms up with the number of updates: ``min(decay, (1 + n) / (10 + n))`` (the schedule
of TensorFlow's ``ExponentialMovingAverage(num_updates=...)``). A fixed decay of 0.995 averages
over ~200 steps, so a run of a few dozen steps evaluated an average that was still ~90% its
first step's weights and scored at chance; with the warm-up a short run evaluates its recent
weights, while a long run reaches the full decay after ~1,800 steps and ends as before.
"""
from __future__ import annotations

import torch
from torch.optim.swa_utils import AveragedModel


def ema_decay_at(decay: float, updates: int) -> float:
    """The decay applied at the ``updates``-th averaging (counted from 0, the first copy)."""
    return min(decay, (1.0 + updates) / (10.0 + updates))


def build_ema(model: torch.nn.Module, decay: float) -> AveragedModel:
    """An ``AveragedModel`` of ``model`` (parameters and buffers, so BN statistics follow) whose
    decay warms up as :func:`ema_decay_at` says. Its state (``n_averaged`` included) checkpoints
    and resumes with the model's."""
    @torch.no_grad()
    def average(ema: list[torch.Tensor], current: list[torch.Tensor], n_averaged: torch.Tensor) -> None:
        if not torch.is_floating_point(ema[0]):  # counters (BN's num_batches_tracked): the current value
            torch._foreach_copy_(ema, current)
            return
        torch._foreach_lerp_(ema, current, 1.0 - ema_decay_at(decay, int(n_averaged)))
    return AveragedModel(model, multi_avg_fn=average, use_buffers=True)
