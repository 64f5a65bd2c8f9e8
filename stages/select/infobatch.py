"""``infobatch`` (Qin et al. 2024, "InfoBatch: lossless training speed up by unbiased dynamic
data pruning"): no scoring pass. Each sample's loss from the last step that trained it is kept;
candidates whose stale loss is below the mean are skipped with probability ``prune``, and the
well-learnt ones that stay are up-weighted so the step's gradient is unbiased for the whole
candidate batch. Steps skip samples (the schedule is unchanged); pruning stops after
``anneal`` of training, so the last steps see every sample. Observed losses are all-gathered
every ``sync_every`` steps, not every step: the table holds losses from the last epoch anyway, a
few steps' delay changes nothing, and a collective every step is a visible share of a short CPU step.

The table lives on the training device, so a step does not wait for the host: observing and
an unpruned step read nothing back. Each gather reads the table's mean (and, under DDP, the
ranks' counts). How a pruning step skips samples is ``mode``:

- ``drop`` trains only the kept candidates. The batch's size depends on how many candidates are
  eligible, so the step reads that count (and the kept positions) on the host.
- ``mask`` trains every candidate and gives the skipped ones weight 0, so the batch keeps its
  size and nothing is read: the count, the draw (random keys on the device, from a generator on
  the batch's device) and the weights stay device tensors. ``(loss * w).mean()`` over the whole
  batch equals drop mode's mean over the kept samples for the same skipped set. It saves no
  compute: the skipped samples still go forward and backward. BatchNorm also sees them in its
  batch statistics, the one difference from drop mode.
- ``auto`` (the default) is ``mask`` on an accelerator and ``drop`` on the CPU. A small model's
  GPU step is bound by per-step overhead, not FLOPs, so the samples drop mode skips save little,
  while its read drains the device's queue every pruning step. On the CPU a read costs nothing
  and the skipped samples' compute is the saving."""
from __future__ import annotations

import math
from typing import ClassVar, Literal

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
    mode: Literal["auto", "drop", "mask"] = Field(
        "auto", description="how a pruning step skips samples: drop (trains fewer; reads the "
        "eligible count on the host), mask (trains all, skipped ones weighted 0; reads nothing), "
        "auto (mask on an accelerator, drop on the CPU)")


