"""``random_resized_crop``: crop a random area fraction ``scale`` with aspect ratio in ``ratio``
and resize it to ``size`` (or the epoch's resolution), sampled like torchvision's."""
from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from sluice.stages.load.augment.base import (AUGMENT_OPS, AugmentOp, DaliContext, Params,
                                             TorchContext, same_size)


def rrc_boxes(n: int, h: int, w: int, scale, ratio, gen: torch.Generator) -> torch.Tensor:
    """(n, 4) crop boxes (top, left, height, width) sampled like torchvision's RandomResizedCrop:
    ten tries per sample, then the centred crop clamped to the ratio range."""
    area = h * w
    tries = 10
    s = torch.empty(n, tries).uniform_(scale[0], scale[1], generator=gen) * area
    logr = torch.empty(n, tries).uniform_(math.log(ratio[0]), math.log(ratio[1]), generator=gen)
    r = torch.exp(logr)
    cw = torch.sqrt(s * r).round()
    ch = torch.sqrt(s / r).round()
    ok = (cw > 0) & (ch > 0) & (cw <= w) & (ch <= h)
    first = torch.where(ok.any(1), ok.float().argmax(1), torch.full((n,), -1))
    rows = torch.arange(n)
    pick = first.clamp(min=0)
    bw, bh = cw[rows, pick], ch[rows, pick]
    # fallback: whole image, clamped to the ratio range
    in_ratio = w / h
    if in_ratio < ratio[0]:
        fw, fh = w, round(w / ratio[0])
    elif in_ratio > ratio[1]:
        fw, fh = round(h * ratio[1]), h
    else:
        fw, fh = w, h
    bad = first < 0
    bw = torch.where(bad, torch.tensor(float(fw)), bw)
    bh = torch.where(bad, torch.tensor(float(fh)), bh)
    top = (torch.rand(n, generator=gen) * (h - bh + 1)).floor()
    left = (torch.rand(n, generator=gen) * (w - bw + 1)).floor()
    top = torch.where(bad, ((h - bh) / 2).floor(), top)
    left = torch.where(bad, ((w - bw) / 2).floor(), left)
    return torch.stack([top, left, bh, bw], 1)


def crop_resize(x: torch.Tensor, boxes: torch.Tensor, out_hw: tuple[int, int],
                flip: torch.Tensor | None = None, sizes: torch.Tensor | None = None) -> torch.Tensor:
    """Crop each image of NCHW ``x`` to its box and resize to ``out_hw``, in one grid_sample;
    ``flip`` (bool per sample) mirrors those outputs for free by negating the x scale.

    ``sizes`` (N, 2): ``x`` is a zero-padded canvas and image k fills only its top-left
    ``sizes[k]``; boxes are in each image's pixels. The affine map sends output pixel centres to
    ``left + bw·(j + ½)/ow − ½`` whatever the canvas width, so only the border differs: the
    sample points are clamped to each image's own last row and column, as ``padding_mode=
    "border"`` clamps a lone image, and the padding is never read."""
    n, _, h, w = x.shape
    b = boxes.to(x.device, torch.float32)
    top, left, bh, bw = b.unbind(1)
    theta = torch.zeros(n, 2, 3, device=x.device)
    theta[:, 0, 0] = bw / w
    if flip is not None:
        theta[:, 0, 0] = torch.where(flip.to(x.device), -theta[:, 0, 0], theta[:, 0, 0])
    theta[:, 0, 2] = (2 * left + bw) / w - 1
    theta[:, 1, 1] = bh / h
    theta[:, 1, 2] = (2 * top + bh) / h - 1
    grid = F.affine_grid(theta, (n, x.shape[1], *out_hw), align_corners=False)
    if sizes is not None:  # pixel p of a side of n is at (2p + 1)/n - 1: clamp to [0, size - 1]
        s = sizes.to(x.device, torch.float32)
        lo = torch.tensor([1 / w - 1, 1 / h - 1], device=x.device)
        hi = torch.stack([(2 * s[:, 1] - 1) / w - 1, (2 * s[:, 0] - 1) / h - 1], 1).view(n, 1, 1, 2)
        grid = torch.minimum(grid.clamp(min=lo), hi)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


@AUGMENT_OPS.register("random_resized_crop")
class RandomResizedCrop(AugmentOp):
    """Crop a random area fraction ``scale`` with aspect ratio in ``ratio``, resize to ``size``."""
    op: Literal["random_resized_crop"] = "random_resized_crop"
    size: int | None = Field(None, ge=1, description="output side; default: the stored size (or the epoch's resolution)")
    scale: tuple[float, float] = (0.35, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)

    needs_sizes = True
    makes_one_size = True
    dali_input_types = (("roi_start", "float"), ("roi_end", "float"), ("size", "float"))

    def output_sizes(self, hs, ws, resolution):
        side = resolution or self.size
        if not side:
            return hs, ws
        return np.full(len(hs), side, np.int64), np.full(len(ws), side, np.int64)

    def draw(self, n, hs, ws, resolution, gen) -> Params:
        if same_size(hs, ws):
            boxes = rrc_boxes(n, int(hs[0]), int(ws[0]), self.scale, self.ratio, gen)
        else:
            boxes = torch.cat([rrc_boxes(1, int(h), int(w), self.scale, self.ratio, gen)
                               for h, w in zip(hs, ws)])
        oh, ow = self.output_sizes(hs, ws, resolution)
        return {"boxes": boxes, "out": torch.from_numpy(np.stack([oh, ow], 1))}

    def fuses_with(self, following: AugmentOp) -> bool:
        return following.op == "flip"

    def apply_torch(self, x, params, ctx: TorchContext, fused=None):
        out = params["out"][0]
        ctx.resized = ctx.owned = True
        sizes, ctx.sizes = ctx.sizes, None  # every output is out×out
        return crop_resize(x, params["boxes"], (int(out[0]), int(out[1])),
                           fused["mask"] if fused is not None else None, sizes)

    def dali_inputs(self, params, n):
        return boxes_for_dali(params)

    def apply_dali(self, x: Any, inputs: list[Any], ctx: DaliContext) -> Any:
        return resize_boxes_dali(x, inputs, antialias=False)


def boxes_for_dali(params: Params) -> list[np.ndarray]:
    """A crop's drawn ``boxes`` (top, left, h, w) and ``out`` sizes as DALI resize inputs:
    roi_start, roi_end, size."""
    top, left, bh, bw = params["boxes"].numpy().T
    return [np.stack([top, left], 1).astype(np.float32),
            np.stack([top + bh, left + bw], 1).astype(np.float32),
            params["out"].numpy().astype(np.float32)]


def resize_boxes_dali(x: Any, inputs: list[Any], antialias: bool) -> Any:
    """Each image's box resized to its size on DALI (bilinear; ``boxes_for_dali``'s inputs)."""
    from nvidia.dali import fn, types
    roi_start, roi_end, size = inputs
    return fn.resize(x, roi_start=roi_start, roi_end=roi_end, size=size,
                     interp_type=types.INTERP_LINEAR, antialias=antialias, dtype=types.FLOAT)
