"""A training job as it crosses into the ranks: one typed, validated document (the pipeline
assembles it: ``sluice.stages.run.assemble``).

``launch`` validates the job before it starts anything (a bad field, an unknown model, method or
compression hook fails in the caller's process, naming the field) and writes it as
``job.json``; each worker validates it again and builds its loaders and selector from the
specs. Nothing in it names code to import: user code is reached through the registries
(``sluice.plugins``).
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from sluice.stages.load.specs import DataSpec
from sluice.stages.select.spec import SelectionSpec
from sluice.stages.train.config import TrainConfig


class TrainJob(BaseModel):
    """What every rank of one run builds its data, model and selector from."""
    model_config = ConfigDict(extra="forbid")
    config: TrainConfig
    data: DataSpec = Field(description="the training data: candidate batches, per rank")
    eval_data: DataSpec | None = Field(None, description="evaluated at eval_every_steps and at the end")
    selection: SelectionSpec | None = None