_MASKS_KEPT = 256  # mask-mode draws awaiting their observe (one per micro-batch of a step)


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
    ``select/infobatch_carry.py``); a resumed run's own checkpoint replaces it. In ``mask`` mode
    the dropped candidates stay in the batch with weight 0 (the module docstring says why) and
    ``observe`` passes over their losses, as drop mode never sees them.
    """

    Params = InfoBatchParams
    picks_subset = False  # prunes from the candidate batch itself: no n_b, no ratio
    carries_table = True
    token_rows = True  # keyed by document instead: ``select/infobatch_tokens.py``
    # the threshold: the table's mean at each epoch's start (``set_epoch``), as the paper prunes
    # once per epoch, instead of the mean at every gather (off here: image runs keep theirs)
    epoch_threshold: ClassVar[bool] = False

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
        self._mean, self._below = math.inf, 0.0  # the threshold in use and the share below it
        self._table = (math.inf, 0.0)  # the table's own, read after each gather
        self._epoch: int | None = None  # epoch_threshold: the epoch whose start ``_snap`` is from
        self._snap: tuple[float, float] | None = None
        # mask mode: the draw's generator lives on the batch's device (made at its first draw;
        # a loaded state, with its device type, waits for it), and each draw's keep mask waits,
        # keyed by the indices tensor handed out, for the observe of that batch
        self._mask_gen: torch.Generator | None = None
        self._mask_state: tuple[torch.Tensor | None, str | None] = (None, None)
        self._masks: list[tuple[torch.Tensor, torch.Tensor]] = []
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

    def set_epoch(self, epoch: int) -> None:
        """The loop's epoch, before each selection. With ``epoch_threshold`` the mean and the share
        below it stay the table's at the epoch's start (its last gather before): a mean refreshed
        at every gather mixes this epoch's fresh losses, lower as the model learns, with the stale
        ones of the candidates not revisited yet, so late in an epoch few candidates fall below
        it. Without it (the default) nothing changes."""
        if self.epoch_threshold and epoch != self._epoch:  # an empty table: no candidate is below
            self._epoch = epoch
            self._snap = self._table if math.isfinite(self._table[0]) else (-math.inf, 0.0)
            self._mean, self._below = self._snap

    def _set_threshold(self, mean: float, below: float) -> None:
        """The table's mean and share below it, just read; in use unless an epoch's start holds."""
        self._table = (mean, below)
        self._mean, self._below = self._snap if self._snap is not None else self._table

    def state_dict(self) -> dict:
        # CPU tensors: a checkpoint loads with weights_only, maybe on another device. This rank's
        # pending observations travel too (no collective here), so a resumed run gathers them
        # at the same step as the uninterrupted one; NaN/inf ones would be dropped, so are here
        idx, val = self._pending_tensors()
        keep = torch.isfinite(val)
        gen, kind = self._mask_state
        if self._mask_gen is not None:  # a CPU uint8 tensor, whatever the generator's device
            gen, kind = self._mask_gen.get_state(), self._mask_gen.device.type
        return {**super().state_dict(), "loss": self.loss.cpu().clone(), "seen": self.seen.cpu().clone(),
                "pending_index": idx[keep].cpu(), "pending_loss": val[keep].cpu(),
                "pending_calls": self._pending_calls,
                "mask_generator": None if gen is None else gen.cpu().clone(), "mask_generator_device": kind}

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
        self._mask_gen, self._masks = None, []
        self._mask_state = (state.get("mask_generator"), state.get("mask_generator_device"))

    def _generator(self, device: torch.device) -> torch.Generator:
        """Mask mode's generator on ``device``, seeded from the selection seed or set to the
        state loaded (a state from another device type cannot be set: it starts from the seed)."""
        if self._mask_gen is not None and self._mask_gen.device == device:
            return self._mask_gen
        state, kind = self._mask_state
        if self._mask_gen is not None:  # the table moved: the draws go on where they were
            state, kind = self._mask_gen.get_state(), self._mask_gen.device.type
        gen = torch.Generator(device=device).manual_seed(self.config.seed)
        if state is not None and kind == device.type:
            gen.set_state(state)
        self._mask_gen, self._mask_state = gen, (None, None)
        return gen

    def _mode(self, images: torch.Tensor) -> str:
        mode = self.params.mode
        if mode == "auto":
            return "drop" if images.device.type == "cpu" else "mask"
        return mode

    def __call__(self, model, images, labels, indices) -> SelectedBatch:
        n_cand = images.shape[0]
        if n_cand < 1:
            raise SelectionError("candidate batch is empty")
        self._place(indices.device)
        pruning = self.progress < self.params.anneal and self.params.prune > 0
        target = round(self.params.prune * self._below * n_cand) if pruning else 0
        if not target:  # nothing to prune: every candidate trains, nothing is read
            return self._keep_all(images, labels, indices)
        if self._mode(images) == "mask":
            return self._masked(images, labels, indices, target)
        eligible = self._eligible_positions(indices)
        # at least one eligible sample stays, so its weight (1 / keep rate) is finite
        n_drop = min(target, max(0, eligible.numel() - 1))
        keep = torch.ones(n_cand, dtype=torch.bool, device=eligible.device)
        w = torch.ones(n_cand, dtype=torch.float32, device=eligible.device)
        if n_drop:
            perm = torch.randperm(eligible.numel(), generator=self.generator)[:n_drop]
            keep[eligible[perm.to(eligible.device)]] = False
            w[eligible] = eligible.numel() / (eligible.numel() - n_drop)
        pos = keep.nonzero().squeeze(1)
        w = w[pos] * (pos.numel() / n_cand)
        dev_pos = pos.to(images.device)
        stats = self._stats(indices, dev_pos, None)
        stats.update(ib_pruned=float(n_drop), ib_eligible=float(eligible.numel()),
                     ib_mean_loss=self._mean if math.isfinite(self._mean) else 0.0)
        return SelectedBatch(images[dev_pos], labels[dev_pos], indices[dev_pos],
                             w.to(images.device) if n_drop else None, stats)

    def _eligible_positions(self, indices: torch.Tensor) -> torch.Tensor:
        """Drop mode: the positions of the candidates known and below the mean (read on the host;
        an index outside the split raises now)."""
        idx = check_indices(indices.detach(), self.n)
        return (self.seen[idx] & (self.loss[idx] < self._mean)).nonzero().squeeze(1)

    def _masked(self, images: torch.Tensor, labels: torch.Tensor, indices: torch.Tensor,
                target: int) -> SelectedBatch:
        """Mask mode: the whole batch, ``n_drop`` eligible candidates drawn uniformly weighted 0,
        the eligible ones kept up-weighted; all on the device (nothing read). The draw: random
        keys for the eligible candidates, +inf for the rest; the ``n_drop`` lowest are dropped."""
        n_cand, dev = len(indices), self.device
        eligible = self._eligible(indices)
        count = eligible.sum()
        n_drop = (count - 1).clamp(min=0, max=target)  # at least one eligible sample stays
        keys = torch.rand(n_cand, generator=self._generator(dev), device=dev)
        order = torch.where(eligible, keys, math.inf).argsort()
        drop = torch.zeros_like(eligible).scatter(0, order, torch.arange(n_cand, device=dev) < n_drop)
        keep = ~drop
        up = (count / (count - n_drop).clamp(min=1)).float()  # eligible / (eligible - n_drop)
        w = torch.where(drop, 0.0, torch.where(eligible, up, 1.0))
        if len(self._masks) >= _MASKS_KEPT:  # never observed (a loop without observe)
            del self._masks[0]
        self._masks.append((indices, keep))
        stats = self._stats(indices, torch.arange(n_cand, device=dev), None)
        kept = keep.float()
        n_kept = kept.sum()
        il, noise = self._lookup(self._il, indices), self._lookup(self._noise, indices)
        if il is not None:
            stats["sel_il_mean"] = (il.float() * kept).sum() / n_kept
        if noise is not None:
            stats["sel_noisy"] = (noise.float() * kept).sum()
        stats.update(n_selected=n_kept, ib_pruned=n_drop.float(), ib_eligible=count.float(),
                     ib_mean_loss=self._mean if math.isfinite(self._mean) else 0.0)
        return SelectedBatch(images, labels, indices, w.to(images.device), stats)

    def _eligible(self, indices: torch.Tensor) -> torch.Tensor:
        """Which candidates are known and below the mean, without a read: an index outside the
        split is flagged on the device and raised at the next gather."""
        idx = indices.detach().to(self.device)
        lo, hi = torch.aminmax(idx)
        self._outside |= (lo < 0) | (hi >= self.n)
        slot = idx.clamp(0, self.n - 1)
        return self.seen[slot] & (self.loss[slot] < self._mean)

    def _keep_all(self, images: torch.Tensor, labels: torch.Tensor, indices: torch.Tensor) -> SelectedBatch:
        """The whole candidate batch; an index outside the split is flagged, raised at the gather."""
        idx = indices.detach()
        eligible = self._eligible(idx).sum(dtype=torch.float32)
        stats = self._stats(indices, torch.arange(len(idx), device=idx.device), None)
        stats.update(ib_pruned=0.0, ib_eligible=eligible,
                     ib_mean_loss=self._mean if math.isfinite(self._mean) else 0.0)
        return SelectedBatch(images, labels, indices, None, stats)

    def observe(self, indices: torch.Tensor, losses: torch.Tensor) -> None:
        """Queue the trained samples' losses (kept on the device; NaN/inf ones are dropped when
        gathered, leaving those samples' entries as they were). The indices of a mask-mode batch
        (the tensor it handed out) bring its mask: its dropped samples' losses become NaN."""
        if indices.numel() != losses.numel():
            raise SelectionError(f"infobatch observed {indices.numel()} indices and {losses.numel()} losses")
        self._place(losses.device)
        val = losses.detach().reshape(-1).to(self.device, torch.float32)
        for k, (handed, keep) in enumerate(self._masks):
            if handed is indices:  # this draw's; older ones were never observed
                del self._masks[:k + 1]
                val = torch.where(keep.to(self.device), val, math.nan)
                break
        self._pending.append((indices.detach().reshape(-1).to(self.device, torch.int64), val))
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
        self._set_threshold(mean, below / self.n)
