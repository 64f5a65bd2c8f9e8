"""``resnet_small``: a ResNet-style net for 32–64 px images."""
from __future__ import annotations

import torch
from torch import nn

from sluice.stages.models.base import MODELS, conv_bn


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(conv_bn(cin, cout, stride),
                                  nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = (nn.Identity() if stride == 1 and cin == cout else
                     nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


@MODELS.register("resnet_small")
class ResNetSmall(nn.Module):
    """A ResNet-style net for 32–64 px images (ResNet-9-like widths, configurable)."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10, width: int = 64):
        super().__init__()
        w = width
        self.net = nn.Sequential(
            conv_bn(in_channels, w), _Block(w, 2 * w, 2), _Block(2 * w, 2 * w, 1),
            _Block(2 * w, 4 * w, 2), _Block(4 * w, 4 * w, 1),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * w, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
