"""How a model is computed, shared by the IL model (``select``) and the training loop (``train``)
so the two never drift: mixed precision, the optimizer's parameter groups, input normalisation.

Mixed precision that pays: ``amp="auto"`` picks bf16 only where the hardware computes it.
bf16 autocast is ~2-3x faster on CPUs with AVX512-bf16 or AMX, but on plain AVX2 CPUs PyTorch
emulates it and a SmallCNN step runs ~10x *slower* than fp32. So "auto" asks the device:
CUDA → bf16 (fp16 with a GradScaler on GPUs without bf16); CPU → bf16 with native support,
else fp32. An explicit "bf16", "fp16" or "none" is always honoured.
"""
from __future__ import annotations

import contextlib
from typing import Literal, Sequence

import torch

from sluice.errors import ConfigError
from sluice.stages.host import HOST_DEFAULTS, cpu_class

AmpMode = Literal["auto", "none", "bf16", "fp16"]
OptimizerName = Literal["sgd", "adam", "adamw"]


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


def build_optimizer(name: str, model: torch.nn.Module, lr: float, *, momentum: float = 0.9,
                    weight_decay: float = 0.0, nesterov: bool = True) -> torch.optim.Optimizer:
    """``name`` over ``model``'s trainable parameters, with no weight decay on norms and biases
    (every parameter of at most one dimension), which only shrinks them toward zero."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0)
    if name in ("adam", "adamw"):
        return (torch.optim.AdamW if name == "adamw" else torch.optim.Adam)(groups, lr=lr)
    raise ConfigError(f"unknown optimizer {name!r}; use sgd, adam or adamw")


def channel_values(values: Sequence[float], channels: int, device: torch.device | str = "cpu",
                   what: str = "normalize") -> torch.Tensor:
    """Per-channel values as a (1, C, 1, 1) float tensor; one value broadcasts to every channel."""
    if len(values) not in (1, channels):
        raise ConfigError(f"{what} has {len(values)} values for {channels} channels")
    v = list(values) * (channels if len(values) == 1 else 1)
    return torch.tensor(v, dtype=torch.float32, device=device).view(1, channels, 1, 1)


def normalize_uint8(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """uint8 NCHW pixels → float (x/255 − mean) / std, with (1, C, 1, 1) ``mean`` and ``std``."""
    return x.float().div_(255).sub_(mean).div_(std)
