"""The learning rate (and, for one-cycle, the momentum) as a function of the fraction of the budget
used (steps or seconds), so a time-budgeted run still decays to zero on time.

A warm-up is a fraction of the budget, but what it protects against (a freshly initialised
network thrown off by its first large steps) is counted in steps: a 20-step run warming up over
5 steps to the recipe's peak diverged (loss ~30) and ended at chance. So a step budget whose
warm-up is shorter than ``warmup_min_steps`` (the pipeline's recipe sets 100) gets a peak lowered
in proportion: the lr never rises faster per step than over ``warmup_min_steps``. Long runs are
unchanged."""
from __future__ import annotations

import math

from sluice.stages.train.config import TrainConfig


def peak_scale(cfg: TrainConfig, total_steps: int | None) -> float:
    """The factor on the peak lr for a budget of ``total_steps`` (None: a time budget, unknown
    in steps; unscaled): ``warmup steps / warmup_min_steps`` when that is below 1, else 1."""
    if not (total_steps and cfg.warmup_min_steps) or cfg.schedule == "constant" or cfg.warmup_fraction == 0:
        return 1.0
    return min(1.0, cfg.warmup_fraction * total_steps / cfg.warmup_min_steps)


def lr_at(cfg: TrainConfig, progress: float, total_steps: int | None = None) -> float:
    """The learning rate at ``progress`` in [0, 1] of a budget of ``total_steps`` steps."""
    if cfg.schedule == "constant":
        return cfg.lr
    return _shape(cfg, min(max(progress, 0.0), 1.0)) * cfg.lr * peak_scale(cfg, total_steps)


def _shape(cfg: TrainConfig, p: float) -> float:
    """The schedule's curve at ``p``, relative to its peak."""
    w = cfg.warmup_fraction
    if cfg.schedule == "linear":  # optional warm-up, then linear decay to zero
        if p < w:
            return p / w
        return (1 - p) / (1 - w)
    # one-cycle: from lr/25 up to lr at w (linear), then cosine down to ~0
    if p < w:
        return 0.04 + 0.96 * p / w
    return 0.5 * (1 + math.cos(math.pi * (p - w) / (1 - w)))


def momentum_at(cfg: TrainConfig, progress: float) -> float:
    """The momentum at ``progress``: ``cfg.momentum``, or with ``momentum_cycle`` under one-cycle
    the mirror image of the lr curve — high while the lr is low, low at its peak (Smith 2018)."""
    if cfg.momentum_cycle is None or cfg.schedule != "onecycle":
        return cfg.momentum
    lo, hi = cfg.momentum_cycle
    frac = lr_at(cfg, progress) / cfg.lr  # 0.04 .. 1 .. 0
    return hi - (hi - lo) * frac
