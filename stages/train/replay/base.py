"""Replay policies: which samples a warm-started run revisits besides the new ones.

A warm start (``stages/train/warm.py``) trains the champion's weights on the samples it has not
seen plus a replay of ones it has, so it neither forgets them nor pays for all of them again. A
policy is a function from a ``ReplayContext`` to the split indices to replay; one file each,
registered by name like every other axis (``sluice.plugins``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from sluice.plugins import PluginRegistry


@dataclass
class ReplayContext:
    old: np.ndarray  # split indices the parent model trained on: what may be replayed
    count: int  # how many to replay (≤ len(old))
    rng: np.random.Generator
    champion_losses: Callable[[np.ndarray], np.ndarray]  # the parent's loss on those indices (a forward pass)
    irreducible: Callable[[], np.ndarray | None]  # IL scores aligned to the split index, when computed


ReplayPolicy = Callable[[ReplayContext], np.ndarray]
REPLAY_POLICIES: PluginRegistry[ReplayPolicy] = PluginRegistry("replay_policies", "replay policy")


def sample_by_weight(ctx: ReplayContext, weights: np.ndarray) -> np.ndarray:
    """``count`` distinct old indices drawn with probability ∝ ``weights`` (so a few outliers,
    e.g. mislabelled samples, cannot fill the whole replay as a top-k would)."""
    w = np.clip(np.nan_to_num(np.asarray(weights, dtype=np.float64), nan=0.0), 1e-8, None)
    return np.sort(ctx.rng.choice(ctx.old, size=ctx.count, replace=False, p=w / w.sum()))
