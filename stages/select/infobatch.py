"""``infobatch`` (Qin et al. 2024, "InfoBatch: lossless training speed up by unbiased dynamic
data pruning"): no scoring pass. Each sample's loss from the last step that trained it is kept;
candidates whose stale loss is below the mean are skipped with probability ``prune``, and the
well-learnt ones that stay are up-weighted so the step's gradient is unbiased for the whole
candidate batch. Steps train fewer samples (the schedule is unchanged); pruning stops after
``anneal`` of training, so the last steps see every sample. Observed losses are all-gathered
every ``sync_every`` steps, not every step: the table holds losses from the last epoch anyway, a
few steps' delay changes nothing, and a collective every step is a visible share of a short CPU step.

The table lives on the training device, so a step does not wait for the host: observing and
an unpruned step read nothing back. Two reads remain: each gather reads the table's mean (and,
under DDP, the ranks' counts), and a pruned step reads how many of its candidates are eligible,
since the size of the batch it trains depends on it."""
from __future__ import annotations

import math

import torch
from pydantic import Field

from sluice.errors import SelectionError
from sluice.stages.contracts import SelectedBatch
from sluice.stages.select.base import SELECTION_METHODS, BaseSelector, MethodParams, SelectorContext, check_indices
from sluice.stages.select.collectives import all_gather_1d


class InfoBatchParams(MethodParams):
    prune: float = Field(0.5, ge=0, lt=1, description="probability of skipping a candidate whose last "
                         "training loss is below the mean (InfoBatch's r)")
    anneal: float = Field(0.875, ge=0, le=1, description="fraction of training after which nothing is "
                          "pruned (the last steps see every sample)")
    sync_every: int = Field(16, ge=1, description="steps between all-gathers of the observed losses "
                            "(1 = every step; the table is at most this stale)")


