"""Pixel conventions shared by the loader, the IL model and the trainer: per-channel values,
uint8 → normalised float, and channels-last memory (one place decides how each is done)."""
from __future__ import annotations

from typing import Sequence, TypeVar

import torch

from sluice.errors import ConfigError

T = TypeVar("T", torch.Tensor, torch.nn.Module)


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


def channels_last(x: T) -> T:
    """``x`` in channels-last memory: a module's weights, or a 4-D batch (anything else as it
    is). Channels-last convolutions are faster in fp32 and bf16 alike, on CPUs and GPUs."""
    if isinstance(x, torch.nn.Module):
        return x.to(memory_format=torch.channels_last)
    return x.contiguous(memory_format=torch.channels_last) if x.ndim == 4 else x
