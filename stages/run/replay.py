"""Replay policies: which samples a warm-started run revisits besides the new ones.

A warm start (``stages/run/warm.py``) trains the champion's weights on the samples it has not
seen plus a replay of ones it has, so it neither forgets them nor pays for all of them again. A
policy is a function from a ``ReplayContext`` to the split indices to replay, registered by name
like every other axis (``sluice.plugins``); add one with ``@REPLAY_POLICIES.register(name)``.

* ``uniform``: every old sample equally likely (the control; no forward pass).
* ``champion_loss``: old samples drawn in proportion to the champion's loss on them, so what it
  has not learnt (or is forgetting) is revisited most. One forward pass over the old samples.
* ``reducible_loss``: old samples drawn in proportion to the champion's loss minus the
  irreducible loss (RHO-LOSS's criterion, Mindermann et al. 2022): learnable and not yet learnt,
  so noisy labels, whose loss no model reduces, are replayed less. Needs the IL scores
  (a selection method that computes them, e.g. ``rho_loss``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from sluice.errors import ConfigError
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


@REPLAY_POLICIES.register("uniform")
def uniform(ctx: ReplayContext) -> np.ndarray:
    return np.sort(ctx.rng.choice(ctx.old, size=ctx.count, replace=False))


@REPLAY_POLICIES.register("champion_loss")
def champion_loss(ctx: ReplayContext) -> np.ndarray:
    return sample_by_weight(ctx, ctx.champion_losses(ctx.old))


@REPLAY_POLICIES.register("reducible_loss")
def reducible_loss(ctx: ReplayContext) -> np.ndarray:
    il = ctx.irreducible()
    if il is None:
        raise ConfigError("the reducible_loss replay policy needs irreducible-loss scores: use a selection "
                          "method that computes them (selection.method=rho_loss), or warm.replay=champion_loss")
    return sample_by_weight(ctx, ctx.champion_losses(ctx.old) - il[ctx.old])
