"""The CPU fast path: a leading ``random_resized_crop`` (+ ``flip``) run with OpenCV on the uint8
pixels across threads, then one fused float conversion (and a final ``normalize``).

It applies the very parameters ``draw_params`` drew for the torch path, so the draws are
identical, and the images statistically the same (bilinear both; not bit-identical: OpenCV
rounds to uint8 and clamps at the crop's edge where grid_sample reads one pixel beyond it).
3-4× less CPU than the torch path on small images.
"""
from __future__ import annotations

import numpy as np
import torch

from sluice.stages.load.augment.base import AugmentOp, Params
from sluice.stages.load.decode import opencv


def applies(images: torch.Tensor, ops: list[AugmentOp]) -> bool:
    """uint8 NHWC on CPU with 1, 3 or 4 channels, first op a random resized crop."""
    return (bool(ops) and ops[0].op == "random_resized_crop" and images.device.type == "cpu"
            and images.dtype == torch.uint8 and images.dim() == 4 and images.shape[0] > 0
            and images.shape[-1] in (1, 3, 4))


class OpenCvPrefix:
    """Runs the prefix over ``threads`` threads (OpenCV and torch release the GIL)."""

    def __init__(self, threads: int = 1):
        self.threads = max(1, int(threads))
        self._pool = None

    def __getstate__(self):
        return {**self.__dict__, "_pool": None}  # thread pools do not pickle; a copy makes its own

    def __call__(self, images: torch.Tensor, ops: list[AugmentOp], params: list[Params],
                 channels_last: bool) -> tuple[torch.Tensor, int] | None:
        """(output, k): ``ops[:k]`` are applied. When ``k == len(ops)`` the output is final
        (scaled, normalised); otherwise it is float NCHW in 0..255 for the torch path.
        None when OpenCV is missing."""
        cv2 = opencv()
        if cv2 is None:
            return None
        n, h, w, c = images.shape
        crop, k = params[0], 1
        flip = None
        if len(ops) > 1 and ops[1].op == "flip":
            flip, k = params[1]["mask"], 2
        rest = ops[k:]
        if not rest:
            scale, bias = torch.full((c,), 1.0 / 255.0), torch.zeros(c)
        elif len(rest) == 1 and rest[0].op == "normalize":
            scale, bias = (t.view(c) for t in rest[0].scale_bias(c))
        else:
            scale = bias = None  # more ops follow: hand float pixels to the torch path
        oh, ow = (int(v) for v in crop["out"][0])
        src = images.numpy()
        if not src.flags.c_contiguous:
            src = np.ascontiguousarray(src)
        buf = np.empty((n, oh, ow, c), np.uint8)
        bx = crop["boxes"].to(torch.int64).tolist()
        fl = flip.tolist() if flip is not None else [False] * n
        if scale is not None:
            res = torch.empty((n, oh, ow, c) if channels_last else (n, c, oh, ow), dtype=torch.float32)
            shape = (1, 1, 1, c) if channels_last else (1, c, 1, 1)
            scale_v, bias_v = scale.view(shape), bias.view(shape)
        interp, size = cv2.INTER_LINEAR, (ow, oh)

        def work(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                top, left, bh, bw = bx[i]
                region = src[i, top:top + bh, left:left + bw]
                if c == 1:
                    cv2.resize(region[..., 0], size, dst=buf[i, ..., 0], interpolation=interp)
                else:
                    cv2.resize(region, size, dst=buf[i], interpolation=interp)
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
            for f in [self._pool.submit(work, lo, min(lo + step, n)) for lo in range(0, n, step)]:
                f.result()
        if scale is None:  # uint8 relayout first: a permuted uint8->float cast is ~3x slower
            return torch.from_numpy(np.ascontiguousarray(buf.transpose(0, 3, 1, 2))).float(), k
        return (res.permute(0, 3, 1, 2) if channels_last else res), len(ops)
