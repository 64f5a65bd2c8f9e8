"""``flip``: horizontal flip with probability ``p``."""
from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from sluice.stages.load.augment.base import AUGMENT_OPS, AugmentOp, DaliContext, Params, TorchContext


@AUGMENT_OPS.register("flip")
class Flip(AugmentOp):
    """Horizontal flip with probability ``p``."""
    op: Literal["flip"] = "flip"
    p: float = Field(0.5, ge=0.0, le=1.0)

    dali_input_types = (("flip", "int32"),)

    def draw(self, n, hs, ws, resolution, gen) -> Params:
        return {"mask": torch.rand(n, generator=gen) < self.p}

    def apply_torch(self, x, params, ctx: TorchContext, fused=None):
        m = params["mask"].to(x.device)
        if m.any():
            if not ctx.owned:
                x, ctx.owned = x.clone(), True
            x[m] = x[m].flip(-1)
        return x

    def dali_inputs(self, params, n):
        return [params["mask"].numpy().astype(np.int32)]

    def apply_dali(self, x: Any, inputs: list[Any], ctx: DaliContext) -> Any:
        from nvidia.dali import fn
        return fn.flip(x, horizontal=inputs[0], vertical=0)
