"""The kind of data as a registered axis (``DATA_KINDS``), like models, backends and selection
methods: ``image`` and ``tokens`` are entries, and a third is one more.

A kind owns everything that differs between kinds of data, behind one interface (``DataKind``):

* **its config**: the shape of the pipeline's ``data:`` section (``Config``, a ``DataConfig``:
  every kind has ``sources``, each a name, a location and a weight);
* **preparation**: how each source becomes a versioned artifact, and what the night's set of
  versions is (``prepare`` → a typed ``DatasetVersion``); how it is verified (``verify``); how
  a source or an artifact given on the command line is recognised (``claims``, ``owns``);
* **reading**: its loader spec in a training job (``data_specs``), with the warm run's
  per-source subsets;
* **its task**: the trainer's ``task`` (``stages/train/tasks.TASKS``), the metric promotion
  compares and which way is better (``metric``, ``higher_is_better``), how a checkpoint is
  graded on a split (``grade``), and what selection keys on (``key_hashes``, ``samples``:
  samples or documents);
* **capabilities**: which selection methods and replay policies apply, and why not.

The flows, promotion, grading, warm start, replay, reports and the CLI call this interface and
never branch on the kind. Register a kind with ``@DATA_KINDS.register(name)`` beside its code
(one file), plus one import line in ``stages/kinds/__init__.py``.
"""
from __future__ import annotations

import os
from pathlib import Path, PurePath
from typing import Any, Callable, ClassVar, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from sluice.errors import ConfigError
from sluice.plugins import PluginRegistry
from sluice.stages.load.specs import DataSpec
from sluice.stages.select.config import SelectionConfig
from sluice.stages.train.config import TrainConfig

Log = Callable[[str], None]


class DataSource(BaseModel):
    """One source of a night's data: its name (its dataset folder under ``datasets/``, and its
    name in the mixture and in per-source metrics), where it is, and its weight in the mixture."""
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="the dataset folder's name")
    source: str = Field(description="where the data is: a folder, a file, a registered source name")
    weight: float = Field(1.0, gt=0, description="the source's share of a training epoch (in the kind's "
                          "unit: samples, or tokens for text)")


class DataConfig(BaseModel):
    """The pipeline's ``data:`` section: every kind's has ``kind`` and ``sources`` (one source
    is a mixture of one; ``source`` is shorthand for a single source named after its folder);
    the rest is the kind's own."""
    model_config = ConfigDict(extra="forbid")
    kind: str = Field(description="a registered kind of data: image, tokens, ...")
    sources: list[DataSource] = Field(default_factory=list, description="one or more sources, mixed by weight")
    source: str | None = Field(None, exclude=True, description="shorthand for one source (replaces sources): its "
                               "name is `name`, else the location's last part")
    name: str | None = Field(None, exclude=True, description="with `source`: the source's name")
    epoch_size: int | None = Field(None, ge=1, description="a training epoch of the mixture, in the kind's unit "
                                   "(default: every sample or token of the sources once)")

    @model_validator(mode="after")
    def _one_or_more_sources(self) -> "DataConfig":
        if self.source is not None:
            self.sources = [DataSource(name=self.name or (PurePath(self.source.rstrip("/")).name or "data"),
                                       source=self.source)]
            self.source = self.name = None
        if not self.sources:
            raise ValueError("data: give sources (or source)")
        names = [s.name for s in self.sources]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"data.sources: names must be unique (each is a dataset folder); repeated: {dup}")
        return self

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    def with_seed(self, seed: int) -> "DataConfig":
        """This section with the run's seed wherever the kind draws and nothing set its own."""
        return self

    def split_fraction(self, split: str) -> float | None:
        """The share of each source's samples ``split`` gets (None: it depends on the source)."""
        return None

    def loader_device(self) -> str:
        """Where the kind's loader makes batches (``auto``: on the rank's device)."""
        return "cpu"


class SourceVersion(BaseModel):
    """One source's version, as the night prepared it."""
    model_config = ConfigDict(extra="forbid")
    name: str
    location: str = Field(description="where the source data is")
    root: str = Field(description="the version's directory")
    fingerprint: str
    weight: float = 1.0
    counts: dict[str, int] = Field(description="samples (documents) per split")
    reused: bool = False
    quarantined: int = 0
    seconds: float = 0.0
    delta: dict[str, Any] | None = Field(None, description="what changed since its parent version")


class DatasetVersion(BaseModel):
    """What the night trains on: the kind and each source's version, one fingerprint for the
    set, the splits' counts over every source; a kind adds its own typed facts (a subclass)."""
    model_config = ConfigDict(extra="forbid")
    kind: str
    fingerprint: str
    sources: list[SourceVersion] = Field(min_length=1)
    counts: dict[str, int]
    reused: bool = False
    quarantined: int = 0

    @property
    def root(self) -> str:
        """The first source's version directory (a night of one source: its version)."""
        return self.sources[0].root

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    def with_counts(self, split: str) -> list[SourceVersion]:
        """The sources whose ``split`` holds samples (an empty split cannot be read)."""
        return [s for s in self.sources if s.counts.get(split, 0)]


