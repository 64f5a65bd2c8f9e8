"""The typed selection spec a torchrun worker builds its selector from: the selection config,
the candidate and split sizes, and where the IL scores are — plain data, validated before the
launch (an unknown method fails there) and checked against the split inside the worker."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from sluice.stages.contracts import Selector
from sluice.stages.select import build_selector
from sluice.stages.select.config import SelectionConfig
from sluice.storage.scores import open_scores


class SelectionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    config: SelectionConfig
    candidate_size: int = Field(ge=1, description="n_B: candidates per rank and step")
    split_size: int = Field(ge=1, description="samples in the training split")
    fingerprint: str | None = Field(None, description="the dataset version the scores must belong to")
    il_scores: str | None = Field(None, description="path of the irreducible-loss scores (.npy)")

    def build(self) -> Selector | None:
        """The selector (None for method ``none``), its sizes and scores checked."""
        scores = open_scores(self.il_scores) if self.il_scores else None
        return build_selector(self.config, scores, candidate_size=self.candidate_size,
                              split_size=self.split_size, dataset_fingerprint=self.fingerprint)
