"""``translate``: pad by ``pad`` pixels (zeros) and crop back at a random offset (CIFAR-style)."""
from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from sluice.stages.load.augment.base import AUGMENT_OPS, AugmentOp, DaliContext, Params, TorchContext


@AUGMENT_OPS.register("translate")
class Translate(AugmentOp):
    """Pad by ``pad`` pixels (zeros) and crop back at a random offset (CIFAR-style)."""
    op: Literal["translate"] = "translate"
    pad: int = Field(2, ge=0)

    dali_input_types = (("shift", "int32"),)

    def draw(self, n, hs, ws, resolution, gen) -> Params:
        if self.pad == 0:
            return {}
        return {"dy": torch.randint(0, 2 * self.pad + 1, (n,), generator=gen),
                "dx": torch.randint(0, 2 * self.pad + 1, (n,), generator=gen)}

    def apply_torch(self, x, params, ctx: TorchContext, fused=None):
        if self.pad == 0:
            return x
        n, c, h, w = x.shape
        pad = self.pad
        padded = F.pad(x, (pad, pad, pad, pad))
        dy, dx = params["dy"].to(x.device), params["dx"].to(x.device)
        rows = dy.view(n, 1) + torch.arange(h, device=x.device).view(1, h)
        cols = dx.view(n, 1) + torch.arange(w, device=x.device).view(1, w)
        out = padded.gather(2, rows.view(n, 1, h, 1).expand(n, c, h, w + 2 * pad))
        ctx.owned = True
        return out.gather(3, cols.view(n, 1, 1, w).expand(n, c, h, w))

    def dali_inputs(self, params, n):
        if self.pad == 0:
            return [np.zeros((n, 2), np.int32)]
        return [np.stack([params["dy"].numpy(), params["dx"].numpy()], 1).astype(np.int32) - self.pad]

    def apply_dali(self, x: Any, inputs: list[Any], ctx: DaliContext) -> Any:
        if self.pad == 0:
            return x
        from nvidia.dali import fn
        return fn.slice(x, start=inputs[0], rel_shape=[1.0, 1.0], axis_names="HW",
                        out_of_bounds_policy="pad", fill_values=0)
