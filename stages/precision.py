"""Mixed precision that pays: ``amp="auto"`` picks bf16 only where the hardware computes it.

bf16 autocast is ~2-3x faster on CPUs with AVX512-bf16 or AMX, but on plain AVX2 CPUs PyTorch
emulates it and a SmallCNN step runs ~10x *slower* than fp32. So "auto" asks the device:
CUDA → bf16 (fp16 with a GradScaler on GPUs without bf16); CPU → bf16 with native support,
else fp32. An explicit "bf16", "fp16" or "none" is always honoured.
"""
from __future__ import annotations

import functools
from typing import Literal

import torch

AmpMode = Literal["auto", "none", "bf16", "fp16"]


@functools.cache  # asked on every forward pass by some callers; the CPU does not change
def cpu_has_fast_bf16() -> bool:
    """True when this CPU has native bf16 arithmetic (AVX512-bf16 or AMX)."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


def resolve_amp(amp: str, device: torch.device | str = "cpu") -> str:
    """The concrete autocast mode ("none", "bf16" or "fp16") for ``amp`` on ``device``."""
    if amp != "auto":
        return amp
    kind = torch.device(device).type
    if kind == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if kind == "cpu" and cpu_has_fast_bf16() else "none"
