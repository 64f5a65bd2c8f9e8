"""A package outside Sluice that extends it the way a user's package would: through entry points
(``tests/conftest.py`` installs it, with its dist-info, on a temporary path), so the torchrun
workers Sluice starts find these entries by name, never by an import path in a config."""
from __future__ import annotations

import torch
from torch import nn

from sluice.stages.contracts import SelectedBatch
from sluice.stages.select.base import BaseSelector, MethodParams

ENTRY_POINTS = {
    "sluice.selection_methods": {"fixed_count": "sluice_test_plugins:FixedCountSelector"},
    "sluice.models": {"tiny_mlp": "sluice_test_plugins:tiny_mlp"},
}


class FixedCountParams(MethodParams):
    nan_after: int | None = None


class FixedCountSelector(BaseSelector):
    """Keeps the ``n_select`` highest-loss candidates; from call ``params.nan_after + 1`` on it
    poisons one weight with NaN (a diverging run, for the error path)."""
    Params = FixedCountParams

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self.calls, self.nan_after = 0, self.params.nan_after

    def __call__(self, model, images, labels, indices) -> SelectedBatch:
        self.calls += 1
        k = self._n(images.shape[0])
        with torch.no_grad():
            was = model.training
            model.eval()
            loss = nn.functional.cross_entropy(model(images), labels, reduction="none")
            model.train(was)
        top = loss.topk(k).indices
        w = torch.ones(k, device=images.device)
        if self.nan_after is not None and self.calls > self.nan_after:
            w[0] = float("nan")
        return SelectedBatch(images[top], labels[top], indices[top], w,
                             {"kept_frac": k / len(labels)})


def tiny_mlp(in_channels: int, num_classes: int, hidden: int = 32, size: int = 28) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * size * size, hidden), nn.ReLU(),
                         nn.Linear(hidden, num_classes))
