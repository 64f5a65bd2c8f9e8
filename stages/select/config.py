"""The selection stage's configs: which method, its knobs, and how the irreducible-loss model is
built. ``method`` names an entry of ``SELECTION_METHODS`` (or ``none``), checked here."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sluice.errors import SelectionError
from sluice.plugins import entry_params, params_model
from sluice.stages.models import MODELS
from sluice.stages.select.base import SELECTION_METHODS, MethodParams


class ILModelConfig(BaseModel):
    """How the irreducible-loss model is built and trained; part of the scores' key."""
    model_config = ConfigDict(extra="forbid")

    architecture: str = Field("small_cnn", description="a registered model (sluice.stages.models)")
    model_kwargs: dict[str, int | float | str | bool] = Field(default_factory=dict)
    epochs: int = Field(10, ge=1)
    lr: float = Field(2e-3, gt=0)
    batch_size: int = Field(128, ge=1)
    optimizer: Literal["adamw", "adam", "sgd"] = "adamw"
    weight_decay: float = Field(0.01, ge=0)
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD only")
    seed: int = 0
    mean: list[float] = Field(default_factory=lambda: [0.2860],
                              description="per-channel mean for uint8 images (after /255)")
    std: list[float] = Field(default_factory=lambda: [0.3530])
    amp: Literal["auto", "none", "bf16"] = Field(
        "auto", description="bf16 autocast for training and scoring; 'auto' = bf16 only where the "
                            "device computes it natively (~3x on CPUs with AVX512-bf16/AMX, ~10x "
                            "slower without), else fp32. Keyed as resolved.")
    flip: bool = Field(True, description="random horizontal flips while training (a better IL "
                                         "model from a small holdout); off for non-mirrorable data")
    score_batch_size: int = Field(1024, ge=1, description="batch size when scoring; not keyed")
    progress: bool = Field(True, description="a progress bar while the IL model trains; not keyed")
    refresh_growth: float = Field(
        0.5, ge=0, description="a new dataset version reuses the last version's IL scores for its "
        "unchanged train samples and scores the rest with the stored IL model, unless its live "
        "holdout has grown by more than this share of the holdout that model trained on: then the "
        "model is retrained and every sample rescored (a deleted, changed or relabelled holdout "
        "sample always forces that). Not keyed: it decides when to retrain, not what a score is")

    @field_validator("architecture")
    @classmethod
    def _registered(cls, v: str) -> str:
        return MODELS.validate(v)


class SelectionConfig(BaseModel):
    """The selection method and its knobs: the same shape from YAML, Prefect or Python."""
    model_config = ConfigDict(extra="forbid")

    method: str = Field("none", description="none, or a registered method: uniform, loss, "
                        "rho_loss, selective_backprop, importance, infobatch, ...")
    ratio: float = Field(0.1, gt=0, le=1, description="n_b / n_B (paper default 10%)")
    n_select: int | None = Field(None, ge=1, description="fixed n_b; overrides ratio")
    seed: int = 0
    il: ILModelConfig = Field(default_factory=ILModelConfig)
    params: dict[str, Any] = Field(default_factory=dict, description="the method's own knobs, checked "
                                   "against the Params model it declares beside its code (e.g. infobatch: "
                                   "prune, anneal, sync_every); unknown ones are refused")

    @field_validator("method")
    @classmethod
    def _registered(cls, v: str) -> str:
        return v if v == "none" else SELECTION_METHODS.validate(v)

    @model_validator(mode="after")
    def _params_of_the_method(self) -> "SelectionConfig":
        """Every knob the method takes, defaults filled in, so the resolved config shows them."""
        if self.method == "none":
            if self.params:
                raise ValueError("selection.params: method 'none' takes no params")
            return self
        self.params = entry_params(SELECTION_METHODS.get(self.method), self.method, self.params, "selection method")
        return self

    @property
    def method_params(self) -> MethodParams:
        """The method's params as its typed model (``selection.params``)."""
        return params_model(SELECTION_METHODS.get(self.method)).model_validate(self.params) \
            if self.method != "none" else MethodParams()

    @property
    def needs_il(self) -> bool:
        """True when the method needs irreducible-loss scores (an IL model trained on a holdout)."""
        return self.method != "none" and SELECTION_METHODS.get(self.method).needs_il

    @property
    def picks_subset(self) -> bool:
        """True when the method trains n_b of each n_B candidates (ratio and n_select apply)."""
        return self.method != "none" and SELECTION_METHODS.get(self.method).picks_subset

    def n_select_for(self, n_candidates: int) -> int:
        """n_b for a candidate batch of ``n_candidates``; raises if it is not in [1, n_B]."""
        if n_candidates < 1:
            raise SelectionError("candidate batch is empty")
        if not self.picks_subset:  # works on the batch itself (InfoBatch prunes it): no n_b
            return n_candidates
        n_b = self.n_select if self.n_select is not None else int(round(self.ratio * n_candidates))
        if n_b < 1:
            raise SelectionError(f"n_b = round({self.ratio} * {n_candidates}) = {n_b} < 1: raise "
                                 "the ratio or the candidate batch size")
        if n_b > n_candidates:
            raise SelectionError(f"n_b = {n_b} > n_B = {n_candidates}: cannot select more samples "
                                 "than there are candidates")
        return n_b


def candidate_size_for(config: SelectionConfig, train_batch: int) -> int:
    """n_B such that the method trains ``train_batch`` samples per step: ``train_batch / ratio``
    for a method that picks a subset (unless ``n_select`` fixes n_b), else ``train_batch``."""
    if not config.picks_subset or config.n_select is not None:
        return train_batch
    return max(train_batch, int(round(train_batch / config.ratio)))
