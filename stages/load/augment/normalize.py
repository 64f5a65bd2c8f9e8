"""``normalize``: (x/255 − mean) / std per channel; one value broadcasts to every channel."""
from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from sluice.stages.pixels import channel_values
from sluice.stages.load.augment.base import AUGMENT_OPS, AugmentOp, DaliContext, TorchContext


@AUGMENT_OPS.register("normalize")
class Normalize(AugmentOp):
    """(x/255 - mean) / std per channel; one value broadcasts to every channel."""
    op: Literal["normalize"] = "normalize"
    mean: list[float] = Field(default_factory=lambda: [0.5])
    std: list[float] = Field(default_factory=lambda: [0.25])

    finishes_dali = True  # fused with DALI's HWC -> CHW float conversion: must come last there

    def scale_bias(self, channels: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(1/(255 std), −mean/std) per channel, shaped (1, C, 1, 1): x·scale + bias."""
        mean = channel_values(self.mean, channels, device, "normalize.mean")
        std = channel_values(self.std, channels, device, "normalize.std")
        return 1.0 / (255.0 * std), -mean / std

    def check_channels(self, channels: int) -> None:
        self.scale_bias(channels)

    def apply_torch(self, x, params, ctx: TorchContext, fused=None):
        scale, bias = self.scale_bias(x.shape[1], x.device)
        ctx.scaled = ctx.owned = True
        return torch.addcmul(bias, x, scale)  # one fused pass

    def apply_dali(self, x: Any, inputs: list[Any], ctx: DaliContext) -> Any:
        from nvidia.dali import fn, types
        c = ctx.channels
        mean = [m * 255.0 for m in self.mean] * (c if len(self.mean) == 1 else 1)
        std = [s * 255.0 for s in self.std] * (c if len(self.std) == 1 else 1)
        return fn.crop_mirror_normalize(x, mean=mean, std=std, output_layout="CHW",
                                        dtype=types.FLOAT, device="gpu" if ctx.gpu else "cpu")
