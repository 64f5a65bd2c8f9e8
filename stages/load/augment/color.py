"""``brightness_contrast``: scale brightness by U(1±brightness) and contrast around the image
mean by U(1±contrast)."""
from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from sluice.stages.load.augment.base import AUGMENT_OPS, AugmentOp, DaliContext, Params, TorchContext


@AUGMENT_OPS.register("brightness_contrast")
class BrightnessContrast(AugmentOp):
    """Scale brightness by U(1±brightness) and contrast around the image mean by U(1±contrast)."""
    op: Literal["brightness_contrast"] = "brightness_contrast"
    brightness: float = Field(0.2, ge=0.0, le=1.0)
    contrast: float = Field(0.2, ge=0.0, le=1.0)

    dali_input_types = (("factors", "float"),)

    def draw(self, n, hs, ws, resolution, gen) -> Params:
        b, c = self.brightness, self.contrast
        return {"brightness": torch.empty(n).uniform_(1 - b, 1 + b, generator=gen),
                "contrast": torch.empty(n).uniform_(1 - c, 1 + c, generator=gen)}

    def apply_torch(self, x, params, ctx: TorchContext, fused=None):
        n = x.shape[0]
        bf = params["brightness"].to(x.device).view(n, 1, 1, 1)
        cf = params["contrast"].to(x.device).view(n, 1, 1, 1)
        mean = x.mean(dim=(1, 2, 3), keepdim=True)
        ctx.owned = True
        return (((x - mean) * cf + mean) * bf).clamp(0, 255)

    def dali_inputs(self, params, n):
        bf, cf = params["brightness"].numpy(), params["contrast"].numpy()
        return [np.stack([bf, bf * cf], 1).astype(np.float32)]  # [brightness, contrast*brightness]

    def apply_dali(self, x: Any, inputs: list[Any], ctx: DaliContext) -> Any:
        import nvidia.dali.math as dmath
        from nvidia.dali import fn, types
        factors = inputs[0]
        b = fn.slice(factors, start=[0], shape=[1], axes=[0])
        cb = fn.slice(factors, start=[1], shape=[1], axes=[0])
        if ctx.gpu:
            b, cb = b.gpu(), cb.gpu()
        m = fn.reductions.mean(x, dtype=types.FLOAT)
        xf = fn.cast(x, dtype=types.FLOAT)
        return dmath.clamp((xf - m) * cb + m * b, 0.0, 255.0)
