"""Typed data specs: what a process that was not handed a loader object (a torchrun worker)
needs to build one. A spec is plain data, validated where it is written (before anything is
launched) and again where it is read; it names data, never code.

* ``artifact``: a dataset artifact and a ``LoaderConfig`` (the ``Loader``); the config's
  ``batch_size`` is the per-rank batch;
* ``arrays``: an ``.npz`` or ``fashion-mnist:<split>`` held in memory (the ``ArrayLoader``);
* ``tokens``: token artifacts, one or a weighted mixture, packed into rows (the ``TokenLoader``);
* ``image_mixture``: a weighted mixture of image artifacts, ``mixture.sources: [{path, weight}]``
  (the ``MixtureLoader``, ``image_mixture.py``); ``loader`` as for ``artifact``.
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from sluice.stages.contracts import ResumableLoader
from sluice.stages.load.arrays import ArrayLoader, named_arrays
from sluice.stages.load.config import LoaderConfig
from sluice.stages.load.image_mixture import MixtureLoader
from sluice.stages.load.loader import Loader
from sluice.stages.load.mixture import MixtureConfig
from sluice.stages.load.tokens import TokenLoader, TokenLoaderConfig


class ArtifactData(BaseModel):
    """A split of a dataset artifact, loaded by ``Loader`` (any backend, sampler, augmentation)."""
    model_config = ConfigDict(extra="forbid")
    kind: Literal["artifact"] = "artifact"
    root: str = Field(description="an artifact directory, or a dataset root with LATEST")
    loader: LoaderConfig = Field(default_factory=LoaderConfig)
    scores: str | None = Field(None, description=".npy of per-sample scores for the sampler")

    def build(self, *, rank: int, world_size: int, seed: int, train: bool,
              batch_size: int | None = None, device: torch.device | None = None) -> ResumableLoader:
        scores = np.load(self.scores, allow_pickle=False) if self.scores else None
        return Loader(self.root, self.loader, rank=rank, world_size=world_size, scores=scores, device=device)


class ArraysData(BaseModel):
    """Images and labels held in memory (``.npz`` with ``images``/``labels``, or
    ``fashion-mnist:train|test``), batched by ``ArrayLoader``."""
    model_config = ConfigDict(extra="forbid")
    kind: Literal["arrays"] = "arrays"
    path: str
    limit: int | None = Field(None, ge=1, description="the first N samples only")
    batch_size: int | None = Field(None, ge=1, description="default: the training batch size")
    shuffle: bool | None = Field(None, description="default: shuffle for training, not for evaluation")
    delay_s: float = Field(0.0, ge=0, description="simulated storage latency per batch")

    def build(self, *, rank: int, world_size: int, seed: int, train: bool,
              batch_size: int | None = None, device: torch.device | None = None) -> ResumableLoader:
        images, labels = named_arrays(self.path)
        if self.limit:
            images, labels = images[:self.limit], labels[:self.limit]
        return ArrayLoader(images, labels, self.batch_size or batch_size or 128,
                           shuffle=train if self.shuffle is None else self.shuffle, seed=seed,
                           rank=rank, world_size=world_size, drop_last=train, even=train,
                           delay_s=self.delay_s, device=device if device is not None else "cpu")


class TokensData(BaseModel):
    """Packed token rows from one token artifact or a weighted mixture of them (``TokenLoader``);
    ``loader.batch_size`` is the per-rank number of rows."""
    model_config = ConfigDict(extra="forbid")
    kind: Literal["tokens"] = "tokens"
    loader: TokenLoaderConfig

    def build(self, *, rank: int, world_size: int, seed: int, train: bool,
              batch_size: int | None = None, device: torch.device | None = None) -> ResumableLoader:
        return TokenLoader(None, self.loader, rank=rank, world_size=world_size)


class ImageMixtureData(BaseModel):
    """A split of several image artifacts mixed by weight (or ``repeat``/``choose``), loaded by
    ``MixtureLoader``: ``mixture.sources: [{path, weight}]``, the rest of the loader as ``artifact``'s."""
    model_config = ConfigDict(extra="forbid")
    kind: Literal["image_mixture"] = "image_mixture"
    mixture: MixtureConfig
    loader: LoaderConfig = Field(default_factory=LoaderConfig)

    def build(self, *, rank: int, world_size: int, seed: int, train: bool,
              batch_size: int | None = None, device: torch.device | None = None) -> ResumableLoader:
        return MixtureLoader(self.mixture, self.loader, rank=rank, world_size=world_size, device=device)


DataSpec = Annotated[Union[ArtifactData, ArraysData, TokensData, ImageMixtureData], Field(discriminator="kind")]
