"""Built-in models, and user models named as ``"package.module:factory"``.

Every model takes images NCHW (uint8 0..255 already normalised by the loader, or float) and
returns logits. Factories take ``in_channels`` and ``num_classes`` keyword arguments.
"""
from __future__ import annotations

import importlib
from typing import Callable

import torch
from torch import nn


def _conv_bn(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True))


class SmallCNN(nn.Module):
    """A fast CNN for 28×28 inputs (Fashion-MNIST): ~93% test accuracy in a few epochs.

    ``hidden > 0`` swaps the global-average-pool head for the classic dense head (7×7 feature
    map → ``hidden`` units → classes): ~4% more compute but ~13× the parameters, almost all in
    one large matrix — the shape of model where gradient communication, not compute, dominates.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 32,
                 hidden: int = 0):
        super().__init__()
        w = width
        self.features = nn.Sequential(
            _conv_bn(in_channels, w), _conv_bn(w, w), nn.MaxPool2d(2),
            _conv_bn(w, 2 * w), _conv_bn(2 * w, 2 * w), nn.MaxPool2d(2),
        )
        if hidden > 0:
            self.head = nn.Sequential(nn.AdaptiveAvgPool2d(7), nn.Flatten(),
                                      nn.Linear(2 * w * 49, hidden), nn.ReLU(inplace=True),
                                      nn.Dropout(0.25), nn.Linear(hidden, num_classes))
        else:
            self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.1),
                                      nn.Linear(2 * w, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(_conv_bn(cin, cout, stride),
                                  nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = (nn.Identity() if stride == 1 and cin == cout else
                     nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


class ResNetSmall(nn.Module):
    """A ResNet-style net for 32–64 px images (ResNet-9-like widths, configurable)."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10, width: int = 64):
        super().__init__()
        w = width
        self.net = nn.Sequential(
            _conv_bn(in_channels, w), _Block(w, 2 * w, 2), _Block(2 * w, 2 * w, 1),
            _Block(2 * w, 4 * w, 2), _Block(4 * w, 4 * w, 1),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * w, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


BUILTIN: dict[str, Callable[..., nn.Module]] = {"small_cnn": SmallCNN, "resnet_small": ResNetSmall}


def build_model(name: str, in_channels: int, num_classes: int, **kwargs) -> nn.Module:
    """A built-in model by name, or ``"package.module:factory"`` for a user's own."""
    if name in BUILTIN:
        return BUILTIN[name](in_channels=in_channels, num_classes=num_classes, **kwargs)
    if ":" not in name:
        raise ValueError(f"unknown model {name!r}: use one of {sorted(BUILTIN)} or "
                         "'package.module:factory'")
    mod_name, attr = name.split(":", 1)
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load model factory {name!r}: {e}") from None
    return factory(in_channels=in_channels, num_classes=num_classes, **kwargs)
