"""``cutout``: zero a ``size``×``size`` square at a random centre with probability ``p``."""
from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from sluice.stages.load.augment.base import (AUGMENT_OPS, AugmentOp, DaliContext, Params,
                                             TorchContext, same_size)


@AUGMENT_OPS.register("cutout")
class Cutout(AugmentOp):
    """Zero a ``size``×``size`` square at a random centre with probability ``p``."""
    op: Literal["cutout"] = "cutout"
    size: int = Field(8, ge=1)
    p: float = Field(1.0, ge=0.0, le=1.0)

    needs_sizes = True
    dali_input_types = (("anchor", "float"), ("shape", "float"))

    def draw(self, n, hs, ws, resolution, gen) -> Params:
        if same_size(hs, ws):
            cy = torch.randint(0, int(hs[0]), (n,), generator=gen)
            cx = torch.randint(0, int(ws[0]), (n,), generator=gen)
        else:
            cy = (torch.rand(n, generator=gen) * torch.from_numpy(hs)).long()
            cx = (torch.rand(n, generator=gen) * torch.from_numpy(ws)).long()
        on = torch.rand(n, generator=gen) < self.p
        return {"cy": cy, "cx": cx, "on": on, "hw": torch.from_numpy(np.stack([hs, ws], 1))}

    def apply_torch(self, x, params, ctx: TorchContext, fused=None):
        n, _, h, w = x.shape
        cy = params["cy"].to(x.device).view(n, 1, 1)
        cx = params["cx"].to(x.device).view(n, 1, 1)
        on = params["on"].to(x.device).view(n, 1, 1)
        ys = torch.arange(h, device=x.device).view(1, h, 1)
        xs = torch.arange(w, device=x.device).view(1, 1, w)
        half = self.size // 2
        box = (ys >= cy - half) & (ys < cy - half + self.size) & (xs >= cx - half) \
            & (xs < cx - half + self.size) & on
        ctx.owned = True
        return x.masked_fill(box.unsqueeze(1), 0.0)

    def dali_inputs(self, params, n):
        cy, cx, on = params["cy"].numpy(), params["cx"].numpy(), params["on"].numpy()
        hs, ws = params["hw"].numpy().T
        half = self.size // 2
        y0, x0 = np.maximum(cy - half, 0), np.maximum(cx - half, 0)
        y1, x1 = np.minimum(cy - half + self.size, hs), np.minimum(cx - half + self.size, ws)
        shape = np.stack([np.maximum(y1 - y0, 0), np.maximum(x1 - x0, 0)], 1) * on[:, None]
        return [np.stack([y0, x0], 1).astype(np.float32), shape.astype(np.float32)]

    def apply_dali(self, x: Any, inputs: list[Any], ctx: DaliContext) -> Any:
        from nvidia.dali import fn
        anchor, shape = inputs
        return fn.erase(x, anchor=anchor, shape=shape, axis_names="HW", fill_value=0)
