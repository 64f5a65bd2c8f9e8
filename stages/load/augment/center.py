"""``center_crop``: the evaluation transform, torchvision's ``Resize(r) + CenterCrop(size)`` with
``r = floor(size / crop_fraction)``: deterministic (no draws), any image size in, size×size out.

Its boxes are torchvision's own integer arithmetic (the short side resized to ``r``, the long
side to ``int(r·long/short)``, the crop offset ``round((resized − size)/2)``) carried back into
each image's pixels as a fractional box. One ``crop_resize`` (``grid_sample``) or DALI ROI
resize then samples exactly the points torchvision's resize-then-crop samples: without
antialiasing the pixels are torchvision's up to float rounding. With ``antialias`` the torch half
*is* torchvision's algorithm (an antialiased ``interpolate`` to the resized size, then the integer
crop), one call per distinct image size; DALI's antialiased ROI resize differs from it by
filter details only.
"""
from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from sluice.stages.load.augment.base import AUGMENT_OPS, AugmentOp, DaliContext, Params, TorchContext
from sluice.stages.load.augment.crop import boxes_for_dali, crop_resize, resize_boxes_dali


def center_boxes(hs: np.ndarray, ws: np.ndarray, side: int | np.ndarray, crop_fraction: float,
                 squash: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For images hs×ws and output ``side``: (boxes (N, 4) float top, left, height, width in each
    image's pixels; resized (N, 2) int — torchvision's Resize target; offset (N, 2) int — its
    CenterCrop offset in the resized image). ``squash``: both sides are resized to
    ``side / crop_fraction`` (timm's ``crop_mode="squash"``), so the aspect ratio is not kept
    and nothing but the ``crop_fraction`` border is cut."""
    hs, ws = np.asarray(hs, np.int64), np.asarray(ws, np.int64)
    side = np.broadcast_to(np.asarray(side, np.int64), hs.shape)
    short, long_ = np.minimum(hs, ws), np.maximum(hs, ws)
    r = np.floor(side / crop_fraction + 1e-9).astype(np.int64)  # timm: floor(size / crop_pct)
    r_long = (r * long_ // short).astype(np.int64)  # torchvision: int(r · long / short)
    rh, rw = np.where(hs <= ws, r, r_long), np.where(hs <= ws, r_long, r)
    if squash:
        rh, rw = r, r.copy()
    # torchvision's center_crop: int(round((resized − size) / 2)), Python's (and numpy's) half-even
    top, left = np.round((rh - side) / 2).astype(np.int64), np.round((rw - side) / 2).astype(np.int64)
    sy, sx = hs / rh, ws / rw  # source pixels per resized pixel
    boxes = np.stack([top * sy, left * sx, side * sy, side * sx], 1)
    return boxes, np.stack([rh, rw], 1), np.stack([top, left], 1)


@AUGMENT_OPS.register("center_crop")
class CenterCrop(AugmentOp):
    """Resize the short side to ``size / crop_fraction`` and take the central ``size``×``size``
    (torchvision's eval ``Resize + CenterCrop``); no random draws, so train-time ops may follow.

    ``crop_fraction`` defaults to 1.0 — the whole short side, only the long side's ends cropped —
    rather than ImageNet's 0.875 (``Resize(256) + CenterCrop(224)``): ImageNet photos have a
    margin around their object, while small product photos are framed to the object and a 12.5%
    border crop cuts its edges off. ``size``: the output side; the epoch's resolution replaces it
    as it does a ``random_resized_crop``'s; with neither, the image's own short side.

    ``antialias`` (default False): bilinear sampling like the training ``random_resized_crop``,
    which does not antialias, so evaluation pixels are made the way training saw them. True is
    torchvision's default filter (smoother when shrinking several-fold, as eval photos shrink).

    ``crop_mode="squash"`` resizes the whole image to the square instead (timm's squash mode):
    nothing of a 4:3 photo is cut, at the price of its aspect ratio. A model trained with a
    ``random_resized_crop`` has seen exactly such images (its crops span aspect ratios 3:4 to 4:3
    and are then resized to a square); the image recipe evaluates this way
    (``stages/kinds/image_recipe.py``; the two compared: ``benchmarks/photos.py --sweep``)."""
    op: Literal["center_crop"] = "center_crop"
    size: int | None = Field(None, ge=1,
                             description="output side; default: the epoch's resolution, else the short side")
    crop_fraction: float = Field(1.0, gt=0.0, le=1.0, description="the central square's side over the short side")
    crop_mode: Literal["center", "squash"] = Field(
        "center", description="center: keep the aspect ratio and cut the long side's ends; squash: resize "
        "the whole image to a square (timm's crop_mode='squash'), as a random_resized_crop's widest crops do")
    antialias: bool = False

    needs_sizes = True
    makes_one_size = True
    dali_input_types = (("roi_start", "float"), ("roi_end", "float"), ("size", "float"))

    def side(self, hs: np.ndarray, ws: np.ndarray, resolution: int | None) -> np.ndarray:
        """The output side per image: the resolution, else ``size``, else the short side."""
        s = resolution or self.size
        return np.full(len(hs), s, np.int64) if s else np.minimum(hs, ws).astype(np.int64)

    def output_sizes(self, hs, ws, resolution):
        s = self.side(hs, ws, resolution)
        return s, s.copy()

    def draw(self, n, hs, ws, resolution, gen) -> Params:
        """No randomness: the boxes follow from the sizes alone (``gen`` is left untouched)."""
        s = self.side(hs, ws, resolution)
        boxes, resized, offset = center_boxes(hs, ws, s, self.crop_fraction, self.crop_mode == "squash")
        return {"boxes": torch.from_numpy(boxes).float(), "out": torch.from_numpy(np.stack([s, s], 1)),
                "resized": torch.from_numpy(resized), "offset": torch.from_numpy(offset)}

    def apply_torch(self, x, params, ctx: TorchContext, fused=None):
        out = int(params["out"][0, 0])
        ctx.resized = ctx.owned = True
        sizes, ctx.sizes = ctx.sizes, None  # every output is out×out
        if not self.antialias:
            return crop_resize(x, params["boxes"], (out, out), None, sizes)
        return self._antialiased(x, params, out, sizes)

    @staticmethod
    def _antialiased(x: torch.Tensor, params: Params, out: int, sizes: torch.Tensor | None) -> torch.Tensor:
        """torchvision's own steps per distinct (image size, resized size, offset): an antialiased
        bilinear resize of the image (its part of a canvas), then the integer crop."""
        n = x.shape[0]
        hw = sizes if sizes is not None else torch.tensor(x.shape[-2:]).expand(n, 2)
        key = torch.cat([hw.to(torch.int64), params["resized"], params["offset"]], 1)
        groups, inverse = torch.unique(key, dim=0, return_inverse=True)
        res = x.new_empty((n, x.shape[1], out, out))
        for g, (h, w, rh, rw, top, left) in enumerate(groups.tolist()):
            rows = (inverse == g).nonzero().flatten().to(x.device)
            img = x.index_select(0, rows)[:, :, :h, :w]
            big = F.interpolate(img, size=(rh, rw), mode="bilinear", align_corners=False, antialias=True)
            res[rows] = big[:, :, top:top + out, left:left + out]
        return res

    def dali_inputs(self, params, n):
        return boxes_for_dali(params)

    def apply_dali(self, x: Any, inputs: list[Any], ctx: DaliContext) -> Any:
        return resize_boxes_dali(x, inputs, antialias=self.antialias)


def eval_resize(size: int | None) -> list[AugmentOp]:
    """How images are made ``size``×``size`` for a model trained at that side to be evaluated: the
    whole image resized (squash; measured better than the centre crop on photos framed to their
    object, see ``CenterCrop``). ``None`` (trained as stored): nothing."""
    return [] if size is None else [CenterCrop(size=size, crop_mode="squash")]
