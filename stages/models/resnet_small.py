"""``resnet_small``: a ResNet-style net for small natural images (CIFAR-like, 32–64 px); it takes
any input of at least 5×5 px (global average pool head)."""
from __future__ import annotations

import torch
from torch import nn

from sluice.stages.models.base import MODELS, check_input_size, conv_bn


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
    """A ResNet-style net (ResNet-9-like widths, ``width`` sets them): a stem, then four residual
    blocks, two of them halving the resolution, then a global average pool and one linear layer.

    It takes any input of at least 5×5 px, square or not, in any number of channels. It suits
    small natural images, 32–64 px, best: its receptive field is about 45 px and it downsamples
    only 4×, so at 128–160 px it still trains (on local patches, averaged over the image) but its
    compute grows with the image's area.
    """

    # Two stride-2 stages leave ceil(side / 4): at 4 px or less a 1×1 map, where BatchNorm in
    # training refuses a batch of one image; 5 px leaves 2×2.
    min_size = 5

    def __init__(self, in_channels: int = 3, num_classes: int = 10, width: int = 64):
        super().__init__()
        w = width
        self.net = nn.Sequential(
            conv_bn(in_channels, w), _Block(w, 2 * w, 2), _Block(2 * w, 2 * w, 1),
            _Block(2 * w, 4 * w, 2), _Block(4 * w, 4 * w, 1),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * w, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_input_size("resnet_small", self.min_size, x)
        return self.net(x)