class Grade(BaseModel):
    """A checkpoint graded on every sample of a split: the kind's metric (``value``), the mean
    loss and accuracy, the count (samples or tokens), and the same per source."""
    model_config = ConfigDict(extra="allow")
    value: float
    loss: float
    acc: float
    n: int
    by_source: dict[str, dict[str, float]] = Field(default_factory=dict)


class WarmSource(BaseModel):
    """What a warm start needs of one source's training split tonight: each sample's lineage key
    (as ``key_hashes`` hashes it), which samples are live, and the keys whose content changed
    since the champion's version of the source (``redo``: the champion learnt something else
    under them, so they count as new)."""
    model_config = ConfigDict(arbitrary_types_allowed=True)
    name: str
    root: str
    keys: list[str]
    live: np.ndarray
    redo: set[str] = Field(default_factory=set)


class Servable(BaseModel):
    """A trained model as a tracker serves it (``DataKind.servable``): a module that takes what a
    user has (images as uint8, token ids) and returns what grading scored, an example input
    (the exported graph is traced on it; dimensions of -1 in ``shape`` stay free), and what it
    reads, in words, for the model's description."""
    model_config = ConfigDict(arbitrary_types_allowed=True)
    module: Any
    example: Any  # a numpy array
    shape: tuple[int, ...]  # the input's shape, -1 where any size is taken
    reads: str


