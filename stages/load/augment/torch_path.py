"""``TorchAugment``: an ``AugmentSpec`` run as batched torch ops on whatever device the batch is
on (the memory, FFCV and WebDataset backends). Input uint8 NHWC; output float32 NCHW,
normalised, optionally channels-last in memory."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from sluice.errors import LoaderError
from sluice.stages.load.augment.fast_cpu import OpenCvPrefix, applies as opencv_prefix_applies
from sluice.stages.load.augment.base import AugmentOp, Params, TorchContext, one_size_ops
from sluice.stages.load.augment.spec import AugmentSpec, draw_params
from sluice.stages.pixels import channels_last


class TorchAugment:
    """Draws a batch's parameters (``draw_params``) and applies each op's torch half."""

    def __init__(self, spec: AugmentSpec | None, seed: int = 0, *, fast_cpu: bool = False,
                 threads: int = 1):
        """``fast_cpu``: on CPU uint8 batches, run a leading random-resized-crop (+ flip) with
        OpenCV over ``threads`` threads (``augment.fast_cpu``): the same draws, statistically the
        same images. Off by default: the torch path is the reference the DALI backend is tested
        against."""
        self.spec = spec or AugmentSpec()
        self.gen = torch.Generator().manual_seed(seed)
        self.fast = OpenCvPrefix(threads) if fast_cpu else None

    def reseed(self, seed: int) -> None:
        self.gen.manual_seed(seed)

    def __call__(self, images: torch.Tensor, resolution: int | None = None,
                 sizes: np.ndarray | torch.Tensor | None = None) -> torch.Tensor:
        """uint8 NHWC (any device) -> float32 NCHW on the same device. ``sizes`` (N, 2): the
        images are a zero-padded canvas (``canvas.Canvas``) of images of these sizes; the draws
        are made for those sizes, and an op that makes them one size (``check_variable_sizes``)
        must come first."""
        ops = list(self.spec.ops)
        n, h, w = images.shape[:3]
        if sizes is not None:
            sizes = np.asarray(sizes.cpu() if isinstance(sizes, torch.Tensor) else sizes, np.int64).reshape(-1, 2)
            if (sizes == (h, w)).all():
                sizes = None  # one size after all: the fixed-size path, unchanged
        if sizes is None:
            hs, ws = np.full(n, h), np.full(n, w)
        else:
            check_variable_sizes(ops, resolution)
            hs, ws = sizes[:, 0], sizes[:, 1]
        params = draw_params(ops, n, hs, ws, resolution, self.gen)
        ctx = TorchContext(resolution=resolution, sizes=None if sizes is None else torch.from_numpy(sizes))
        if self.fast is not None and opencv_prefix_applies(images, ops):
            done = self.fast(images, ops, params, self.spec.channels_last)
            if done is not None:
                x, k = done
                if k == len(ops):
                    return x
                ctx.resized = True
                return self.apply(x, ops, params, k, ctx)
        x = images.permute(0, 3, 1, 2).float()  # 0..255
        ctx.owned = x.data_ptr() != images.data_ptr()
        return self.apply(x, ops, params, 0, ctx)

    def apply(self, x: torch.Tensor, ops: list[AugmentOp], params: list[Params], k: int,
              ctx: TorchContext) -> torch.Tensor:
        """``ops[k:]`` with their ``params`` on float NCHW ``x`` (0..255), then the output's
        final size, range and memory format."""
        while k < len(ops):
            fused = params[k + 1] if k + 1 < len(ops) and ops[k].fuses_with(ops[k + 1]) else None
            x = ops[k].apply_torch(x, params[k], ctx, fused)
            k += 1 if fused is None else 2
        r = ctx.resolution
        if r and not ctx.resized and x.shape[-1] != r:
            x = F.interpolate(x, size=(r, r), mode="bilinear", align_corners=False, antialias=True)
        if not ctx.scaled:
            x = x / 255.0
        if self.spec.channels_last:
            x = channels_last(x)
        return x


def check_variable_sizes(ops: list[AugmentOp], resolution: int | None) -> None:
    """Images of different sizes in one batch (a zero-padded canvas) become one batch only through
    a leading op that makes one size (``makes_one_size``: ``random_resized_crop``,
    ``center_crop``): any other op first would act on the padding too."""
    names = " or ".join(one_size_ops())
    if not ops or not ops[0].makes_one_size:
        first = f"it starts with {ops[0].op}" if ops else "it has no ops"
        raise LoaderError(f"images of different sizes in one batch: the augmentation must start with "
                          f"{names} (they make them one size); {first}")
    if not (resolution or getattr(ops[0], "size", None)):
        raise LoaderError(f"images of different sizes in one batch: give the {ops[0].op} a size "
                          "(or the loader a resolution)")
