"""The pipeline config: one pydantic model composed of the stage configs, whatever the kind of
data: its ``data:`` section is the shape the kind declares (``stages/kinds``: ``image``,
``tokens``, ...), and every check that differs by kind is the kind's.

It is the flows' parameter, so a YAML file (``sluice run nightly --config``), a Prefect
``--params``/``--param`` and a Python call all take this same shape.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, WithJsonSchema, field_validator, model_validator

from sluice.flows.recipe import load_recipe, overlay, resolve_auto
from sluice.stages.precision import resolve_amp
from sluice.stages.host import (describe, gpu_name, host_class, rank_device, ranks_for, threads_per_rank,
                                usable_cores, visible_gpus)
from sluice.stages.kinds import DataConfig, DataKind, DatasetVersion, data_config, kind_of
from sluice.stages.load.config import loader_device
from sluice.stages.select import SelectionConfig
from sluice.stages.select.base import SELECTION_METHODS
from sluice.stages.train.config import TrainConfig
from sluice.stages.data.engine import EngineConfig
from sluice.stages.track.config import TrackingConfig
from sluice.stages.train.dist import wants_cuda
from sluice.stages.run.assemble import assemble_job
from sluice.stages.train.job import TrainJob
from sluice.stages.run.nodes import LaunchConfig
from sluice.stages.run.promote import PromotionConfig
from sluice.stages.run.warm import Start, WarmStartConfig

# Top-level sections of a config from before the kind of data was one section: where they went.
MOVED = {"prepare": "data.ingest and data.shard (data.kind: image)", "augment": "data.augment",
         "loader": "data.loader", "dataset_name": "data.sources[].name (or data.name with data.source)",
         "text": "data (data.kind: tokens: sources, shard, seq_len, ...)"}


# The data section's JSON schema (what a Prefect deployment checks parameters against): an object
# whose shape its kind declares and whose fields the recipe fills in, so any part of it may be given.
DataSection = Annotated[SerializeAsAny[DataConfig], WithJsonSchema({
    "type": "object", "title": "Data", "additionalProperties": True,
    "properties": {"kind": {"type": "string", "description": "a registered kind of data: image, tokens, ..."}},
    "description": "data.kind and its sources, and the rest of the section in the shape that kind declares"})]


def _method_needs_il(selection: Any) -> bool:
    method = selection.method if isinstance(selection, BaseModel) else (selection or {}).get("method", "none")
    return method != "none" and method in SELECTION_METHODS.names() and SELECTION_METHODS.get(method).needs_il


def _device_wants_cuda(train: Any) -> bool:
    device = train.device if isinstance(train, BaseModel) else (train or {}).get("device", "auto")
    return wants_cuda(device)


def _every_section_may_be_left_to_the_recipe(schema: dict[str, Any]) -> None:
    """The JSON schema of a config whose recipe fills in what it does not give: no section required."""
    schema.pop("required", None)


class PipelineConfig(BaseModel):
    """Everything the nightly pipeline does, stage by stage."""
    model_config = ConfigDict(extra="forbid", json_schema_extra=_every_section_may_be_left_to_the_recipe)
    recipe: str = Field("default", description="the recipe under this config (flows/recipes/<name>.yaml): "
                        "its values fill in whatever the config does not give")
    data_root: str = Field("sluice-data", description="datasets, scores, runs and the model registry live here")
    data: DataSection = Field(
        description="what the night trains on: data.kind (image, tokens, ...) and its sources, and the rest of "
        "the section in the shape that kind declares (stages/kinds)")
    selection: SelectionConfig = Field(default_factory=SelectionConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    promotion: PromotionConfig = Field(default_factory=PromotionConfig)
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
    engine: EngineConfig = Field(default_factory=EngineConfig,
                                 description="where the data stages' parts run: local (this machine's pool) or "
                                             "ray (a Ray cluster: engine.address, or one started on 127.0.0.1); "
                                             "the image shard map, the text stage's signatures and tokenizing, and "
                                             "verify's checks so far (stages/data/engine.py)")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig,
                                     description="where each night's run and candidate are mirrored: MLflow (an "
                                                 "embedded SQLite store under data_root by default; tracking.uri: "
                                                 "none turns it off) and other registered trackers (stages/track)")
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
        moved = {k: MOVED[k] for k in data if k in MOVED}
        if moved:
            raise ValueError("these sections moved into the one data section: "
                             + "; ".join(f"{k} -> {v}" for k, v in moved.items()))
        merged = overlay(load_recipe(data.get("recipe") or "default"), data)
        return resolve_auto(merged, needs_il=_method_needs_il(merged.get("selection")),
                            wants_cuda=_device_wants_cuda(merged.get("train")))

    @field_validator("data", mode="before")
    @classmethod
    def _the_kinds_shape(cls, v: Any) -> DataConfig:
        """The section as its kind declares it (``DATA_KINDS``)."""
        return data_config(v)

    @model_validator(mode="after")
    def _one_place_for_the_shard_map(self) -> "PipelineConfig":
        if self.engine.name != "local" and self.prepare_runner != "local":
            raise ValueError(f"engine: {self.engine.name} and prepare_runner: {self.prepare_runner} both say where the "
                             "shard writes run: keep one (prepare_runner: local with an engine)")
        return self

    @model_validator(mode="after")
    def _one_seed(self) -> "PipelineConfig":
        """``train.seed`` seeds the whole run: the kind's draws (an image loader's augmentation and
        sampler order) and the selection method's follow it unless one of them is set on its own."""
        self.data = self.data.with_seed(self.train.seed)
        if "seed" not in self.selection.model_fields_set:
            self.selection.seed = self.train.seed
        return self

    @model_validator(mode="after")
    def _the_kind_can_train_it(self) -> "PipelineConfig":
        """Checked here, before any stage runs, by the kind: the model is one its batches train,
        the selection method can select its samples, promotion is by its metric on splits that
        hold samples, and a warm start's replay can replay them."""
        kind = self.kind()
        kind.check(self.train, self.data, self.selection)
        why = kind.selection_refusal(self.selection.method, self.data)
        if why:
            raise ValueError(why)
        if self.warm.init == "champion":
            why = kind.replay_refusal(self.warm.replay)
            if why:
                raise ValueError(why)
        self.promotion = self.promotion.for_kind(kind)
        for name in ("eval_split", "report_split"):
            split = getattr(self.promotion, name)
            if split == "train":
                raise ValueError(f"promotion.{name}=train: a model is never graded on what it trained on")
            # (no fraction: a source may bring its own test split)
            if self.data.split_fraction(split) == 0:
                raise ValueError(f"promotion.{name}={split!r} but the data section gives that split no share "
                                 f"({split}_fraction is 0), so it would be empty")
        return self

    def kind(self) -> DataKind:
        """The kind of data this config trains on."""
        return kind_of(self.data.kind)

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
        loader = loader_device(self.data.loader_device(), device)
        return describe("cuda", resolve_amp(self.train.amp, device), ranks, threads, self.train.batch_size,
                        gpus=f"{visible_gpus()} × {gpu_name(0)}", loader_device=str(loader))

    # where things live
    def datasets_dir(self) -> Path:
        """Where every dataset lives: each source under ``<name>/``."""
        return Path(self.data_root) / "datasets"

    def scores_dir(self) -> Path:
        return Path(self.data_root) / "scores"

    def registry_dir(self) -> Path:
        return Path(self.data_root) / "registry"

    def runs_dir(self) -> Path:
        return Path(self.data_root) / "runs"


def prepare_data(c: PipelineConfig, log: Callable[[str], None] = lambda line: None,
                 map_shards: Callable | None = None) -> DatasetVersion:
    """The night's dataset version (each source's, found or written): the prepare stage in Python."""
    return c.kind().prepare(c.data, c.datasets_dir(), log=log, map_shards=map_shards)


def training_job(c: PipelineConfig, version: DatasetVersion, il_path: str | None, verified: bool = False,
                 start: Start | None = None) -> TrainJob:
    """The typed training job for this pipeline on ``version``, from where its weights ``start``
    (default: scratch), assembled once (``stages/run/assemble.py``). ``verified``: the flow checked
    every sample's checksum already, so the ranks' loaders do not again."""
    return assemble_job(c.kind(), c.train, c.data, c.selection, c.promotion.report_split, version, il_path,
                        start or Start(why="from scratch"), verified=verified)
