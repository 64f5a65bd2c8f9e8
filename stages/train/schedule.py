"""The learning rate (and, for one-cycle, the momentum) as a function of the fraction of the budget
used (steps or seconds), so a time-budgeted run still decays to zero on time."""
from __future__ import annotations

import math

from sluice.stages.train.config import TrainConfig


def lr_at(cfg: TrainConfig, progress: float) -> float:
    """The learning rate at ``progress`` in [0, 1] of the budget."""
    p = min(max(progress, 0.0), 1.0)
    w = cfg.warmup_fraction
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "linear":  # optional warm-up, then linear decay to zero
        if p < w:
            return cfg.lr * p / w
        return cfg.lr * (1 - p) / (1 - w)
    # one-cycle: from lr/25 up to lr at w (linear), then cosine down to ~0
    if p < w:
        return cfg.lr * (0.04 + 0.96 * p / w)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * (p - w) / (1 - w)))


def momentum_at(cfg: TrainConfig, progress: float) -> float:
    """The momentum at ``progress``: ``cfg.momentum``, or with ``momentum_cycle`` under one-cycle
    the mirror image of the lr curve — high while the lr is low, low at its peak (Smith 2018)."""
    if cfg.momentum_cycle is None or cfg.schedule != "onecycle":
        return cfg.momentum
    lo, hi = cfg.momentum_cycle
    frac = lr_at(cfg, progress) / cfg.lr  # 0.04 .. 1 .. 0
    return hi - (hi - lo) * frac
