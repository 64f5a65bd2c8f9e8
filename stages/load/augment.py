"""Augmentation as data: a small declarative spec, executed as batched ops on the device.

The same ``AugmentSpec`` runs as batched torch ops on the target device (FFCV, WebDataset and
in-memory backends; see ``TorchAugment``) or as DALI operators (``sluice.stages.load.dali``), and gives
statistically the same result on both. Input: uint8 NHWC; output: float32 NCHW, normalised,
optionally channels-last in memory. On CPU the loader runs a leading random-resized-crop (+ flip)
with OpenCV on the uint8 pixels instead (``TorchAugment(fast_cpu=True)``): same draws, 3-4× less CPU.
"""
from __future__ import annotations

import math
from typing import Annotated, Literal, Union

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field


class _Op(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RandomResizedCrop(_Op):
    """Crop a random area fraction ``scale`` with aspect ratio in ``ratio``, resize to ``size``."""
    op: Literal["random_resized_crop"] = "random_resized_crop"
    size: int | None = Field(None, ge=1, description="output side; default: the stored size (or the epoch's resolution)")
    scale: tuple[float, float] = (0.35, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)


class Flip(_Op):
    """Horizontal flip with probability ``p``."""
    op: Literal["flip"] = "flip"
    p: float = Field(0.5, ge=0.0, le=1.0)


class Translate(_Op):
    """Pad by ``pad`` pixels (zeros) and crop back at a random offset (CIFAR-style)."""
    op: Literal["translate"] = "translate"
    pad: int = Field(2, ge=0)


class Cutout(_Op):
    """Zero a ``size``×``size`` square at a random centre with probability ``p``."""
    op: Literal["cutout"] = "cutout"
    size: int = Field(8, ge=1)
    p: float = Field(1.0, ge=0.0, le=1.0)


class BrightnessContrast(_Op):
    """Scale brightness by U(1±brightness) and contrast around the image mean by U(1±contrast)."""
    op: Literal["brightness_contrast"] = "brightness_contrast"
    brightness: float = Field(0.2, ge=0.0, le=1.0)
    contrast: float = Field(0.2, ge=0.0, le=1.0)


class Normalize(_Op):
    """(x/255 - mean) / std per channel; one value broadcasts to every channel."""
    op: Literal["normalize"] = "normalize"
    mean: list[float] = Field(default_factory=lambda: [0.5])
    std: list[float] = Field(default_factory=lambda: [0.25])


AugmentOp = Annotated[Union[RandomResizedCrop, Flip, Translate, Cutout, BrightnessContrast, Normalize],
                      Field(discriminator="op")]


class AugmentSpec(BaseModel):
    """An ordered list of ops. Without ``normalize`` the output is x/255 in [0, 1]."""
    model_config = ConfigDict(extra="forbid")
    ops: list[AugmentOp] = Field(default_factory=list)
    channels_last: bool = False

    @classmethod
    def standard(cls, size: int | None = None, mean=(0.5,), std=(0.25,)) -> "AugmentSpec":
        """Random resized crop + flip + normalize: the benchmark's augmentation."""
        return cls(ops=[RandomResizedCrop(size=size), Flip(), Normalize(mean=list(mean), std=list(std))])

    def output_size(self, stored: tuple[int, int], resolution: int | None = None) -> tuple[int, int]:
        size = stored
        for op in self.ops:
            if isinstance(op, RandomResizedCrop):
                side = resolution or op.size
                size = (side, side) if side else size
        if resolution and not any(isinstance(o, RandomResizedCrop) for o in self.ops):
            size = (resolution, resolution)
        return size


def _per_channel(values: list[float], c: int, device, name: str) -> torch.Tensor:
    if len(values) not in (1, c):
        raise ValueError(f"normalize.{name} has {len(values)} values for {c} channels")
    t = torch.tensor(values * (c if len(values) == 1 else 1), dtype=torch.float32, device=device)
    return t.view(1, c, 1, 1)


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
                flip: torch.Tensor | None = None) -> torch.Tensor:
    """Crop each image of NCHW ``x`` to its box and resize to ``out_hw``, in one grid_sample;
    ``flip`` (bool per sample) mirrors those outputs for free by negating the x scale."""
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
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


