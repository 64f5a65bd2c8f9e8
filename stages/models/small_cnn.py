"""``small_cnn``: a fast CNN for small images (Fashion-MNIST's 28×28); any input of at least 4×4 px."""
from __future__ import annotations

import torch
from torch import nn

from sluice.stages.models.base import MODELS, check_input_size, conv_bn


@MODELS.register("small_cnn")
class SmallCNN(nn.Module):
    """A fast CNN for small images: ~93% test accuracy on Fashion-MNIST (28×28) in a few epochs.
    It takes any input of at least 4×4 px (its head pools the feature map, globally or to 7×7),
    and suits images of about 28–32 px best: its receptive field is 16 px and it downsamples only
    4×, so larger ones work at a cost growing with their area.

    ``hidden > 0`` swaps the global-average-pool head for the classic dense head (the feature map
    average-pooled to 7×7, as it is at 28 px → ``hidden`` units → classes): ~4% more compute but
    ~13× the parameters, almost all in one large matrix — the shape of model where gradient
    communication, not compute, dominates.
    """

    min_size = 4  # two 2×2 max-pools: 4 px leaves a 1×1 map

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 32,
                 hidden: int = 0):
        super().__init__()
        w = width
        self.features = nn.Sequential(
            conv_bn(in_channels, w), conv_bn(w, w), nn.MaxPool2d(2),
            conv_bn(w, 2 * w), conv_bn(2 * w, 2 * w), nn.MaxPool2d(2),
        )
        if hidden > 0:
            self.head = nn.Sequential(nn.AdaptiveAvgPool2d(7), nn.Flatten(),
                                      nn.Linear(2 * w * 49, hidden), nn.ReLU(inplace=True),
                                      nn.Dropout(0.25), nn.Linear(hidden, num_classes))
        else:
            self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.1),
                                      nn.Linear(2 * w, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_input_size("small_cnn", self.min_size, x)
        return self.head(self.features(x))
