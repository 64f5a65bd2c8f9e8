"""``loss`` and ``rho_loss``: the n_b candidates with the highest training loss, or the highest
reducible loss = training loss − irreducible loss (RHO-LOSS, Mindermann et al. 2022; the IL
comes from ``il_model``, a scores artifact)."""
from __future__ import annotations

import torch

from sluice.stages.contracts import SelectedBatch
from sluice.stages.select.base import (SELECTION_METHODS, BaseSelector, ScoringParams, candidate_losses,
                                       check_finite, select_top)
from sluice.stages.select.label_noise import resolve_label_noise


@SELECTION_METHODS.register("loss")
class TopLossSelector(BaseSelector):
    """The n_b candidates with the highest ``score`` (here: the training loss)."""
    Params = ScoringParams
    resolve_auto = staticmethod(resolve_label_noise)  # label_noise: auto, off the IL scores record

    def score(self, loss: torch.Tensor, il: torch.Tensor | None) -> torch.Tensor:
        return loss

    def __call__(self, model, images, labels, indices) -> SelectedBatch:
        n = self._n(images.shape[0])
        loss = candidate_losses(model, images, labels, self.params.score_mode,
                                self.params.score_chunk, self.params.label_noise)
        check_finite(loss, "candidate training losses", indices)
        pos = select_top(self.score(loss, self._lookup(self._il, indices)), n)
        return SelectedBatch(images[pos], labels[pos], indices[pos], None,
                             self._stats(indices, pos, loss))


@SELECTION_METHODS.register("rho_loss")
class RhoLossSelector(TopLossSelector):
    """The n_b candidates with the highest reducible loss (loss − IL)."""
    needs_il = True

    def score(self, loss: torch.Tensor, il: torch.Tensor | None) -> torch.Tensor:
        assert il is not None  # needs_il: build_selector refuses to build without scores
        return loss - il
