"""Typed data specs: what a process that was not handed a loader object (a torchrun worker)
needs to build one. A spec is plain data, complete where it is written (the job is assembled
once, before anything is launched) and validated again where it is read; it names data, never
code. Each spec builds its loader (``build``) at a rank's world size and device, with its
per-rank batch scaled by ``batch_scale`` where a checkpoint of another world size is resumed.

* ``images``: one image artifact or a weighted mixture of several (``mixture.sources: [{path,
  weight}]``; one source is a mixture of one) and a ``LoaderConfig`` (the ``Loader``); the
  config's ``batch_size`` is the per-rank batch;
* ``tokens``: token artifacts, one or a weighted mixture, packed into rows (the ``TokenLoader``);
* ``arrays``: an ``.npz`` or ``fashion-mnist:<split>`` held in memory (the ``ArrayLoader``).
"""
from __future__ import annotations

from fractions import Fraction
from pathlib import PurePath
from typing import Annotated, Any, Literal, Union

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from sluice.errors import ConfigError
from sluice.stages.load.arrays import ArrayLoader, named_arrays
from sluice.stages.load.augment.normalize import Normalize
from sluice.stages.load.base import LoaderBase
from sluice.stages.load.config import LoaderConfig
from sluice.stages.load.loader import Loader
from sluice.stages.load.mixture import MixtureConfig
from sluice.stages.load.tokens import TokenLoader, TokenLoaderConfig
from sluice.stages.per_rank import scaled


class ImagesData(BaseModel):
    """A split of one image artifact or of a weighted mixture of several, loaded by ``Loader``
    (any backend, sampler, augmentation). ``root`` is shorthand for a mixture of that one."""
    model_config = ConfigDict(extra="forbid")
    kind: Literal["images"] = "images"
    mixture: MixtureConfig = Field(description="the sources: each an artifact's path (a version, or a dataset "
                                   "root with LATEST) with weight/repeat/choose, and the subset a warm run trains on")
    loader: LoaderConfig = Field(default_factory=LoaderConfig)
    scores: str | None = Field(None, description=".npy of per-sample scores for the sampler (one source)")

    @model_validator(mode="before")
    @classmethod
    def _root(cls, data: Any) -> Any:
        """``root: <artifact>``: a mixture of that one source, read once an epoch."""
        if isinstance(data, dict) and "root" in data:
            data = dict(data)
            root = str(data.pop("root"))
            data["mixture"] = {"sources": [{"path": root, "name": PurePath(root).name or "source0", "repeat": 1.0}]}
        return data

    @property
    def batch_size(self) -> int:
        return self.loader.batch_size

    def completed(self, batch_size: int, seed: int, normalize: Normalize | None, train: bool) -> "ImagesData":
        """The spec as a job carries it (complete already: its loader config says everything)."""
        return self

    def for_preflight(self) -> "ImagesData":
        """The spec the pre-flight check reads its one batch through: the same batches (the loader
        contract holds on every backend), through the tar shards where the loader would read FFCV's
        ``.beton``, whose pipeline is compiled on first use (seconds, for one batch)."""
        from sluice.stages.load.choice import resolve_backend
        from sluice.storage.artifact import open_artifact
        if self.loader.backend not in ("auto", "ffcv"):
            return self
        for src in self.mixture.sources:
            art = open_artifact(src.path)
            if "webdataset" not in art.manifest.formats or resolve_backend(art, self.loader)[0] != "ffcv":
                return self
        return self.model_copy(update={"loader": self.loader.model_copy(update={"backend": "webdataset"})})

    def build(self, *, rank: int, world_size: int, device: torch.device | None = None,
              batch_scale: Fraction = Fraction(1)) -> LoaderBase:
        scores = np.load(self.scores, allow_pickle=False) if self.scores else None
        cfg = self.loader.model_copy(update={"batch_size": scaled(self.loader.batch_size, batch_scale, "a loader batch")})
        return Loader(mixture=self.mixture, config=cfg, rank=rank, world_size=world_size, scores=scores, device=device)


class ArraysData(BaseModel):
    """Images and labels held in memory (``.npz`` with ``images``/``labels``, or
    ``fashion-mnist:train|test``), batched by ``ArrayLoader``; ``make_job`` fills in the
    batch size, the shuffle and seed and the normalisation from the train config."""
    model_config = ConfigDict(extra="forbid")
    kind: Literal["arrays"] = "arrays"
    path: str
    limit: int | None = Field(None, ge=1, description="the first N samples only")
    batch_size: int | None = Field(None, ge=1, description="default: the training batch size")
    shuffle: bool | None = Field(None, description="default: shuffle for training, not for evaluation")
    train: bool = Field(True, description="training data: even shards and full batches; evaluation: every sample once")
    seed: int = 0
    normalize: Normalize | None = Field(None, description="mean and std the batches are normalised by")
    delay_s: float = Field(0.0, ge=0, description="simulated storage latency per batch")

    def completed(self, batch_size: int, seed: int, normalize: Normalize | None, train: bool) -> "ArraysData":
        """The spec with what it leaves to the job filled in: the job's batch size, seed and
        normalisation, training or evaluation data."""
        if self.normalize is None and normalize is None:
            raise ConfigError("arrays data is normalised with train.normalize_mean/std, and those are auto (resolved "
                              "from a dataset artifact by the pipeline): give the values, or the spec's normalize")
        return self.model_copy(update={"batch_size": self.batch_size or batch_size, "seed": seed, "train": train,
                                       "normalize": self.normalize or normalize})

    def for_preflight(self) -> "ArraysData":
        """The spec the pre-flight check reads its one batch through: this one."""
        return self

    def build(self, *, rank: int, world_size: int, device: torch.device | None = None,
              batch_scale: Fraction = Fraction(1)) -> LoaderBase:
        images, labels = named_arrays(self.path)
        if self.limit:
            images, labels = images[:self.limit], labels[:self.limit]
        batch = scaled(self.batch_size or 128, batch_scale, "a batch") if self.train else (self.batch_size or 128)
        return ArrayLoader(images, labels, batch, shuffle=self.train if self.shuffle is None else self.shuffle,
                           seed=self.seed, rank=rank, world_size=world_size, drop_last=self.train,
                           even=self.train, delay_s=self.delay_s, device=device if device is not None else "cpu",
                           normalize=self.normalize)


class TokensData(BaseModel):
    """Packed token rows from one token artifact or a weighted mixture of them (``TokenLoader``);
    ``loader.batch_size`` is the per-rank number of rows."""
    model_config = ConfigDict(extra="forbid")
    kind: Literal["tokens"] = "tokens"
    loader: TokenLoaderConfig

    @property
    def batch_size(self) -> int:
        return self.loader.batch_size

    def completed(self, batch_size: int, seed: int, normalize: Normalize | None, train: bool) -> "TokensData":
        """The spec as a job carries it (complete already: its loader config says everything)."""
        return self

    def for_preflight(self) -> "TokensData":
        """The spec the pre-flight check reads its one batch through: this one."""
        return self

    def build(self, *, rank: int, world_size: int, device: torch.device | None = None,
              batch_scale: Fraction = Fraction(1)) -> LoaderBase:
        cfg = self.loader.model_copy(update={"batch_size": scaled(self.loader.batch_size, batch_scale, "a loader batch")})
        return TokenLoader(None, cfg, rank=rank, world_size=world_size)


DataSpec = Annotated[Union[ImagesData, ArraysData, TokensData], Field(discriminator="kind")]
