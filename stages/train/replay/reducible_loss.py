"""``reducible_loss``: old samples drawn in proportion to the champion's loss minus the
irreducible loss (RHO-LOSS's criterion, Mindermann et al. 2022): learnable and not yet learnt,
so noisy labels, whose loss no model reduces, are replayed less. Needs the IL scores
(a selection method that computes them, e.g. ``rho_loss``)."""
from __future__ import annotations

import numpy as np

from sluice.errors import ConfigError
from sluice.stages.train.replay.base import REPLAY_POLICIES, ReplayContext, sample_by_weight


@REPLAY_POLICIES.register("reducible_loss")
def reducible_loss(ctx: ReplayContext) -> np.ndarray:
    il = ctx.irreducible()
    if il is None:
        raise ConfigError("the reducible_loss replay policy needs irreducible-loss scores: use a selection "
                          "method that computes them (selection.method=rho_loss), or warm.replay=champion_loss")
    return sample_by_weight(ctx, ctx.champion_losses(ctx.old) - il[ctx.old])