class TorchAugment:
    """Runs an AugmentSpec on a batch with torch ops on whatever device the batch is on."""

    def __init__(self, spec: AugmentSpec | None, seed: int = 0, *, fast_cpu: bool = False, threads: int = 1):
        """``fast_cpu``: on CPU uint8 batches, run a leading ``RandomResizedCrop`` (+ ``Flip``) with
        OpenCV on the uint8 pixels over ``threads`` threads, then one fused float conversion and
        normalise (``_fast_prefix``): the same random draws, in the same order, as the torch path,
        and statistically the same images (bilinear both; not bit-identical: OpenCV rounds to
        uint8 and clamps at the crop's edge where grid_sample reads one pixel beyond it). Off by
        default: the torch path is the reference the DALI backend is tested against."""
        self.spec = spec or AugmentSpec()
        self.gen = torch.Generator().manual_seed(seed)
        self.fast_cpu = fast_cpu
        self.threads = max(1, int(threads))
        self._pool = None

    def reseed(self, seed: int) -> None:
        self.gen.manual_seed(seed)

    def __call__(self, images: torch.Tensor, resolution: int | None = None) -> torch.Tensor:
        """uint8 NHWC (any device) -> float32 NCHW on the same device."""
        ops = list(self.spec.ops)
        if self.fast_cpu and _fast_prefix_applies(images, ops):
            fast = self._fast_prefix(images, ops, resolution)
            if fast is not None:
                return fast
        x = images.permute(0, 3, 1, 2).float()  # 0..255
        return self._run(x, images, ops, 0, resolution, resized=False)

    def _fast_prefix(self, images: torch.Tensor, ops: list, resolution: int | None) -> torch.Tensor | None:
        """RandomResizedCrop (+ Flip) on uint8 NHWC with OpenCV, then the float conversion (and a
        final Normalize) fused per chunk; ``threads`` chunks in parallel (OpenCV and torch release
        the GIL). Other ops after the prefix run on the torch path. None: OpenCV is missing."""
        cv2 = _cv2()
        if cv2 is None:
            return None
        n, h, w, c = images.shape
        op, g, k = ops[0], self.gen, 1
        side = resolution or op.size or h
        oh, ow = side, (side if resolution or op.size else w)
        boxes = rrc_boxes(n, h, w, op.scale, op.ratio, g)  # the torch path's draws, in its order
        flip = None
        if len(ops) > 1 and isinstance(ops[1], Flip):
            flip = torch.rand(n, generator=g) < ops[1].p
            k = 2
        rest = ops[k:]
        if not rest:
            scale = torch.full((c,), 1.0 / 255.0)
            bias = torch.zeros(c)
        elif len(rest) == 1 and isinstance(rest[0], Normalize):
            mean = _per_channel(rest[0].mean, c, "cpu", "mean").view(c)
            std = _per_channel(rest[0].std, c, "cpu", "std").view(c)
            scale, bias = 1.0 / (255.0 * std), -mean / std
        else:
            scale = bias = None  # more ops follow: hand float pixels to the torch path
        src = images.numpy()
        if not src.flags.c_contiguous:
            src = np.ascontiguousarray(src)
        buf = np.empty((n, oh, ow, c), np.uint8)
        bx = boxes.to(torch.int64).tolist()
        fl = flip.tolist() if flip is not None else [False] * n
        channels_last = self.spec.channels_last
        if scale is not None:
            res = torch.empty((n, oh, ow, c) if channels_last else (n, c, oh, ow), dtype=torch.float32)
            if channels_last:
                scale_v, bias_v = scale.view(1, 1, 1, c), bias.view(1, 1, 1, c)
            else:
                scale_v, bias_v = scale.view(1, c, 1, 1), bias.view(1, c, 1, 1)
        interp, size = cv2.INTER_LINEAR, (ow, oh)

        def work(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                top, left, bh, bw = bx[i]
                crop = src[i, top:top + bh, left:left + bw]
                if c == 1:
                    cv2.resize(crop[..., 0], size, dst=buf[i, ..., 0], interpolation=interp)
                else:
                    cv2.resize(crop, size, dst=buf[i], interpolation=interp)
                if fl[i]:
                    cv2.flip(buf[i], 1, dst=buf[i])  # in place
            if scale is not None:  # measured fastest: uint8 relayout in numpy, then contiguous casts
                chunk = buf[lo:hi]
                if not channels_last:
                    planar = np.empty((hi - lo, c, oh, ow), np.uint8)
                    np.copyto(planar, chunk.transpose(0, 3, 1, 2))
                    chunk = planar
                r = res[lo:hi]
                r.copy_(torch.from_numpy(chunk))
                r.mul_(scale_v).add_(bias_v)

        chunks = min(self.threads, max(1, n // 16))
        if chunks <= 1:
            work(0, n)
        else:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="sluice-augment")
            step = -(-n // chunks)
            futs = [self._pool.submit(work, lo, min(lo + step, n)) for lo in range(0, n, step)]
            for f in futs:
                f.result()
        if scale is None:  # uint8 relayout first: a permuted uint8->float cast is ~3x slower
            x = torch.from_numpy(np.ascontiguousarray(buf.transpose(0, 3, 1, 2))).float()
            return self._run(x, images, ops, k, resolution, resized=True)
        return res.permute(0, 3, 1, 2) if channels_last else res

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_pool"] = None  # thread pools do not pickle; a copy makes its own
        return state

    def _run(self, x: torch.Tensor, images: torch.Tensor, ops: list, k: int, resolution: int | None,
             resized: bool) -> torch.Tensor:
        """The torch path: ``ops[k:]`` on float NCHW ``x`` (0..255)."""
        n, c = x.shape[:2]
        g = self.gen
        scaled = False
        while k < len(ops):
            op = ops[k]
            k += 1
            if isinstance(op, RandomResizedCrop):
                h, w = x.shape[2:]
                side = resolution or op.size or h
                boxes = rrc_boxes(n, h, w, op.scale, op.ratio, g)
                flip = None
                if k < len(ops) and isinstance(ops[k], Flip):  # fused: same draws, one pass
                    flip = torch.rand(n, generator=g) < ops[k].p
                    k += 1
                x = crop_resize(x, boxes, (side, side if resolution or op.size else w), flip)
                resized = True
            elif isinstance(op, Flip):
                m = (torch.rand(n, generator=g) < op.p).to(x.device)
                if m.any():
                    x = x.clone() if x.data_ptr() == images.data_ptr() else x
                    x[m] = x[m].flip(-1)
            elif isinstance(op, Translate):
                x = _translate(x, op.pad, g)
            elif isinstance(op, Cutout):
                x = _cutout(x, op.size, op.p, g)
            elif isinstance(op, BrightnessContrast):
                bf = torch.empty(n).uniform_(1 - op.brightness, 1 + op.brightness, generator=g).to(x.device)
                cf = torch.empty(n).uniform_(1 - op.contrast, 1 + op.contrast, generator=g).to(x.device)
                mean = x.mean(dim=(1, 2, 3), keepdim=True)
                x = ((x - mean) * cf.view(n, 1, 1, 1) + mean) * bf.view(n, 1, 1, 1)
                x = x.clamp(0, 255)
            elif isinstance(op, Normalize):  # one fused pass: x * 1/(255 std) - mean/std
                mean = _per_channel(op.mean, c, x.device, "mean")
                std = _per_channel(op.std, c, x.device, "std")
                x = torch.addcmul(-mean / std, x, 1.0 / (255.0 * std))
                scaled = True
        if resolution and not resized and x.shape[-1] != resolution:
            x = F.interpolate(x, size=(resolution, resolution), mode="bilinear", align_corners=False, antialias=True)
        if not scaled:
            x = x / 255.0
        if self.spec.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x


def _fast_prefix_applies(images: torch.Tensor, ops: list) -> bool:
    """The OpenCV prefix path: uint8 NHWC on CPU with 1, 3 or 4 channels, first op an RRC."""
    return (bool(ops) and isinstance(ops[0], RandomResizedCrop) and images.device.type == "cpu"
            and images.dtype == torch.uint8 and images.dim() == 4 and images.shape[0] > 0
            and images.shape[-1] in (1, 3, 4))


_CV2 = []


def _cv2():
    """OpenCV if installed (imported on first use), else None: the torch path then."""
    if not _CV2:
        try:
            import cv2
        except ImportError:
            cv2 = None
        _CV2.append(cv2)
    return _CV2[0]


def _translate(x: torch.Tensor, pad: int, g: torch.Generator) -> torch.Tensor:
    if pad == 0:
        return x
    n, c, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (n,), generator=g).to(x.device)
    dx = torch.randint(0, 2 * pad + 1, (n,), generator=g).to(x.device)
    rows = (dy.view(n, 1) + torch.arange(h, device=x.device).view(1, h))  # n, h
    cols = (dx.view(n, 1) + torch.arange(w, device=x.device).view(1, w))  # n, w
    idx_r = rows.view(n, 1, h, 1).expand(n, c, h, w + 2 * pad)
    out = padded.gather(2, idx_r)
    idx_c = cols.view(n, 1, 1, w).expand(n, c, h, w)
    return out.gather(3, idx_c)


def _cutout(x: torch.Tensor, size: int, p: float, g: torch.Generator) -> torch.Tensor:
    n, _, h, w = x.shape
    cy = torch.randint(0, h, (n,), generator=g).to(x.device).view(n, 1, 1)
    cx = torch.randint(0, w, (n,), generator=g).to(x.device).view(n, 1, 1)
    on = (torch.rand(n, generator=g) < p).to(x.device).view(n, 1, 1)
    ys = torch.arange(h, device=x.device).view(1, h, 1)
    xs = torch.arange(w, device=x.device).view(1, 1, w)
    half = size // 2
    box = (ys >= cy - half) & (ys < cy - half + size) & (xs >= cx - half) & (xs < cx - half + size) & on
    return x.masked_fill(box.unsqueeze(1), 0.0)
