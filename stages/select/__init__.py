"""Sample selection: train on the points that are learnable, worth learning and not yet learnt.

Methods (``SelectionConfig.method``), one file each:

* ``none``: train on every candidate (``build_selector`` returns None);
* ``uniform``: a random ``n_b`` of the ``n_B`` candidates (the control; no forward pass);
* ``loss`` / ``rho_loss`` (``topk``): the ``n_b`` with the highest training loss, or the highest
  reducible loss = training loss − irreducible loss (Mindermann et al. 2022; IL from ``il_model``);
* ``selective_backprop`` (Jiang et al. 2019);
* ``importance`` (Katharopoulos & Fleuret 2018), with unbiased weights;
* ``infobatch`` (Qin et al. 2024): no scoring pass; prunes well-learnt samples, re-weighted.

Add one: a file registering a ``BaseSelector`` subclass with ``@SELECTION_METHODS.register``,
plus one import line below (see ``base``).
"""
from __future__ import annotations

import numpy as np
import torch

from sluice.errors import ScoresError, SelectionError
from sluice.stages.select import (importance, infobatch, infobatch_tokens, selective_backprop,  # noqa: F401
                                  topk, uniform)  # each registers itself (infobatch_tokens: infobatch's row form)
from sluice.stages.select.base import (SELECTION_METHODS, BaseSelector, MethodParams, ScoringParams,
                                       SelectorContext, as_table, candidate_losses, select_top)
from sluice.stages.select.config import ILModelConfig, SelectionConfig, candidate_size_for
from sluice.stages.select.il_model import IL_KIND, compute_irreducible_loss, irreducible_loss_scores
from sluice.stages.select.importance import ImportanceSampler
from sluice.stages.select.label_noise import LabelNoise, inject_label_noise
from sluice.storage.scores import Scores, check_scores

__all__ = ["SELECTION_METHODS", "BaseSelector", "MethodParams", "ScoringParams", "SelectorContext", "SelectionConfig",
           "ILModelConfig", "SelectionError", "build_selector", "candidate_size_for",
           "candidate_losses", "select_top", "compute_irreducible_loss", "irreducible_loss_scores",
           "IL_KIND", "ImportanceSampler", "LabelNoise", "inject_label_noise"]


def build_selector(config: SelectionConfig, il_scores: np.ndarray | Scores | None = None, *,
                   candidate_size: int | None = None, split_size: int | None = None,
                   dataset_fingerprint: str | None = None, noise_mask: np.ndarray | None = None,
                   sampler: ImportanceSampler | None = None, device: str | torch.device | None = None,
                   carried: dict[str, torch.Tensor] | None = None) -> BaseSelector | None:
    """The selector for ``config`` (None for method ``none``), checked before training starts.

    ``candidate_size`` (n_B) fixes n_b and checks 1 <= n_b <= n_B now; ``split_size`` and
    ``dataset_fingerprint`` check the IL scores belong to this split; ``noise_mask`` (bool per
    sample, known label noise) adds noisy-selection stats. ``importance`` needs ``split_size``
    (or a ``sampler``); its ``selector.sampler`` is what the loader should draw indices from.
    ``carried``: a per-sample table from an earlier run the method starts from (InfoBatch's
    ``loss`` and ``seen``, ``select.infobatch_carry``); refused by a method that keeps none.
    """
    if config.method == "none":
        return None
    method = SELECTION_METHODS.get(config.method)
    n_b = config.n_select_for(candidate_size) if candidate_size is not None else None
    config = method.resolve_auto(config, il_scores)
    if isinstance(il_scores, Scores):
        try:
            check_scores(il_scores, fingerprint=dataset_fingerprint, length=split_size)
        except ScoresError as e:
            raise SelectionError(str(e)) from None
        il_scores = il_scores.values
    if carried is not None and not method.carries_table:
        raise SelectionError(f"{config.method} keeps no per-sample table: a carried one cannot be given to it")
    if method.needs_il and il_scores is None:
        raise SelectionError(f"{config.method} needs irreducible-loss scores: compute them with "
                             "compute_irreducible_loss(...) and pass il_scores=")
    length = split_size if split_size is not None else (
        len(il_scores) if il_scores is not None else None)
    ctx = SelectorContext(n_select=n_b, split_size=length, device=device, sampler=sampler, carried=carried,
                          il=as_table(il_scores, "irreducible-loss scores", length, device=device),
                          noise=as_table(noise_mask, "noise mask", length, dtype=torch.bool,
                                         device=device))
    return method.build(config, ctx)