class DataKind:
    """One kind of data (see the module docstring). Subclasses set the class attributes and
    implement the methods; the defaults say what a kind without the capability answers."""
    name: ClassVar[str] = ""
    Config: ClassVar[type[DataConfig]] = DataConfig
    Version: ClassVar[type[DatasetVersion]] = DatasetVersion
    task: ClassVar[str] = "classify"  # the trainer's task for its batches (stages/train/tasks.TASKS)
    metric: ClassVar[str] = "acc"  # what promotion compares, on the eval split
    higher_is_better: ClassVar[bool] = True
    samples: ClassVar[str] = "samples"  # what one of its samples is called (documents, ...)
    curve: ClassVar[tuple[str, str, tuple[float, float]]] = ("acc", "accuracy", (0.0, 1.0))  # report chart
    split_rule: ClassVar[str] = "the split settings"  # what moves samples between splits (grading errors name it)
    trains: ClassVar[str] = "classifiers"  # the models its task trains, as a refusal names them
    # the data settings that decide a batch's input shape, as the pre-flight check names them
    input_settings: ClassVar[str] = "the data section's settings that shape a batch"

    # ------------------------------------------------------------------ preparation
    def claims(self, source: str) -> bool:
        """Whether ``source`` (a path or a source name given to ``sluice shard``) holds this kind's data."""
        return False

    def owns(self, artifact: str | os.PathLike) -> bool:
        """Whether ``artifact`` (a version or a dataset root) is this kind's."""
        return False

    ShardConfig: ClassVar[type[BaseModel]] = BaseModel  # what `sluice shard` reads --config and --set into

    def shard_overrides(self, source: str) -> list[str]:
        """``--set`` lines that put ``source`` into the kind's shard config."""
        return []

    def shard(self, source: str, out: str | os.PathLike, config: BaseModel, progress: bool,
              map_shards: Callable | None = None) -> str:
        """``sluice shard``: ``source`` as a version under ``out``; what was written, for a person.
        ``map_shards``: where the parts run (``stages/data/engine.py``; None: this machine's pool)."""
        raise ConfigError(f"kind {self.name!r} cannot shard from the command line")

    def verify_artifact(self, artifact: str | os.PathLike, full: bool, *,
                        parts: Any = None) -> tuple[bool, dict[str, Any], str]:
        """``sluice verify``: (ok, the report as JSON, the report for a person). ``parts``: where
        the checks may run in parts (``stages/data/engine.py``; None: here)."""
        raise ConfigError(f"kind {self.name!r} cannot verify an artifact")

    def prepare(self, data: DataConfig, datasets_dir: Path, *, log: Log,
                map_shards: Callable | None = None) -> DatasetVersion:
        """Each source's version under ``datasets_dir/<name>`` (found when its content and config
        are unchanged, written otherwise), and the night's set of them. ``map_shards``: where a
        kind that writes shards in parallel may run them (a Prefect task runner)."""
        raise NotImplementedError

    def version_of(self, roots: Sequence[str | os.PathLike], names: Sequence[str] | None = None,
                   weights: Sequence[float] | None = None) -> DatasetVersion:
        """The version of artifacts written already (by ``sluice shard``, a script): what a job is
        assembled over outside the flow. ``names``: default each dataset folder's name."""
        raise NotImplementedError

    def verify(self, version: DatasetVersion, data: DataConfig, log: Log, *, parts: Any = None) -> dict[str, Any]:
        """Every sample's checksum before any rank reads one: a summary for the report (damage
        fails here, naming it, unless the kind's loader is set to skip it); ``log`` gets the
        check's report. ``parts``: as for ``verify_artifact``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the training job
    def check(self, train: TrainConfig, data: DataConfig, selection: SelectionConfig) -> None:
        """Refuse, before anything runs, a model or settings this kind cannot train with: by
        default a model trained for another task than the kind's batches are for."""
        from sluice.stages.models import model_task
        if train.model == "auto":
            return  # the kind picks a model of its own task (train_config)
        task = model_task(train.model)
        if task != self.task:
            raise ConfigError(f"train.model={train.model!r} is trained for {task}, and data.kind {self.name} "
                              f"trains {self.trains}")

    def selection_refusal(self, method: str, data: DataConfig) -> str | None:
        """Why selection method ``method`` cannot select this kind's samples (None: it can)."""
        return None

    def irreducible_loss(self, version: DatasetVersion, selection: SelectionConfig, scores_root: str,
                         device: str, parts: Any = None) -> dict[str, Any]:
        """The irreducible-loss scores of the train split, for a method that needs them."""
        raise ConfigError(f"selection method {selection.method!r} needs irreducible-loss scores, and kind "
                          f"{self.name!r} computes none")

    def warm_refusal(self, champion_data: dict[str, Any], version: DatasetVersion) -> str | None:
        """Why a champion registered with ``champion_data`` (its record's data facts) cannot
        start tonight's run from its weights, beyond what it trained on (None: it can)."""
        return None

    def facts(self, version: DatasetVersion) -> dict[str, Any]:
        """What the registry records of the version beside its sources (a tokenizer's hash)."""
        return {}

    def carry_selector(self, table: Any, champion_versions: dict[str, str], version: DatasetVersion, split: str,
                       learnt: np.ndarray, out: Path) -> Any:
        """A selection method's per-sample table carried from the champion into a warm run
        (``select/infobatch_carry.CarriedTable``), or why it starts empty."""
        from sluice.stages.select.infobatch_carry import CarriedTable
        return CarriedTable(None, 0, f"a selection table is not carried over {self.name} samples")

    def replay_refusal(self, policy: str) -> str | None:
        """Why replay policy ``policy`` cannot replay this kind's samples (None: it can)."""
        return None

    def train_config(self, train: TrainConfig, version: DatasetVersion) -> TrainConfig:
        """The train config as this version makes it (its classes, channels, vocabulary), with
        its ``auto`` settings resolved from the data (a model, at least)."""
        return train

    def config_for(self, train: TrainConfig, version: DatasetVersion) -> TrainConfig:
        """``train_config``, with what the kind left ``auto`` settled the neutral way: images not
        resized (``input_size``); a model the kind does not pick is refused, naming the kind."""
        config = self.train_config(train, version)
        if config.input_size == "auto":
            config = config.model_copy(update={"input_size": None})
        if config.model == "auto":
            raise ConfigError(f"train.model: auto, and data.kind {self.name} picks no model for its data: "
                              "name a registered model")
        return config

    def explain(self, train: TrainConfig, version: DatasetVersion) -> list[str]:
        """What ``train_config`` resolves ``auto`` settings to for ``version``, and why: one line
        each (``sluice config show``, the run's log)."""
        return []

    def data_specs(self, train: TrainConfig, data: DataConfig, version: DatasetVersion, *, eval_split: str,
                   batch_size: int, selects: bool, subsets: dict[str, str] | None = None,
                   verified: bool = False) -> tuple[DataSpec, DataSpec]:
        """The training job's data: ``batch_size`` candidates per rank from the train splits
        (each source only its ``subsets`` entry where given: a warm run's), and every sample of
        ``eval_split`` once. ``selects``: a selection method will key the batches; ``verified``:
        every checksum was checked already (the loaders need not again)."""
        raise NotImplementedError

    def selection_size(self, version: DatasetVersion) -> int:
        """The rows of a selection method's per-sample table: what selection keys on (the train
        split's samples over every source)."""
        return int(version.counts.get("train", 0))

    # ------------------------------------------------------------------ lineage, grading, warm start
    def lineage_keys(self, version: DatasetVersion, split: str) -> list[str]:
        """Each sample of ``split`` over every source, by the key its lineage records."""
        raise NotImplementedError

    def key_hashes(self, version: DatasetVersion, splits: Sequence[str]) -> np.ndarray:
        """Sorted 64-bit hashes of every key in ``splits``: what a model trained on, or is graded on."""
        from sluice.storage.lineage import key_hashes
        return key_hashes(k for s in splits for k in self.lineage_keys(version, s))

    def grade(self, checkpoint: str | os.PathLike, version: DatasetVersion, split: str, *,
              data: DataConfig, files: dict[str, str], facts: dict[str, Any]) -> Grade:
        """``checkpoint`` on every sample of ``split`` of every source that holds one: the
        kind's metric, overall and per source. ``files`` and ``facts``: what the model was
        registered with beside its checkpoint (``model_files``, ``facts`` of the version it
        trained on: a language model's tokenizer)."""
        raise NotImplementedError

    def model_files(self, version: DatasetVersion) -> dict[str, str]:
        """Files a trained model needs beside its checkpoint (registered with it): name -> path."""
        return {}

    def servable(self, checkpoint: str | os.PathLike, version: DatasetVersion) -> Servable:
        """The model in ``checkpoint`` as an input-to-scores module that reproduces its grade on
        ``version``'s splits (normalisation and test-time augmentation inside): what a tracker
        registers, to be loaded and served without Sluice's loaders."""
        raise NotImplementedError(f"the {self.name} kind does not say how its models are served")

    def grading_key(self, data: DataConfig, split: str) -> str:
        """What besides the versions and the split decides the samples a grade reads (a language
        model's row length): two grades with equal keys are on the same samples."""
        return split

    def warm_sources(self, version: DatasetVersion, split: str,
                     champion_versions: dict[str, str]) -> list[WarmSource] | str:
        """Tonight's ``split`` per source for a warm start from a champion trained on
        ``champion_versions`` (source name -> fingerprint), or why it cannot start warm."""
        return f"kind {self.name!r} plans no warm start"

    def champion_losses(self, checkpoint: str | os.PathLike, version: DatasetVersion, split: str,
                        indices: np.ndarray) -> np.ndarray:
        """The champion's loss on each of ``indices`` (over the sources, in order): what the
        ``champion_loss`` replay weighs old samples by."""
        raise ConfigError(self.replay_refusal("champion_loss") or "no per-sample losses")

    def champion_refusal(self, champion_data: dict[str, Any]) -> str | None:
        """Why a champion registered with ``champion_data`` (its record's data facts) is no model
        of this kind (None: it is one): such a champion can neither start tonight's run nor be
        graded on tonight's samples."""
        theirs = champion_data.get("kind") or ("tokens" if champion_data.get("modality") == "tokens" else "image")
        if theirs != self.name:
            return (f"it is a model of data.kind {theirs} and tonight trains {self.name}: give each kind of data "
                    "its own data_root (its own registry)")
        return None

    def reread_lineage(self, fingerprint: str, datasets_dir: Path, names: Sequence[str] = ()) -> np.ndarray | None:
        """What a champion registered before lineage was kept trained on, re-read from its
        version under one of the dataset folders ``names`` when it is still on disk (None: it
        cannot be)."""
        return None

    def describe(self, version: DatasetVersion) -> list[str]:
        """Lines for the report's dataset section, beyond the sources' counts."""
        return []


