"""``uniform``: every old sample equally likely (the control; no forward pass)."""
from __future__ import annotations

import numpy as np

from sluice.stages.train.replay.base import REPLAY_POLICIES, ReplayContext


@REPLAY_POLICIES.register("uniform")
def uniform(ctx: ReplayContext) -> np.ndarray:
    return np.sort(ctx.rng.choice(ctx.old, size=ctx.count, replace=False))