@SELECTION_METHODS.register("infobatch")
class InfoBatchSelector(BaseSelector):
    """InfoBatch's pruning over a training stage's candidate batches (no scoring pass).

    ``observe`` keeps every sample's latest training loss (all-gathered every ``sync_every``
    calls, so every rank holds the same table; ``flush`` gathers what is pending). At each step
    ``n_drop = round(prune * f * n_B)`` candidates are dropped, where
    ``f`` is the share of the split whose loss is known and below the mean: the same count on
    every rank, so DDP ranks do equal work (a rank with too few below-mean candidates prunes
    fewer; one of them always stays). They are drawn uniformly from this rank's
    below-mean candidates, and the ones kept get ``1 / (1 - dropped/eligible)``; weights are
    scaled by ``n_kept / n_B`` so ``(loss * w).mean()`` is unbiased for the mean loss of the
    whole candidate batch (the LR schedule keeps its meaning). Samples never trained are never
    pruned. After ``anneal`` of training (``set_progress``) every candidate is trained. The
    table travels in the training checkpoint (``state_dict``), so a resumed run prunes on. A warm
    run starts from the champion's table carried by sample identity (``ctx.carried``,
    ``select/infobatch_carry.py``); a resumed run's own checkpoint replaces it.
    """

    Params = InfoBatchParams
    picks_subset = False  # prunes from the candidate batch itself: no n_b, no ratio
    carries_table = True

    def __init__(self, config, ctx: SelectorContext):
        super().__init__(config, ctx)
        if ctx.split_size is None:
            raise SelectionError("infobatch keeps a loss per sample: it needs split_size")
        self.n = ctx.split_size
        self.n_select = None
        self.device = torch.device(ctx.device) if ctx.device is not None else torch.device("cpu")
        # one slot past the split takes what must not land in the table (NaN/inf losses, indices
        # outside the split), so masking needs no read: ``loss`` and ``seen`` view the rest
        self._loss = torch.zeros(self.n + 1, dtype=torch.float32, device=self.device)
        self._seen = torch.zeros(self.n + 1, dtype=torch.bool, device=self.device)
        self._outside = torch.zeros((), dtype=torch.bool, device=self.device)  # read at each gather
        self.progress = 0.0
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # observed, not yet gathered
        self._pending_calls = 0
        self._mean, self._below = math.inf, 0.0  # read after each gather
        if ctx.carried is not None:
            loss, seen = ctx.carried["loss"], ctx.carried["seen"]
            if loss.shape != (self.n,) or seen.shape != (self.n,) or seen.dtype != torch.bool:
                raise SelectionError(f"the carried infobatch table holds loss {tuple(loss.shape)} and seen "
                                     f"{tuple(seen.shape)} {seen.dtype}; this split has {self.n} samples")
            self._set_table(loss, seen)

    @property
    def loss(self) -> torch.Tensor:
        """Each sample's last training loss (valid where ``seen``), on the table's device."""
        return self._loss[:self.n]

    @property
    def seen(self) -> torch.Tensor:
        return self._seen[:self.n]

    def _set_table(self, loss: torch.Tensor, seen: torch.Tensor) -> None:
        self._loss[:self.n] = loss.detach().float().to(self.device)
        self._seen[:self.n] = seen.detach().to(self.device)
        self._refresh()

    def _place(self, device: torch.device) -> None:
        """Move the table (and what is pending) to the device the training runs on, once."""
        if device == self.device:
            return
        self.device = device
        self._loss, self._seen = self._loss.to(device), self._seen.to(device)
        self._outside = self._outside.to(device)
        self._pending = [(i.to(device), v.to(device)) for i, v in self._pending]

    def set_progress(self, fraction: float) -> None:
        self.progress = float(fraction)

    def state_dict(self) -> dict:
        # CPU tensors: a checkpoint loads with weights_only, maybe on another device. This rank's
        # pending observations travel too (no collective here), so a resumed run gathers them
        # at the same step as the uninterrupted one; NaN/inf ones would be dropped, so are here
        idx, val = self._pending_tensors()
        keep = torch.isfinite(val)
        return {**super().state_dict(), "loss": self.loss.cpu().clone(), "seen": self.seen.cpu().clone(),
                "pending_index": idx[keep].cpu(), "pending_loss": val[keep].cpu(),
                "pending_calls": self._pending_calls}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if state["loss"].numel() != self.n:
            raise SelectionError(f"infobatch state is for {state['loss'].numel()} samples, this "
                                 f"split has {self.n}")
        self._pending = []
        self._pending_calls = int(state.get("pending_calls", 0))
        if state.get("pending_index") is not None and state["pending_index"].numel():
            self._pending = [(state["pending_index"].to(self.device, torch.int64),
                              state["pending_loss"].to(self.device, torch.float32))]
        self._set_table(state["loss"], state["seen"])

    def __call__(self, model, images, labels, indices) -> SelectedBatch:
        n_cand = images.shape[0]
        if n_cand < 1:
            raise SelectionError("candidate batch is empty")
        self._place(indices.device)
        pruning = self.progress < self.params.anneal and self.params.prune > 0
        target = round(self.params.prune * self._below * n_cand) if pruning else 0
        if not target:  # nothing to prune: every candidate trains, nothing is read
            return self._keep_all(images, labels, indices)
        idx = check_indices(indices.detach(), self.n)
        eligible = (self.seen[idx] & (self.loss[idx] < self._mean)).nonzero().squeeze(1)
        # at least one eligible sample stays, so its weight (1 / keep rate) is finite
        n_drop = min(target, max(0, eligible.numel() - 1))
        keep = torch.ones(n_cand, dtype=torch.bool, device=idx.device)
        w = torch.ones(n_cand, dtype=torch.float32, device=idx.device)
        if n_drop:
            perm = torch.randperm(eligible.numel(), generator=self.generator)[:n_drop]
            keep[eligible[perm.to(idx.device)]] = False
            w[eligible] = eligible.numel() / (eligible.numel() - n_drop)
        pos = keep.nonzero().squeeze(1)
        w = w[pos] * (pos.numel() / n_cand)
        dev_pos = pos.to(images.device)
        stats = self._stats(indices, dev_pos, None)
        stats.update(ib_pruned=float(n_drop), ib_eligible=float(eligible.numel()),
                     ib_mean_loss=self._mean if math.isfinite(self._mean) else 0.0)
        return SelectedBatch(images[dev_pos], labels[dev_pos], indices[dev_pos],
                             w.to(images.device) if n_drop else None, stats)

    def _keep_all(self, images: torch.Tensor, labels: torch.Tensor, indices: torch.Tensor) -> SelectedBatch:
        """The whole candidate batch; an index outside the split is flagged, raised at the gather."""
        idx = indices.detach()
        lo, hi = torch.aminmax(idx)
        self._outside |= (lo < 0) | (hi >= self.n)
        slot = idx.clamp(0, self.n - 1)
        eligible = (self.seen[slot] & (self.loss[slot] < self._mean)).sum(dtype=torch.float32)
        stats = self._stats(indices, torch.arange(idx.numel(), device=idx.device), None)
        stats.update(ib_pruned=0.0, ib_eligible=eligible,
                     ib_mean_loss=self._mean if math.isfinite(self._mean) else 0.0)
        return SelectedBatch(images, labels, indices, None, stats)

    def observe(self, indices: torch.Tensor, losses: torch.Tensor) -> None:
        """Queue the trained samples' losses (kept on the device; NaN/inf ones are dropped when
        gathered, leaving those samples' entries as they were)."""
        if indices.numel() != losses.numel():
            raise SelectionError(f"infobatch observed {indices.numel()} indices and {losses.numel()} losses")
        self._place(losses.device)
        self._pending.append((indices.detach().reshape(-1).to(self.device, torch.int64),
                              losses.detach().reshape(-1).to(self.device, torch.float32)))
        self._pending_calls += 1
        if self._pending_calls >= self.params.sync_every:
            self.flush()

    def flush(self) -> None:
        """Gather every rank's pending observations into the table (a collective under DDP:
        every rank calls it at the same step, as ``observe`` does after ``sync_every`` calls)."""
        idx, val = self._pending_tensors()
        self._pending, self._pending_calls = [], 0
        # one ragged all-gather of (index, loss) pairs; float64 holds indices exactly below 2**53
        pairs = torch.stack([idx.to(torch.float64), val.to(torch.float64)], 1).reshape(-1)
        both = all_gather_1d(pairs, ragged=True).reshape(-1, 2)
        idx, val = both[:, 0].to(torch.int64), both[:, 1].float()
        inside = (idx >= 0) & (idx < self.n)
        self._outside |= (~inside).any()
        slot = torch.where(inside & torch.isfinite(val), idx, self.n)  # the rest: the spare slot
        self._loss[slot] = val
        self._seen[slot] = True
        self._refresh()

    def _pending_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._pending:
            return (torch.zeros(0, dtype=torch.int64, device=self.device),
                    torch.zeros(0, dtype=torch.float32, device=self.device))
        return torch.cat([i for i, _ in self._pending]), torch.cat([v for _, v in self._pending])

    def _refresh(self) -> None:
        """Read the table's mean and the share below it (one read per gather)."""
        known = self.loss[self.seen]
        if known.numel():
            mean = known.mean()
            below = (known < mean).sum()
            mean, below, outside = torch.stack([mean.double(), below.double(), self._outside.double()]).tolist()
        else:
            mean, below, outside = math.inf, 0.0, float(self._outside)
        if outside:
            raise SelectionError(f"a sample index outside the split of {self.n} samples reached "
                                 "infobatch: scores and loader disagree")
        self._mean, self._below = mean, below / self.n