DATA_KINDS: PluginRegistry[type[DataKind]] = PluginRegistry("data_kinds", "kind of data")


def kind_of(name: str) -> DataKind:
    """The registered kind ``name``, ready to use."""
    return DATA_KINDS.get(name)()


def data_config(value: Any) -> DataConfig:
    """``value`` (a mapping with ``kind``, or a config) as its kind's ``DataConfig``."""
    if isinstance(value, DataConfig):
        return value
    if not isinstance(value, dict) or "kind" not in value:
        raise ValueError(f"data needs a kind (one of: {', '.join(DATA_KINDS.names())})")
    return DATA_KINDS.get(DATA_KINDS.validate(value["kind"])).Config.model_validate(value)


def kind_claiming(source: str, asked: str | None = None) -> DataKind:
    """The kind whose data ``source`` holds (``asked``: the one the user named), or a clear error."""
    if asked is not None:
        return kind_of(DATA_KINDS.validate(asked))
    found = [n for n in DATA_KINDS.names() if kind_of(n).claims(source)]
    if len(found) != 1:
        raise ConfigError(f"{source}: " + (f"held data of kinds {found}; say which with --kind" if found else
                                           f"no kind of data ({', '.join(DATA_KINDS.names())}) recognises it"))
    return kind_of(found[0])


def kind_owning(artifact: str | os.PathLike) -> DataKind:
    """The kind whose artifact ``artifact`` is, or a clear error."""
    for n in DATA_KINDS.names():
        k = kind_of(n)
        if k.owns(artifact):
            return k
    raise ConfigError(f"{artifact}: no artifact of a known kind ({', '.join(DATA_KINDS.names())}) is there")
