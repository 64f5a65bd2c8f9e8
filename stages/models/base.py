"""The model registry, and building blocks the built-in models share.

A model entry is a factory ``(in_channels=, num_classes=, **kwargs) -> nn.Module`` taking
images NCHW (normalised float) and returning logits; a class with ``task = "language_model"``
(``gpt``) takes token rows instead (``contracts.TokenInputs``; ``num_classes`` is the vocabulary)
and returns next-token logits (``stages/train/tasks.py``). Built-ins: one file each, registered with
``@MODELS.register(name)``; users add theirs the same way, or through an entry point in group
``sluice.models`` (see ``sluice.plugins``), and name them in ``train.model``.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from sluice.plugins import PluginRegistry

ModelFactory = Callable[..., nn.Module]
MODELS: PluginRegistry[ModelFactory] = PluginRegistry("models", "model")


def model_task(name: str) -> str:
    """The task the registered model ``name`` is trained for (``stages/train/tasks.TASKS``): what
    its class declares as ``task``, ``classify`` for a factory that declares none."""
    return str(getattr(MODELS.get(name), "task", "classify"))


def build_model(name: str, in_channels: int, num_classes: int, **kwargs) -> nn.Module:
    """The registered model ``name`` for ``in_channels``-channel images and ``num_classes``."""
    return MODELS.get(name)(in_channels=in_channels, num_classes=num_classes, **kwargs)


def conv_bn(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    """3×3 convolution (no bias), BatchNorm, ReLU."""
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True))
