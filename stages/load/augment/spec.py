"""``AugmentSpec``: augmentation as data — an ordered list of registered ops — and the one
function that draws a batch's parameters for every backend."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, field_validator

from sluice.errors import ConfigError
from sluice.stages.load.augment.base import AUGMENT_OPS, AugmentOp, Params
from sluice.stages.load.augment.crop import RandomResizedCrop
from sluice.stages.load.augment.flip import Flip
from sluice.stages.load.augment.normalize import Normalize


class AugmentSpec(BaseModel):
    """An ordered list of ops (each a dict with ``op: <registered name>`` and its fields, or an
    op object). Without ``normalize`` the output is x/255 in [0, 1]."""
    model_config = ConfigDict(extra="forbid")
    ops: list[SerializeAsAny[AugmentOp]] = Field(default_factory=list)
    channels_last: bool = False

    @field_validator("ops", mode="before")
    @classmethod
    def _registered_ops(cls, ops: Any) -> Any:
        if not isinstance(ops, (list, tuple)):
            return ops
        out = []
        for k, op in enumerate(ops):
            if isinstance(op, AugmentOp):
                out.append(op)
                continue
            name = op.get("op") if isinstance(op, dict) else None
            if not isinstance(name, str):
                raise ConfigError(f"ops[{k}] needs an 'op' naming a registered op "
                                  f"({', '.join(AUGMENT_OPS.names())}); got {op!r}")
            out.append(AUGMENT_OPS.get(name).model_validate(op))
        return out

    @classmethod
    def standard(cls, size: int | None = None, mean=(0.5,), std=(0.25,)) -> "AugmentSpec":
        """Random resized crop + flip + normalize: the benchmark's augmentation."""
        return cls(ops=[RandomResizedCrop(size=size), Flip(), Normalize(mean=list(mean), std=list(std))])


def draw_params(ops: list[AugmentOp], n: int, hs: np.ndarray, ws: np.ndarray,
                resolution: int | None, gen: torch.Generator) -> list[Params]:
    """Every op's parameters for a batch of ``n`` images of sizes ``hs``×``ws``, drawn in op
    order from ``gen`` before any pixel is touched: what every backend applies."""
    hs, ws = np.asarray(hs, np.int64), np.asarray(ws, np.int64)
    params = []
    for op in ops:
        params.append(op.draw(n, hs, ws, resolution, gen))
        hs, ws = op.output_sizes(hs, ws, resolution)
    return params
