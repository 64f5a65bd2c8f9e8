"""The pipeline config: one pydantic model composed of the stage configs.

It is the flows' parameter, so a YAML file (``sluice run nightly --config``), a Prefect
``--params``/``--param`` and a Python call all take this same shape.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sluice.flows.recipe import load_recipe, overlay, resolve_auto
from sluice.stages.precision import resolve_amp
from sluice.stages.data.config import PrepareConfig
from sluice.stages.host import (describe, gpu_name, host_class, rank_device, ranks_for, threads_per_rank,
                                usable_cores, visible_gpus)
from sluice.stages.load import AugmentSpec, LoaderConfig
from sluice.stages.load.config import loader_device
from sluice.stages.select import SelectionConfig
from sluice.stages.select.base import SELECTION_METHODS, token_rows_refusal
from sluice.stages.train.config import TrainConfig
from sluice.stages.train.dist import wants_cuda
from sluice.stages.models import MODELS
from sluice.stages.run.assemble import assemble_job, assemble_token_job
from sluice.stages.train.job import TrainJob
from sluice.stages.run.nodes import LaunchConfig
from sluice.stages.run.promote import PromotionConfig
from sluice.stages.run.text import TextPipelineConfig
from sluice.stages.run.warm import WarmStartConfig


def _method_needs_il(selection: Any) -> bool:
    method = selection.method if isinstance(selection, BaseModel) else (selection or {}).get("method", "none")
    return method != "none" and method in SELECTION_METHODS.names() and SELECTION_METHODS.get(method).needs_il


def _device_wants_cuda(train: Any) -> bool:
    device = train.device if isinstance(train, BaseModel) else (train or {}).get("device", "auto")
    return wants_cuda(device)


class PipelineConfig(BaseModel):
    """Everything the nightly pipeline does, stage by stage."""
    model_config = ConfigDict(extra="forbid")
    recipe: str = Field("default", description="the recipe under this config (flows/recipes/<name>.yaml): "
                        "its values fill in whatever the config does not give")
    data_root: str = Field("sluice-data", description="datasets, scores, runs and the model registry live here")
    dataset_name: str = "fashion-mnist"
    prepare: PrepareConfig = Field(default_factory=PrepareConfig)
    augment: AugmentSpec = Field(default_factory=AugmentSpec,
                                 description="training augmentation; normalisation is added from train.normalize_*")
    loader: LoaderConfig = Field(default_factory=LoaderConfig)
    selection: SelectionConfig = Field(default_factory=SelectionConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    promotion: PromotionConfig = Field(default_factory=PromotionConfig)
    text: TextPipelineConfig | None = Field(
        None, description="train a language model (train.model: gpt) on a weighted mixture of text sources "
        "instead of an image classifier on prepare.ingest: the same flow, promoted by validation loss "
        "(docs/nightly.md#text; the recipe: text)")
    warm: WarmStartConfig = Field(default_factory=WarmStartConfig,
                                  description="start from the champion's weights and train on the samples it has "
                                              "not seen plus a replay (stages/run/warm.py)")
    nproc: int | Literal["auto"] = Field(
        "auto", description="training ranks on this machine, or on each of launch.nodes (one trains "
        "in-process, several under torchrun); auto = one per visible GPU when training on CUDA "
        "(the cores split among them), else one per core (a node's pinned cores), each with one "
        "thread (on small CPUs several single-threaded ranks beat one multi-threaded process)")
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
    def _over_the_recipe(cls, data: Any) -> Any:
        """The recipe this config names, with the given values merged over it (a partial
        section changes only what it names), then its ``auto`` values resolved here."""
        if not isinstance(data, dict):
            return data
        merged = overlay(load_recipe(data.get("recipe") or "default"), data)
        return resolve_auto(merged, needs_il=_method_needs_il(merged.get("selection")),
                            wants_cuda=_device_wants_cuda(merged.get("train")))

    @model_validator(mode="after")
    def _one_seed(self) -> "PipelineConfig":
        """``train.seed`` seeds the whole run: the loader's augmentation draws, the sampler's order
        and the selection method's draws follow it unless one of them is set on its own."""
        for part in (self.loader, self.loader.sampler, self.selection):
            if "seed" not in part.model_fields_set:
                part.seed = self.train.seed
        return self

    @model_validator(mode="after")
    def _text_or_images(self) -> "PipelineConfig":
        """A language model trains on ``text``, an image model on ``prepare.ingest``; with text,
        promotion is by the loss per token on a split the text shard config fills, selection is
        ``none`` or ``infobatch`` (by document: the others cannot select packed rows) and no warm
        start is planned."""
        lm = getattr(MODELS.get(self.train.model), "task", "classify") == "language_model"
        if self.text is None:
            if lm:
                raise ValueError(f"train.model={self.train.model!r} is a language model: give it text sources "
                                 "(text.sources; the recipe: text)")
            return self
        if not lm:
            raise ValueError(f"text is set, but train.model={self.train.model!r} is no language model (gpt is)")
        why = token_rows_refusal(self.selection.method)
        if why:
            raise ValueError(why)
        if self.warm.init == "champion":
            raise ValueError("warm.init=champion: warm starts are planned over an image artifact's samples; "
                             "a language model trains from scratch each night (warm.init: scratch or auto)")
        p = self.promotion
        if p.metric == "val_acc" and "metric" not in p.model_fields_set:
            p.metric = f"{p.eval_split}_loss"
        if p.metric != f"{p.eval_split}_loss":
            raise ValueError(f"promotion.metric={p.metric!r}: a language model is promoted by its loss per "
                             f"token on promotion.eval_split, {p.eval_split}_loss")
        for name in ("eval_split", "report_split"):
            split = getattr(p, name)
            if self.text.split_fraction(split) == 0:
                raise ValueError(f"promotion.{name}={split!r} but text.shard.{split}_fraction is 0, "
                                 "so that split would be empty")
            if split == "train":
                raise ValueError(f"promotion.{name}=train: a model is never graded on what it trained on")
        return self

    @model_validator(mode="after")
    def _eval_split_is_not_empty(self) -> "PipelineConfig":
        """Checked here, before any stage runs (and after the holdout default is settled): a
        split the ingest config leaves empty."""
        if self.text is not None:  # the text sources' splits: _text_or_images
            return self
        ingest = self.prepare.ingest
        for name in ("eval_split", "report_split"):
            split = getattr(self.promotion, name)
            # (no test: a source may bring its own test split)
            share = {"holdout": ingest.holdout_fraction, "val": ingest.val_fraction}.get(split)
            if share == 0:
                raise ValueError(f"promotion.{name}={split!r} but prepare.ingest.{split}_fraction is 0, "
                                 "so that split would be empty")
        return self

    def on_cuda(self) -> bool:
        """Whether training runs on CUDA (``train.device``: auto takes CUDA where present)."""
        return wants_cuda(self.train.device)

    def ranks(self, gpus: int | None = None) -> int:
        """The training ranks ``nproc`` resolves to on this machine (per node with
        ``launch.nodes``): auto = one per visible GPU on CUDA (``gpus``: default, this machine's
        count), else one per core (a node's pinned cores: the fewest)."""
        cuda = self.on_cuda()
        return ranks_for(self.nproc, cuda=cuda, gpus=visible_gpus() if gpus is None and cuda else (gpus or 0),
                         cores=usable_cores(), pinned=[n.core_count() for n in self.launch.nodes])

    def resolved_for_host(self) -> str:
        """What a local run of this config resolves to here, in one line: "avx2: fp32, 2 ranks x 1
        thread, 64 per rank" on CPUs, "cuda: 1 × H100, bf16, 1 rank x 16 threads, 64 per rank,
        loader on cuda:0" on a GPU; explicit settings are shown as given."""
        ranks = self.ranks()
        threads = self.train.torch_threads or threads_per_rank(ranks)
        if not self.on_cuda():
            return describe(host_class("cpu"), resolve_amp(self.train.amp, "cpu"), ranks, threads,
                            self.train.batch_size)
        device = rank_device(True, 0)
        loader = loader_device(self.loader.device, device)
        return describe("cuda", resolve_amp(self.train.amp, device), ranks, threads, self.train.batch_size,
                        gpus=f"{visible_gpus()} × {gpu_name(0)}", loader_device=str(loader))

    # where things live
    def dataset_dir(self) -> Path:
        return Path(self.data_root) / "datasets" / self.dataset_name

    def datasets_dir(self) -> Path:
        """Where every dataset lives (a text source under ``<name>/``)."""
        return Path(self.data_root) / "datasets"

    def scores_dir(self) -> Path:
        return Path(self.data_root) / "scores"

    def registry_dir(self) -> Path:
        return Path(self.data_root) / "registry"

    def runs_dir(self) -> Path:
        return Path(self.data_root) / "runs"


def dataset_info(summary) -> dict[str, Any]:
    """What the training stage needs to know of a dataset version (``ShardSummary.info``)."""
    return summary.info()


def training_job(c: PipelineConfig, data: dict[str, Any], il_path: str | None, verified: bool = False) -> TrainJob:
    """The typed training job for this pipeline on dataset version ``data`` (stages/train/job.py).
    ``verified``: the flow checked the artifact already, so the ranks' loaders do not again."""
    if c.text is not None:  # data: stages/run/text.prepare_text's set of token artifacts
        return assemble_token_job(c.train, c.text, c.promotion.report_split, data, c.selection)
    loader = c.loader.model_copy(update={"verify": "none"}) if verified else c.loader
    return assemble_job(c.train, loader, c.augment, c.selection, c.promotion.report_split, data, il_path)
