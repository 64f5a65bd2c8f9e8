"""An exponential moving average of the weights, evaluated in place of the raw weights.

The decay warms up with the number of updates: ``min(decay, (1 + n) / (10 + n))`` (the schedule
of TensorFlow's ``ExponentialMovingAverage(num_updates=...)``). A fixed decay of 0.995 averages
over ~200 steps, so a run of a few dozen steps evaluated an average that was still ~90% its
first step's weights and scored at chance; with the warm-up a short run evaluates its recent
weights, while a long run reaches the full decay after ~1,800 steps and ends as before.

The update never reads its counter on the host (a training step must not wait for the device):
the warm-up weight is computed from ``n_averaged`` on the weights' device, in float64 as Python
would, so the result is bitwise the one a host-side ``ema_decay_at`` gives.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch.optim.swa_utils import AveragedModel


def ema_decay_at(decay: float, updates: int) -> float:
    """The decay applied at the ``updates``-th averaging (counted from 0, the first copy)."""
    return min(decay, (1.0 + updates) / (10.0 + updates))


class WarmupEMA(AveragedModel):
    """An ``AveragedModel`` (parameters and buffers, so BN statistics follow) whose decay warms up
    as :func:`ema_decay_at` says, updated without a host read. Its state (``n_averaged``
    included) checkpoints and resumes with the model's, as ``AveragedModel``'s does."""

    def __init__(self, model: torch.nn.Module, decay: float):
        super().__init__(model, use_buffers=True)
        self.decay = decay
        first = next(iter([*model.parameters(), *model.buffers()]), None)
        if first is not None:  # the counter lives with the weights, where the update reads it
            self.n_averaged = self.n_averaged.to(first.device)
        self._started = False  # host: whether the first update (a copy) has happened

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        out = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self._started = bool(self.n_averaged > 0)  # read once, at resume
        return out

    def weight(self) -> torch.Tensor:
        """``1 - ema_decay_at(decay, n_averaged)`` as a float64 tensor on the counter's device."""
        n = self.n_averaged.to(torch.float64)
        return 1.0 - ((1.0 + n) / (10.0 + n)).clamp(max=self.decay)

    @torch.no_grad()
    def update_parameters(self, model: torch.nn.Module) -> None:
        mine = [t.detach() for t in (*self.module.parameters(), *self.module.buffers())]
        theirs = [t.detach() for t in (*model.parameters(), *model.buffers())]
        if not self._started:  # the first update copies, as AveragedModel's does
            torch._foreach_copy_(mine, [t.to(m.device) for m, t in zip(mine, theirs)])
            self._started = True
        else:
            w = self.weight()
            groups: dict[tuple[torch.device, torch.dtype], tuple[list, list]] = {}
            for m, t in zip(mine, theirs):
                a, b = groups.setdefault((m.device, m.dtype), ([], []))
                a.append(m)
                b.append(t.to(m.device))
            for (device, dtype), (a, b) in groups.items():
                if not dtype.is_floating_point:  # counters (BN's num_batches_tracked): the current value
                    torch._foreach_copy_(a, b)
                else:  # the weight as one tensor per parameter: a single tensor would be read
                    # back as a Python scalar, a host sync every step on CUDA (seen on an H200)
                    wd = w.to(device, dtype)
                    torch._foreach_lerp_(a, b, [wd] * len(a))
        self.n_averaged += 1


def build_ema(model: torch.nn.Module, decay: float) -> WarmupEMA:
    """The run's EMA of ``model`` (see :class:`WarmupEMA`)."""
    return WarmupEMA(model, decay)
