"""The pipeline config: one pydantic model composed of the stage configs.

It is the flows' parameter, so a YAML file (``sluice run nightly --config``), a Prefect
``--params``/``--param`` and a Python call all take this same shape.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sluice.flows.config import merge
from sluice.stages.data.config import PrepareConfig
from sluice.stages.compute import resolve_amp
from sluice.stages.host import defaults_for, describe, host_class, threads_per_rank
from sluice.stages.load import AugmentSpec, LoaderConfig, SamplerConfig
from sluice.stages.load.augment import Flip, Normalize
from sluice.stages.load.specs import ArtifactData
from sluice.stages.select import ILModelConfig, SelectionConfig, candidate_size_for
from sluice.stages.select.base import SELECTION_METHODS
from sluice.stages.select.spec import SelectionSpec
from sluice.stages.train.config import CommConfig, TrainConfig
from sluice.stages.train.dist import wants_cuda
from sluice.stages.train.job import TrainJob
from sluice.stages.train.nodes import LaunchConfig
from sluice.stages.train.promote import PromotionConfig
from sluice.stages.train.warm import WarmStartConfig


def _default_train() -> TrainConfig:
    # The measured default recipe (benchmarks/time_to_accuracy.py, README "Results"): the plain
    # BN CNN, one-cycle to lr 0.2 per 256 samples with momentum cycling, no decay on norms and
    # biases (compute.build_optimizer), flip test-time augmentation, fp32 where the CPU has no
    # native bf16, channels-last, one single-threaded rank per core, no compression (two ranks on
    # one host gain nothing from it). No label smoothing: with it, 5 epochs ended 0.13 points
    # lower (time_to_accuracy_ablation.json at commit f5bac5e, 3 seeds). 5.5 epochs: with
    # InfoBatch on (_default_selection), the smallest budget whose seed-0 run reached 93%
    # (benchmarks/results/time_to_accuracy.json at commit 3602ff0, arm "sluice +infobatch").
    # Evaluating an EMA of the weights (decay 0.995): on top of InfoBatch it reached 93% sooner
    # on every seed in time_to_accuracy_ablation.json (commit bbb2fe8, arm "sluice +ema"), made
    # no clear difference in time_to_accuracy.json (commits 448de38 and 1fbd0d3, arm "sluice -ema");
    # over the six paired seeds of the committed files (bbb2fe8, 1fbd0d3) the median is 8 s in its favour.
    # warmup_min_steps=100: a 20-step run warming up to the full peak diverged and ended at chance;
    # bounded, it learns (benchmarks/results/tiny_budget-*.json); runs over 400 steps are unchanged.
    # Per-rank batch (like amp: auto and nproc: auto): the one measured best on this host's class.
    return TrainConfig(model="bn_cnn", epochs=5.5, batch_size=defaults_for("cuda" if wants_cuda(TrainConfig()) else "cpu").batch_per_rank,
                       lr=0.2, lr_reference_batch=256,
                       momentum_cycle=(0.85, 0.95), warmup_fraction=0.25, warmup_min_steps=100,
                       weight_decay=5e-4,
                       ema_decay=0.995,
                       label_smoothing=0.0, eval_tta="flip", schedule="onecycle", amp="auto",
                       channels_last=True, normalize_mean=[0.2860], normalize_std=[0.3530],
                       comm=CommConfig(mode="none"), progress=True)


def _default_augment() -> AugmentSpec:
    return AugmentSpec(ops=[Flip()])


def _default_selection() -> SelectionConfig:
    # InfoBatch by default: no scoring pass and no IL model; it skips about a third of the
    # well-learnt samples after the first epoch, and reached 93% sooner than no selection
    # (time_to_accuracy.json at commit 3602ff0, arms "sluice" and "sluice +infobatch"; today's
    # file has it as the default's "sluice" against "sluice -infobatch").
    # RHO-LOSS did not pay for its IL model per run (benchmarks/selection.py); asking for it
    # gets a strong IL model: the dense-head SmallCNN, 10 epochs on the holdout (≈ 90% test
    # accuracy from 6k Fashion-MNIST samples; a weak IL model makes RHO-LOSS skip
    # hard-but-learnable samples).
    return SelectionConfig(method="infobatch", ratio=0.5,
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
    warm: WarmStartConfig = Field(default_factory=WarmStartConfig,
                                  description="start from the champion's weights and train on the samples it has "
                                              "not seen plus a replay (stages/train/warm.py)")
    nproc: int | Literal["auto"] = Field(
        "auto", description="training processes (torchrun ranks) on this machine, or on each of "
        "launch.nodes; auto = one per core (a node's pinned cores), each with one thread (on small "
        "CPUs several single-threaded ranks beat one multi-threaded process)")
    launch: LaunchConfig = Field(default_factory=LaunchConfig,
                                 description="where training runs: this machine (no nodes) or a list "
                                             "of nodes joined by torchrun's c10d rendezvous; not part "
                                             "of the trained config, so a checkpoint resumes anywhere")
    prepare_runner: str = Field("local", pattern=r"^(local|threads|processes|dask://[^\s]+)$",
                                description="where shard writes run: local (the stage's own process pool), "
                                            "threads or processes (Prefect task runners), or "
                                            "dask://host:port (a Dask cluster via prefect-dask; workers must "
                                            "see the same paths)")
    train_timeout_s: float = Field(3600, gt=0)
    keep_versions: int | None = Field(7, ge=1, description="the nightly flow ends with `sluice gc --keep N` on "
                                      "the dataset's versions (incremental versions reuse their parents' files, "
                                      "so the space is freed only there); None: keep every version")

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

    @model_validator(mode="after")
    def _holdout_only_where_used(self) -> "PipelineConfig":
        """Unless ``prepare.ingest.holdout_fraction`` is given, hold samples out of training only
        for a method that trains an irreducible-loss model on them (RHO-LOSS): every other
        method trains on them."""
        ingest = self.prepare.ingest
        if "holdout_fraction" not in ingest.model_fields_set:
            self.prepare.ingest = ingest.model_copy(
                update={"holdout_fraction": 0.1 if self.selection.needs_il else 0.0})
            self.prepare.ingest.model_fields_set.add("holdout_fraction")
        return self

    @model_validator(mode="after")
    def _eval_split_is_not_empty(self) -> "PipelineConfig":
        """Checked here, before any stage runs (and after the holdout default is settled): a
        split the ingest config leaves empty."""
        ingest = self.prepare.ingest
        for name in ("eval_split", "report_split"):
            split = getattr(self.promotion, name)
            # (no test: a source may bring its own test split)
            share = {"holdout": ingest.holdout_fraction, "val": ingest.val_fraction}.get(split)
            if share == 0:
                raise ValueError(f"promotion.{name}={split!r} but prepare.ingest.{split}_fraction is 0, "
                                 "so that split would be empty")
        return self

    def ranks(self) -> int:
        """The number of training ranks ``nproc`` resolves to on this machine (per node with
        ``launch.nodes``: auto takes the fewest cores a node is pinned to)."""
        if self.nproc == "auto":
            per_rank = defaults_for("cpu").threads_per_rank
            pinned = [n.core_count() for n in self.launch.nodes]
            if pinned and None not in pinned:
                return max(1, min(pinned) // per_rank)
            return max(1, (os.cpu_count() or 1) // per_rank)
        if self.nproc < 1:
            raise ValueError("nproc must be >= 1 or 'auto'")
        return self.nproc

    def resolved_for_host(self) -> str:
        """What a local CPU run of this config resolves to on this host, in one line
        ("avx2: fp32, 2 ranks x 1 thread, 64 per rank"); explicit settings are shown as given."""
        ranks = self.ranks()
        return describe(host_class("cpu"), resolve_amp(self.train.amp, "cpu"), ranks,
                        self.train.torch_threads or threads_per_rank(ranks), self.train.batch_size)

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
    evaluate = c.loader.model_copy(update={"split": c.promotion.report_split, "batch_size": 500, "drop_last": False,
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
