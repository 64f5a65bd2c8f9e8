"""``bn_cnn``: the plain BatchNorm CNN a competent user writes for 28×28 inputs — conv3×3-BN-ReLU
32, 32, max-pool, 64, 64, max-pool, then one linear layer over the 7×7 map. It converges in a
few epochs (the strong baseline in ``benchmarks/baselines`` trains the same architecture)."""
from __future__ import annotations

import torch
from torch import nn

from sluice.stages.models.base import MODELS, conv_bn


@MODELS.register("bn_cnn")
class BNCNN(nn.Module):
    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 32, size: int = 28):
        super().__init__()
        w = width
        self.features = nn.Sequential(conv_bn(in_channels, w), conv_bn(w, w), nn.MaxPool2d(2),
                                      conv_bn(w, 2 * w), conv_bn(2 * w, 2 * w), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * w * (size // 4) ** 2, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))
