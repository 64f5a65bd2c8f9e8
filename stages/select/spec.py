"""The typed selection spec a torchrun worker builds its selector from: the selection config,
the candidate and split sizes, and where the IL scores are — plain data, validated before the
launch (an unknown method fails there) and checked against the split inside the worker."""
from __future__ import annotations

from fractions import Fraction

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sluice.stages.contracts import Selector
from sluice.stages.per_rank import scaled
from sluice.stages.select import SELECTION_METHODS, build_selector
from sluice.stages.select.config import SelectionConfig
from sluice.stages.select.infobatch_carry import load_table
from sluice.storage.scores import open_scores


class SelectionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    config: SelectionConfig
    candidate_size: int = Field(ge=1, description="n_B: candidates per rank and step")
    split_size: int = Field(ge=1, description="samples in the training split")
    fingerprint: str | None = Field(None, description="the dataset version the scores must belong to")
    il_scores: str | None = Field(None, description="path of the irreducible-loss scores (.npy)")
    carried_table: str | None = Field(
        None, description="path of a per-sample table (.npz) the selector starts from: InfoBatch's "
        "loss and seen carried from the champion into a warm run (select.infobatch_carry)")

    @model_validator(mode="after")
    def _carries(self) -> "SelectionSpec":
        if self.carried_table and not (self.config.method != "none"
                                       and SELECTION_METHODS.get(self.config.method).carries_table):
            raise ValueError(f"carried_table: selection method {self.config.method!r} keeps no per-sample table")
        return self

    def build(self, batch_scale: Fraction = Fraction(1)) -> Selector | None:
        """The selector (None for method ``none``), its sizes, scores and carried table checked;
        every rank reads the same files, so every rank starts from the same table. ``batch_scale``:
        what the per-rank candidates and picks are multiplied by (a checkpoint of another world
        size, ``train.elastic``)."""
        scores = open_scores(self.il_scores) if self.il_scores else None
        carried = load_table(self.carried_table, self.split_size, self.fingerprint) if self.carried_table else None
        config = self.config
        if config.n_select is not None:
            config = config.model_copy(update={"n_select": scaled(config.n_select, batch_scale, "selected samples")})
        return build_selector(config, scores, candidate_size=scaled(self.candidate_size, batch_scale, "candidates"),
                              split_size=self.split_size, dataset_fingerprint=self.fingerprint, carried=carried)
