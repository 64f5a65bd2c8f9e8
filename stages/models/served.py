"""Trained models wrapped to take what a user has and return what grading scored: the modules a
tracker exports (``DataKind.servable``), so a registered version serves without Sluice's
loaders. Plain ``nn.Module``s of tensors only: ``torch.export`` traces them into a graph, and no
class of Sluice's is needed to load that graph back."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


class ServedClassifier(nn.Module):
    """uint8 images (B, C, H, W) → float logits (B, classes): scaled to [0, 1], normalised by the
    training statistics, and with ``tta="flip"`` the mean of the image's and its mirror's logits,
    as grading computes them (``stages/train/evaluate.predict``)."""

    def __init__(self, model: nn.Module, mean: Sequence[float], std: Sequence[float], tta: str = "none"):
        super().__init__()
        self.model, self.flip = model, tta == "flip"
        self.register_buffer("mean", torch.tensor(list(mean), dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(list(std), dtype=torch.float32).view(1, -1, 1, 1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = (images.float() / 255.0 - self.mean) / self.std
        out = self.model(x).float()
        if self.flip:
            out = (out + self.model(x.flip(-1)).float()) / 2
        return out


class ServedLanguageModel(nn.Module):
    """Token ids (B, L) int64 → next-token logits (B, L, vocab) in float32."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids).float()
