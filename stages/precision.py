"""Mixed precision that pays, shared by the IL model (``select``) and the training loop (``train``)
so the two never drift.

``amp="auto"`` picks bf16 only where the hardware computes it. bf16 autocast is ~2-3x faster on
CPUs with AVX512-bf16 or AMX, but on plain AVX2 CPUs PyTorch emulates it and a SmallCNN step runs
~10x *slower* than fp32. So "auto" asks the device: CUDA → bf16 (fp16 with a GradScaler on GPUs
without bf16); CPU → bf16 with native support, else fp32. An explicit "bf16", "fp16" or "none" is
always honoured.
"""
from __future__ import annotations

import contextlib
from typing import Literal

import torch

from sluice.stages.host import HOST_DEFAULTS, cpu_class

AmpMode = Literal["auto", "none", "bf16", "fp16"]


def cpu_has_fast_bf16() -> bool:
    """True when this CPU has native bf16 arithmetic (AVX512-bf16 or AMX) that PyTorch uses."""
    return cpu_class() in ("amx", "avx512_bf16")


def resolve_amp(amp: str, device: torch.device | str = "cpu") -> str:
    """The concrete autocast mode ("none", "bf16" or "fp16") for ``amp`` on ``device``: "auto"
    takes the precision measured best on the device's host class (``sluice.stages.host``)."""
    if amp != "auto":
        return amp
    if torch.device(device).type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return HOST_DEFAULTS[cpu_class()].amp


def autocast(amp: str, device: torch.device | str) -> contextlib.AbstractContextManager:
    """The autocast context for a resolved ``amp`` ("none" is a no-op)."""
    if amp == "none":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return torch.autocast(torch.device(device).type, dtype=dtype)
