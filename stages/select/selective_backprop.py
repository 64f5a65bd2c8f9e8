"""``selective_backprop`` (Jiang et al. 2019): each candidate is kept with probability
``percentile(loss among recent losses) ** beta``; kept samples queue up and exactly ``n_b`` are
trained per call (topped up with the most likely non-kept ones when the queue is short)."""
from __future__ import annotations

import torch
from pydantic import Field

from sluice.stages.contracts import SelectedBatch
from sluice.stages.select.base import SELECTION_METHODS, BaseSelector, ScoringParams, candidate_losses, check_finite
from sluice.stages.select.label_noise import resolve_label_noise


class SelectiveBackpropParams(ScoringParams):
    beta: float = Field(1.0, gt=0, description="keep probability = percentile**beta")
    history_size: int = Field(1024, ge=1, description="recent losses the percentile is taken among")
    min_keep_prob: float = Field(0.0, ge=0, le=1, description="floor of the keep probability")


@SELECTION_METHODS.register("selective_backprop")
class SelectiveBackpropSelector(BaseSelector):
    """Keep candidates with probability percentile(loss)**beta among recent losses; emit
    exactly n_b per call from a queue of kept samples (oldest first)."""
    Params = SelectiveBackpropParams
    resolve_auto = staticmethod(resolve_label_noise)  # label_noise: auto, off the IL scores record

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.history = torch.empty(0)
        self._queue: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def state_dict(self) -> dict:  # the queue of kept samples is not kept: it refills in a step
        return {**super().state_dict(), "history": self.history.clone()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.history = state["history"].clone()

    def keep_probability(self, loss: torch.Tensor) -> torch.Tensor:
        """Add ``loss`` to the history and return each value's percentile**beta (CPU)."""
        loss = loss.detach().float().cpu()
        self.history = torch.cat([self.history, loss])[-self.params.history_size:]
        ranked = torch.sort(self.history).values
        pct = torch.searchsorted(ranked, loss, right=True).float() / ranked.numel()
        return pct.pow(self.params.beta).clamp(min=self.params.min_keep_prob)

    def __call__(self, model, images, labels, indices) -> SelectedBatch:
        n = self._n(images.shape[0])
        loss = candidate_losses(model, images, labels, self.params.score_mode,
                                self.params.score_chunk, self.params.label_noise)
        check_finite(loss, "candidate training losses", indices)
        prob = self.keep_probability(loss)
        keep = torch.rand(prob.shape, generator=self.generator) < prob
        kept = keep.nonzero().squeeze(1).to(images.device)
        queued = sum(len(q[2]) for q in self._queue)
        self._queue.append((images[kept], labels[kept], indices[kept]))
        topped = max(0, n - queued - kept.numel())
        if topped:  # queue short: add the most likely of the samples not kept
            rest = (~keep).nonzero().squeeze(1)
            extra = rest[torch.topk(prob[rest], topped).indices].to(images.device)
            self._queue.append((images[extra], labels[extra], indices[extra]))
        x, y, i = (torch.cat(t) for t in zip(*self._queue))
        self._queue = [(x[n:n + images.shape[0]], y[n:n + images.shape[0]],
                        i[n:n + images.shape[0]])] if x.shape[0] > n else []
        pos_in_cand = torch.nonzero(indices.unsqueeze(1) == i[:n].unsqueeze(0))[:, 0]
        stats = self._stats(indices, pos_in_cand, loss) if pos_in_cand.numel() else {}
        stats.update(n_selected=float(n), sb_keep_rate=float(keep.float().mean()),
                     sb_topped_up=float(topped), sb_queued=float(max(0, x.shape[0] - n)))
        return SelectedBatch(x[:n], y[:n], i[:n], None, stats)
