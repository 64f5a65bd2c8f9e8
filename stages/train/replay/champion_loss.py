"""``champion_loss``: old samples drawn in proportion to the champion's loss on them, so what it
has not learnt (or is forgetting) is revisited most. One forward pass over the old samples."""
from __future__ import annotations

import numpy as np

from sluice.stages.train.replay.base import REPLAY_POLICIES, ReplayContext, sample_by_weight


@REPLAY_POLICIES.register("champion_loss")
def champion_loss(ctx: ReplayContext) -> np.ndarray:
    return sample_by_weight(ctx, ctx.champion_losses(ctx.old))
