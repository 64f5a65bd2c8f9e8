"""The model registry, and building blocks the built-in models share.

A model entry is a factory ``(in_channels=, num_classes=, **kwargs) -> nn.Module`` taking
images NCHW (normalised float) and returning logits; a class with ``task = "language_model"``
(``gpt``) takes token rows instead (``contracts.TokenInputs``; ``num_classes`` is the vocabulary)
and returns next-token logits (``stages/train/tasks.py``). Built-ins: one file each, registered with
``@MODELS.register(name)``; users add theirs the same way, or through an entry point in group
``sluice.models`` (see ``sluice.plugins``), and name them in ``train.model``.

An image model takes any input size from its class's ``min_size`` up (the built-ins end in a
global or adaptive pool, so their head does not depend on the resolution): ``min_input_size(name)``
says how small an image the model ``name`` takes, so that a check before a run can compare it with
the data's resolution; ``check_input_size`` is the clear error a built-in raises below it.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from sluice.plugins import PluginRegistry

ModelFactory = Callable[..., nn.Module]
MODELS: PluginRegistry[ModelFactory] = PluginRegistry("models", "model")


def model_task(name: str) -> str:
    """The task the registered model ``name`` is trained for (``stages/train/tasks.TASKS``): what
    its class declares as ``task``, ``classify`` for a factory that declares none."""
    return str(getattr(MODELS.get(name), "task", "classify"))


def min_input_size(name: str) -> int | None:
    """The smallest image side, in pixels, that the registered model ``name`` takes (height and
    width each): what its class declares as ``min_size``, the smallest side at which it trains on
    any batch, a single image included. None for a model that declares none: a language model
    (``gpt``), or a user's model that does not say."""
    size = getattr(MODELS.get(name), "min_size", None)
    return None if size is None else int(size)


def check_input_size(name: str, min_size: int, x: torch.Tensor) -> None:
    """A ValueError naming the model ``name`` and both sizes when image batch ``x`` (…HW) is
    smaller than ``min_size`` on either side; built-in image models call it first in ``forward``."""
    h, w = int(x.shape[-2]), int(x.shape[-1])
    if h < min_size or w < min_size:
        raise ValueError(f"model {name!r} needs images of at least {min_size}×{min_size} px; "
                         f"got {h}×{w} (height×width)")


def build_model(name: str, in_channels: int, num_classes: int, **kwargs) -> nn.Module:
    """The registered model ``name`` for ``in_channels``-channel images and ``num_classes``."""
    return MODELS.get(name)(in_channels=in_channels, num_classes=num_classes, **kwargs)


def conv_bn(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    """3×3 convolution (no bias), BatchNorm, ReLU."""
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True))
