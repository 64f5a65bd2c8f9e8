"""The pipeline config: one pydantic model composed of the stage configs.

It is the flows' parameter, so a YAML file (``sluice run nightly --config``), a Prefect
``--params``/``--param`` and a Python call all take this same shape.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sluice.flows.config import merge
from sluice.stages.data.config import PrepareConfig
from sluice.stages.load import AugmentSpec, LoaderConfig, SamplerConfig
from sluice.stages.load.augment import Flip, Normalize, Translate
from sluice.stages.load.specs import ArtifactData
from sluice.stages.select import ILModelConfig, SelectionConfig, candidate_size_for
from sluice.stages.select.base import SELECTION_METHODS
from sluice.stages.select.spec import SelectionSpec
from sluice.stages.train.config import CommConfig, TrainConfig
from sluice.stages.train.job import TrainJob
from sluice.storage.manifest import SPLITS


class PromotionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    metric: str = "test_acc"
    eval_split: str = Field("test", description=f"the split candidates are evaluated on: one of {', '.join(SPLITS)}")
    margin: float = Field(0.0, ge=0, description="a candidate must beat the champion by more than this")

    @field_validator("eval_split")
    @classmethod
    def _a_split(cls, v: str) -> str:
        if v not in SPLITS:
            raise ValueError(f"unknown split {v!r}; a dataset artifact has the splits {', '.join(SPLITS)}")
        return v


def _default_train() -> TrainConfig:
    return TrainConfig(model="small_cnn", model_kwargs={"width": 32, "hidden": 256},
                       epochs=4, batch_size=128, lr=0.1, schedule="onecycle", amp="auto", channels_last=True,
                       normalize_mean=[0.2860], normalize_std=[0.3530],
                       comm=CommConfig(mode="powersgd", powersgd_rank=2, start_iter=10), progress=True)


def _default_augment() -> AugmentSpec:
    return AugmentSpec(ops=[Translate(pad=2), Flip()])


def _default_selection() -> SelectionConfig:
    # the IL model: the dense-head SmallCNN, 10 epochs on the holdout (≈ 90% test accuracy from
    # 6k Fashion-MNIST samples; the pooled head reaches ≈ 86%, and a weak IL model makes RHO-LOSS
    # skip hard-but-learnable samples)
    return SelectionConfig(method="rho_loss", ratio=0.5,
                           il=ILModelConfig(model_kwargs={"width": 32, "hidden": 256}))


def _default_loader() -> LoaderConfig:
    return LoaderConfig(backend="auto", prefetch=2)


# The sections whose pipeline defaults differ from their stage's own defaults. A partial section
# (``train: {max_steps: 500}``, ``--set train.epochs=8``) is merged over these, not over the
# stage's class defaults, so it changes only what it names.
_SECTION_DEFAULTS = {"train": _default_train, "selection": _default_selection,
                     "loader": _default_loader, "augment": _default_augment}


class PipelineConfig(BaseModel):
    """Everything the nightly pipeline does, stage by stage."""
    model_config = ConfigDict(extra="forbid")
    data_root: str = Field("sluice-data", description="datasets, scores, runs and the model registry live here")
    dataset_name: str = "fashion-mnist"
    prepare: PrepareConfig = Field(default_factory=PrepareConfig)
    augment: AugmentSpec = Field(default_factory=_default_augment,
                                 description="training augmentation; normalisation is added from train.normalize_*")
    loader: LoaderConfig = Field(default_factory=_default_loader)
    selection: SelectionConfig = Field(default_factory=_default_selection)
    train: TrainConfig = Field(default_factory=_default_train)
    promotion: PromotionConfig = Field(default_factory=PromotionConfig)
    nproc: int = Field(2, ge=1, description="training processes (torchrun ranks) on this machine")
    prepare_runner: str = Field("local", pattern=r"^(local|threads|processes|dask://[^\s]+)$",
                                description="where shard writes run: local (the stage's own process pool), "
                                            "threads or processes (Prefect task runners), or "
                                            "dask://host:port (a Dask cluster via prefect-dask; workers must "
                                            "see the same paths)")
    train_timeout_s: float = Field(3600, gt=0)

    @model_validator(mode="after")
    def _eval_split_is_not_empty(self) -> "PipelineConfig":
        """Checked here, before any stage runs: a split the ingest config leaves empty."""
        ingest, split = self.prepare.ingest, self.promotion.eval_split
        share = {"holdout": ingest.holdout_fraction, "val": ingest.val_fraction}.get(split)
        if share == 0:
            raise ValueError(f"promotion.eval_split={split!r} but prepare.ingest.{split}_fraction is 0, "
                             "so that split would be empty")
        return self

    @model_validator(mode="before")
    @classmethod
    def _partial_sections_keep_pipeline_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for name, factory in _SECTION_DEFAULTS.items():
            given = data.get(name)
            if isinstance(given, dict):
                base = factory().model_dump(mode="json")
                if name == "train" and "model" in given and "model_kwargs" not in given:
                    base["model_kwargs"] = {}  # another model: the default's kwargs do not apply
                data[name] = merge(base, given, leaves=("model_kwargs",))
        return data

    # where things live
    def dataset_dir(self) -> Path:
        return Path(self.data_root) / "datasets" / self.dataset_name

    def scores_dir(self) -> Path:
        return Path(self.data_root) / "scores"

    def registry_dir(self) -> Path:
        return Path(self.data_root) / "registry"

    def runs_dir(self) -> Path:
        return Path(self.data_root) / "runs"


def dataset_info(summary) -> dict[str, Any]:
    """What the training stage needs to know of a dataset version (plain data, cacheable),
    from a ``sluice.stages.data.shard.ShardSummary``."""
    m = summary.manifest
    return {"root": summary.root, "fingerprint": m.fingerprint, "counts": m.counts(), "quarantined": m.quarantined,
            "damaged_sources": len(m.damaged_sources),
            "reused": summary.reused, "seconds": summary.seconds, "num_classes": m.fields.label.num_classes,
            "channels": (m.fields.image.shape or (0, 0, 3))[2]}


def training_job(c: PipelineConfig, data: dict[str, Any], il_path: str | None) -> TrainJob:
    """The typed training job for this pipeline on this dataset version: the train config, the
    data specs (train: candidate batches; eval: every sample once) and the selection spec. With
    a method that picks a subset, each rank draws ``batch / ratio`` candidates and trains on
    ``batch`` of them; only full candidate batches, so every rank does the same work. InfoBatch
    draws ``batch`` candidates and trains the ones it does not prune."""
    norm = Normalize(mean=c.train.normalize_mean, std=c.train.normalize_std)
    n_b = c.train.batch_size
    sel, n_big = c.selection, n_b
    if sel.method != "none":
        n_big = candidate_size_for(sel, n_b)
        update = {"n_select": n_b} if sel.picks_subset and sel.n_select is None else {}
        sel = SELECTION_METHODS.get(sel.method).for_training_stage(sel.model_copy(update=update))
    train = c.loader.model_copy(update={"split": "train", "batch_size": n_big, "drop_last": True,
                                        "augment": AugmentSpec(ops=[*c.augment.ops, norm],
                                                               channels_last=c.augment.channels_last
                                                               or c.train.channels_last)})
    evaluate = c.loader.model_copy(update={"split": c.promotion.eval_split, "batch_size": 500, "drop_last": False,
                                           "augment": AugmentSpec(ops=[norm]), "resolution": None,
                                           "sampler": SamplerConfig(kind="sequential")})
    selection = None
    if sel.method != "none":
        selection = SelectionSpec(config=sel, candidate_size=n_big, split_size=data["counts"]["train"],
                                  fingerprint=data["fingerprint"], il_scores=il_path)
    config = c.train.model_copy(update={"in_channels": data["channels"], "num_classes": data["num_classes"],
                                        "progress": False})
    return TrainJob(config=config, data=ArtifactData(root=data["root"], loader=train),
                    eval_data=ArtifactData(root=data["root"], loader=evaluate), selection=selection)
