"""``uniform``: a random n_b of the candidates — the control (no scoring pass)."""
from __future__ import annotations

import torch

from sluice.stages.contracts import SelectedBatch
from sluice.stages.select.base import SELECTION_METHODS, BaseSelector


@SELECTION_METHODS.register("uniform")
class UniformSelector(BaseSelector):
    def __call__(self, model, images, labels, indices) -> SelectedBatch:
        n = self._n(images.shape[0])
        pos = torch.randperm(images.shape[0], generator=self.generator)[:n].to(images.device)
        return SelectedBatch(images[pos], labels[pos], indices[pos], None,
                             self._stats(indices, pos, None))
