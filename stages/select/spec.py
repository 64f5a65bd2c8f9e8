"""Build a selector from JSON inside a torchrun worker (the launcher passes only plain data)."""
from __future__ import annotations

from typing import Any

from sluice.stages.select.methods import SelectionConfig, build_selector


def make_selector(selection: dict[str, Any], candidate_size: int, split_size: int,
                  fingerprint: str | None = None, il_scores: str | None = None):
    """``sluice.stages.select.methods.build_selector`` from a SelectionConfig dict and a scores file path."""
    from sluice.storage.scores import open_scores
    scores = open_scores(il_scores) if il_scores else None
    return build_selector(SelectionConfig.model_validate(selection), scores, candidate_size=candidate_size,
                          split_size=split_size, dataset_fingerprint=fingerprint)
