"""``bn_cnn``: the plain BatchNorm CNN a competent user writes for Fashion-MNIST's 28×28 images —
conv3×3-BN-ReLU 32, 32, max-pool, 64, 64, max-pool, then one linear layer over the 7×7 map. It
converges in a few epochs (the strong baseline in ``benchmarks/baselines`` trains the same
architecture). It takes any input of at least 4×4 px: an input of another size has its feature
map average-pooled to the head's 7×7 grid first."""
from __future__ import annotations

import torch
from torch import nn

from sluice.stages.models.base import MODELS, check_input_size, conv_bn


@MODELS.register("bn_cnn")
class BNCNN(nn.Module):
    """The plain BatchNorm CNN (see the module's docstring). Suited to small images, about 28–32
    px (its receptive field is 16 px, and it downsamples only 4×): larger ones work, at a cost
    growing with their area, their feature map averaged down to the head's grid.

    ``size`` lays out the head: a ``size // 4`` per side grid (7×7 at the default 28) into the
    linear layer. Where the feature map is that grid already (an input of ``size`` px, or up to 3
    px more) it goes straight to the head, so at 28×28 this is exactly the plain architecture
    (same outputs, gradients and checkpoints); any other map is adaptive-average-pooled to it.
    """

    min_size = 4  # two 2×2 max-pools: 4 px leaves a 1×1 map

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 32, size: int = 28):
        super().__init__()
        if size < 4:
            raise ValueError(f"bn_cnn: size must be at least 4 (the head's grid is size // 4 per side); "
                             f"got {size}")
        w = width
        self.grid = size // 4
        self.features = nn.Sequential(conv_bn(in_channels, w), conv_bn(w, w), nn.MaxPool2d(2),
                                      conv_bn(w, 2 * w), conv_bn(2 * w, 2 * w), nn.MaxPool2d(2))
        self.pool = nn.AdaptiveAvgPool2d(self.grid)  # no parameters: state-dict keys as before
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * w * self.grid ** 2, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_input_size("bn_cnn", self.min_size, x)
        x = self.features(x)
        if x.shape[-2:] != (self.grid, self.grid):
            x = self.pool(x)
        return self.head(x)
