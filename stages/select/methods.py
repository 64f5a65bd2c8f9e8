"""Sample selection: train on the points that are learnable, worth learning and not yet learnt.

Methods (``SelectionConfig.method``):

* ``none``: train on every candidate (``build_selector`` returns None).
* ``uniform``: a random ``n_b`` of the ``n_B`` candidates (the control; no forward pass).
* ``loss``: the ``n_b`` candidates with the highest training loss.
* ``rho_loss``: the ``n_b`` with the highest reducible loss = training loss - irreducible loss
  (Mindermann et al. 2022); the IL comes from ``sluice.stages.select.il_model`` (a scores artifact).
* ``selective_backprop`` (Jiang et al. 2019): each candidate is kept with probability
  ``percentile(loss among recent losses) ** beta``; kept samples queue up and exactly ``n_b``
  are trained per call (topped up with the most likely non-kept ones when the queue is short).
* ``importance`` (Katharopoulos & Fleuret 2018): per-sample loss estimates give sampling
  probabilities (smoothed toward uniform); ``ImportanceSampler`` draws the loader's indices and
  the selector attaches weights ``1 / (N p_i)`` so the weighted loss is unbiased.
* ``infobatch`` (Qin et al. 2024, "InfoBatch: lossless training speed up by unbiased dynamic
  data pruning"): no scoring pass. Each sample's loss from the last step that trained it is
  kept; candidates whose stale loss is below the mean are skipped with probability ``prune``,
  and the well-learnt ones that stay are up-weighted so the step's gradient is unbiased for the
  whole candidate batch. Steps train fewer samples (the schedule is unchanged); pruning stops
  after ``anneal`` of training, so the last steps see every sample.

The hook: ``selector(model, images, labels, indices) -> SelectedBatch``. Images are on the
model's device, float, normalised; labels int64; indices int64 = the stable index within the
split (IL scores and noise masks are aligned to it). Every call returns exactly
``selector.n_select`` samples (importance: the whole batch), so DDP ranks do equal work; each
rank selects from its own candidates (``infobatch`` returns a smaller batch, of the same size
on every rank). When ``weights`` is not None the loop must compute
``(per_sample_loss * weights).mean()``.

``selector.observe(indices, losses)``: call it after the training step with the selected
samples' per-sample losses (detached). Importance sampling and InfoBatch use it to update their
loss estimates (all-gathered across ranks when torch.distributed is initialised); the others
ignore it. ``selector.set_progress(fraction)``, where a selector has it, is called before each
step with the fraction of training done (InfoBatch stops pruning at ``anneal``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, field_validator

from sluice.stages.select.il_model import (IL_KIND, ILModelConfig, SelectionError, compute_irreducible_loss,
                              irreducible_loss_scores)
from sluice.storage.scores import Scores, ScoresError, check_scores

__all__ = ["SelectionConfig", "ILModelConfig", "SelectedBatch", "SelectionError", "build_selector",
           "compute_irreducible_loss", "irreducible_loss_scores", "IL_KIND", "ImportanceSampler",
           "LabelNoise", "inject_label_noise", "select_top", "selection_scores"]

try:
    from sluice.stages.train.loop import SelectedBatch  # type: ignore[attr-defined]
except ImportError:
    @dataclass
    class SelectedBatch:  # identical to sluice.stages.train.loop.SelectedBatch (the training stage's type)
        """The samples to train on this step, optional per-sample loss weights, and stats."""
        images: torch.Tensor
        labels: torch.Tensor
        indices: torch.Tensor
        weights: torch.Tensor | None
        stats: dict[str, float]

Method = Literal["none", "uniform", "loss", "rho_loss", "selective_backprop", "importance",
                 "infobatch"]


class SelectionConfig(BaseModel):
    """The selection method and its knobs: the same shape from YAML, Prefect or Python."""
    model_config = ConfigDict(extra="forbid")

    method: Method = "none"
    ratio: float = Field(0.1, gt=0, le=1, description="n_b / n_B (paper default 10%)")
    n_select: int | None = Field(None, ge=1, description="fixed n_b; overrides ratio")
    score_mode: Literal["train", "eval"] = Field(
        "train", description="mode of the no-grad scoring pass (the paper scores in train mode)")
    score_chunk: int | None = Field(
        None, ge=1, description="score the candidates this many at a time: on CPU a no-grad pass "
        "over 64 samples costs ~25% less per sample than one over 384 (cache-sized activations); "
        "in train mode each chunk gets its own BatchNorm batch statistics. None = one pass")
    label_noise: float | Literal["auto"] = Field(
        0.0, description="score the candidates' loss under a uniform label-noise likelihood "
        "(1-a) p + a/K, as the IL model trained on noisy labels implicitly does: a target trained "
        "on filtered data otherwise grows more confident than the IL model and mislabelled "
        "samples win rho_loss's top-k. Rank-preserving for loss/selective_backprop. 'auto': a = "
        "1 - the IL model's accuracy on its holdout (from the IL scores record). 0 = plain CE")

    seed: int = 0
    il: ILModelConfig = Field(default_factory=ILModelConfig)
    smoothing: float = Field(0.1, ge=0, le=1, description="importance: mix of uniform in p")
    estimate_momentum: float = Field(0.0, ge=0, lt=1,
                                     description="importance: EMA of loss estimates (0 = latest)")
    importance_draw: Literal["sampler", "candidates"] = Field(
        "sampler", description="importance: 'sampler' = batches are drawn from selector.sampler "
        "(a plain loop), weights 1/(N p); 'candidates' = any loader's uniform candidate batch of "
        "n_B, n_b of them redrawn in proportion to p, weights 1/(n_B q) (the training stage)")
    beta: float = Field(1.0, gt=0, description="selective backprop: keep prob = percentile**beta")
    history_size: int = Field(1024, ge=1, description="selective backprop: recent losses kept")
    min_keep_prob: float = Field(0.0, ge=0, le=1, description="selective backprop: floor")
    prune: float = Field(0.5, ge=0, lt=1, description="infobatch: probability of skipping a "
                         "candidate whose last training loss is below the mean (InfoBatch's r)")
    anneal: float = Field(0.875, ge=0, le=1, description="infobatch: fraction of training after "
                          "which nothing is pruned (the last steps see every sample)")

    @field_validator("label_noise")
    @classmethod
    def _rate(cls, v: float | str) -> float | str:
        if v != "auto" and not 0 <= v < 1:
            raise ValueError("label_noise must be 'auto' or a rate in [0, 1)")
        return v

    def n_select_for(self, n_candidates: int) -> int:
        """n_b for a candidate batch of ``n_candidates``; raises if it is not in [1, n_B]."""
        if n_candidates < 1:
            raise SelectionError("candidate batch is empty")
        if self.method == "infobatch":  # prunes from the batch itself: no n_b, no ratio
            return n_candidates
        n_b = self.n_select if self.n_select is not None else int(round(self.ratio * n_candidates))
        if n_b < 1:
            raise SelectionError(f"n_b = round({self.ratio} * {n_candidates}) = {n_b} < 1: raise "
                                 "the ratio or the candidate batch size")
        if n_b > n_candidates:
            raise SelectionError(f"n_b = {n_b} > n_B = {n_candidates}: cannot select more samples "
                                 "than there are candidates")
        return n_b


# ---------------------------------------------------------------- pure selection rules

def selection_scores(method: str, train_loss: torch.Tensor,
                     il: torch.Tensor | None = None) -> torch.Tensor:
    """What top-k selection ranks by: the loss, or the reducible loss (loss - IL)."""
    if method == "loss":
        return train_loss
    if method == "rho_loss":
        if il is None:
            raise SelectionError("rho_loss needs irreducible-loss scores")
        return train_loss - il
    raise SelectionError(f"no score rule for method {method!r}")


def select_top(scores: torch.Tensor, n: int) -> torch.Tensor:
    """Positions of the ``n`` highest scores (exactly ``n``; NaN/inf refused)."""
    _check_finite(scores, "selection scores")
    if not 1 <= n <= scores.numel():
        raise SelectionError(f"cannot select {n} of {scores.numel()} candidates")
    return torch.topk(scores, n, sorted=False).indices


def _check_finite(t: torch.Tensor, what: str, indices: torch.Tensor | None = None) -> None:
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        where = (indices if indices is not None else torch.arange(t.numel(), device=t.device))[bad]
        raise SelectionError(f"{what}: {int(bad.sum())} NaN/inf values (sample indices "
                             f"{where[:5].tolist()}); check the learning rate and the inputs")


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP/compile wrappers, so scoring triggers no collective."""
    return getattr(model, "module", None) or getattr(model, "_orig_mod", None) or model


@torch.no_grad()
def candidate_losses(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor,
                     mode: str = "train", chunk: int | None = None,
                     label_noise: float = 0.0) -> torch.Tensor:
    """Per-sample training loss of the candidates from a no-grad forward pass (in chunks of
    ``chunk`` samples when given), under a uniform label-noise rate ``label_noise``."""
    m = _unwrap(model)
    was_training = m.training
    m.train(mode == "train")
    try:
        parts = images.split(chunk) if chunk else (images,)
        logits = torch.cat([m(part).float() for part in parts])
    finally:
        m.train(was_training)
    if not label_noise:
        return F.cross_entropy(logits, labels, reduction="none")
    p = logits.softmax(1).gather(1, labels.unsqueeze(1)).squeeze(1)
    return -torch.log((1 - label_noise) * p + label_noise / logits.shape[1])


# ---------------------------------------------------------------- selectors

class _Base:
    """Shared state: n_b, the IL scores and noise mask (aligned to split indices), stats."""

    def __init__(self, config: SelectionConfig, n_select: int | None, il: torch.Tensor | None,
                 noise_mask: torch.Tensor | None):
        self.config = config
        self.n_select = n_select
        self._il = il
        self._noise = noise_mask
        self.generator = torch.Generator().manual_seed(config.seed)

    def _n(self, n_candidates: int) -> int:
        n = self.config.n_select_for(n_candidates)
        if self.n_select is not None and n != self.n_select:
            raise SelectionError(f"candidate batch of {n_candidates} gives n_b = {n}, but this "
                                 f"selector was built for n_b = {self.n_select}; every step "
                                 "(and rank) must train the same count")
        return n

    def _lookup(self, table: torch.Tensor | None, indices: torch.Tensor) -> torch.Tensor | None:
        if table is None:
            return None
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= table.numel()):
            raise SelectionError(f"sample index {int(indices.max())} outside the scored split of "
                                 f"{table.numel()} samples: scores and loader disagree")
        if table.device != indices.device:  # move both tables once, to the batch's device
            self._il = None if self._il is None else self._il.to(indices.device)
            self._noise = None if self._noise is None else self._noise.to(indices.device)
            table = table.to(indices.device)
        return table[indices]

    def _stats(self, indices: torch.Tensor, pos: torch.Tensor,
               loss: torch.Tensor | None) -> dict[str, float]:
        """Selected-vs-candidate statistics (one device sync)."""
        names, vals = ["n_candidates", "n_selected"], [float(indices.numel()), float(pos.numel())]
        il = self._lookup(self._il, indices)
        noise = self._lookup(self._noise, indices)
        series = {"loss": loss, "il": il,
                  "reducible": (loss - il) if loss is not None and il is not None else None}
        for name, t in series.items():
            if t is not None:
                names += [f"cand_{name}_mean", f"sel_{name}_mean"]
                vals += [t.float().mean(), t[pos].float().mean()]
        if noise is not None:
            names += ["cand_noisy", "sel_noisy"]
            vals += [noise.float().sum(), noise[pos].float().sum()]
        out = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=indices.device)
                           for v in vals]).tolist()
        return dict(zip(names, out))

    def observe(self, indices: torch.Tensor, losses: torch.Tensor) -> None:
        """Per-sample losses of the trained samples after the step (default: ignored)."""

    def state_dict(self) -> dict:
        """What a resumed run needs to select as the uninterrupted one would (tensors and plain
        values only: checkpoints load with ``weights_only=True``)."""
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


class TopKSelector(_Base):
    """``loss`` / ``rho_loss``: the n_b candidates with the highest (reducible) loss."""

    def __call__(self, model, images, labels, indices) -> SelectedBatch:
        n = self._n(images.shape[0])
        loss = candidate_losses(model, images, labels, self.config.score_mode,
                                self.config.score_chunk, self.config.label_noise)
        _check_finite(loss, "candidate training losses", indices)
        il = self._lookup(self._il, indices)
        pos = select_top(selection_scores(self.config.method, loss, il), n)
        return SelectedBatch(images[pos], labels[pos], indices[pos], None,
                             self._stats(indices, pos, loss))


class UniformSelector(_Base):
    """A random n_b of the candidates: the control (no scoring pass)."""

    def __call__(self, model, images, labels, indices) -> SelectedBatch:
        n = self._n(images.shape[0])
        pos = torch.randperm(images.shape[0], generator=self.generator)[:n].to(images.device)
        return SelectedBatch(images[pos], labels[pos], indices[pos], None,
                             self._stats(indices, pos, None))


class SelectiveBackpropSelector(_Base):
    """Keep candidates with probability percentile(loss)**beta among recent losses; emit
    exactly n_b per call from a queue of kept samples (oldest first)."""

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
        self.history = torch.cat([self.history, loss])[-self.config.history_size:]
        ranked = torch.sort(self.history).values
        pct = torch.searchsorted(ranked, loss, right=True).float() / ranked.numel()
        return pct.pow(self.config.beta).clamp(min=self.config.min_keep_prob)

    def __call__(self, model, images, labels, indices) -> SelectedBatch:
        n = self._n(images.shape[0])
        loss = candidate_losses(model, images, labels, self.config.score_mode,
                                self.config.score_chunk, self.config.label_noise)
        _check_finite(loss, "candidate training losses", indices)
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


class ImportanceSampler:
    """Loss-proportional sampling with smoothing: p_i = (1-s) L_i / sum L + s / N.

    Unseen samples use the mean of seen estimates (1.0 before any), so new data is not starved.
    ``weights(idx) = 1 / (N p_i)`` makes E_{i~p}[w_i L_i] equal the mean loss (unbiased).
    Iterating it (``as_sampler``) yields indices for a DataLoader; probabilities are refreshed
    from the estimates on each ``update``. Weights use the probabilities current when the batch
    is selected; with a prefetching loader they may be a step or two newer than those the batch
    was drawn with (exact in a plain loop that calls ``sample`` itself).
    """

    def __init__(self, num_samples: int, smoothing: float = 0.1, momentum: float = 0.0,
                 seed: int = 0):
        if num_samples < 1:
            raise SelectionError("importance sampling needs a non-empty split")
        self.n = num_samples
        self.smoothing = smoothing
        self.momentum = momentum
        self.estimates = np.zeros(num_samples, dtype=np.float64)
        self.seen = np.zeros(num_samples, dtype=bool)
        self.rng = np.random.default_rng(seed)
        self._p = np.full(num_samples, 1.0 / num_samples)

    def refresh(self) -> None:
        est = self.estimates.copy()
        fill = est[self.seen].mean() if self.seen.any() else 1.0
        est[~self.seen] = fill
        total = est.sum()
        base = est / total if total > 0 else np.full(self.n, 1.0 / self.n)
        self._p = (1 - self.smoothing) * base + self.smoothing / self.n

    def probabilities(self) -> np.ndarray:
        return self._p

    def weights(self, indices: np.ndarray) -> np.ndarray:
        return 1.0 / (self.n * self._p[np.asarray(indices)])

    def update(self, indices: np.ndarray, losses: np.ndarray) -> None:
        idx, losses = np.asarray(indices, dtype=np.int64), np.asarray(losses, dtype=np.float64)
        if not np.isfinite(losses).all():
            raise SelectionError("importance sampling got NaN/inf losses to observe")
        if (losses < 0).any():
            raise SelectionError("importance sampling needs non-negative losses")
        old = np.where(self.seen[idx], self.estimates[idx], losses)
        self.estimates[idx] = self.momentum * old + (1 - self.momentum) * losses
        self.seen[idx] = True
        self.refresh()

    def state_dict(self) -> dict:
        return {"estimates": torch.from_numpy(self.estimates.copy()),
                "seen": torch.from_numpy(self.seen.copy()), "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        if state["estimates"].numel() != self.n:
            raise SelectionError(f"importance state is for {state['estimates'].numel()} samples, "
                                 f"this split has {self.n}")
        self.estimates = state["estimates"].numpy().astype(np.float64)
        self.seen = state["seen"].numpy().astype(bool)
        self.rng.bit_generator.state = state["rng"]
        self.refresh()

    def sample(self, k: int) -> np.ndarray:
        """``k`` indices drawn with replacement from the current probabilities."""
        return self.rng.choice(self.n, size=k, replace=True, p=self._p)

    def as_sampler(self, batch_size: int, num_batches: int) -> torch.utils.data.Sampler:
        """A DataLoader sampler drawing ``num_batches * batch_size`` indices, batch by batch,
        from the probabilities current at each draw."""
        parent = self

        class _S(torch.utils.data.Sampler):
            def __len__(self) -> int:
                return batch_size * num_batches

            def __iter__(self):
                for _ in range(num_batches):
                    yield from parent.sample(batch_size).tolist()
        return _S()


class ImportanceSelector(_Base):
    """Importance-sampled batches with unbiased weights, in one of two ways (``importance_draw``):

    * ``sampler``: the batch was drawn from ``self.sampler`` (p over the split); it passes
      through with weights ``1/(N p_i)``.
    * ``candidates``: the batch is a *uniform* candidate batch of n_B from any loader (the
      training stage's shuffled shards); ``n_b`` of them are redrawn with replacement in
      proportion to p restricted to the batch (``q_i = p_i / sum_batch p``) and weighted
      ``1/(n_B q_i)``: unbiased for the candidate mean, hence for the split's mean
      (Katharopoulos & Fleuret 2018's presampling). No scoring pass: p comes from estimates.
    """

    def __init__(self, config: SelectionConfig, sampler: ImportanceSampler, n_select: int | None,
                 il: torch.Tensor | None, noise_mask: torch.Tensor | None):
        super().__init__(config, n_select, il, noise_mask)
        self.sampler = sampler

    def __call__(self, model, images, labels, indices) -> SelectedBatch:
        idx = _check_indices(indices.detach().cpu(), self.sampler.n).numpy()
        cand = indices
        if self.config.importance_draw == "candidates":
            p = self.sampler.probabilities()[idx]
            q = torch.as_tensor(p / p.sum(), dtype=torch.float64)
            pick = torch.multinomial(q, self._n(len(idx)), replacement=True, generator=self.generator)
            w = (1.0 / (len(idx) * q[pick])).to(torch.float32)
            pos = pick.to(images.device)
            images, labels, indices = images[pos], labels[pos], indices[pos]
            w = w.to(images.device)
        else:
            w = torch.as_tensor(self.sampler.weights(idx), dtype=torch.float32, device=images.device)
            pos = torch.arange(images.shape[0], device=images.device)
        stats = self._stats(cand, pos, None)
        stats.update(weight_mean=float(w.mean()), weight_max=float(w.max()))
        return SelectedBatch(images, labels, indices, w, stats)

    def observe(self, indices: torch.Tensor, losses: torch.Tensor) -> None:
        indices, losses = _all_gather(indices.detach()), _all_gather(losses.detach().float())
        self.sampler.update(indices.cpu().numpy(), losses.cpu().numpy())

    def state_dict(self) -> dict:
        return {**super().state_dict(), "sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.sampler.load_state_dict(state["sampler"])


class InfoBatchSelector(_Base):
    """InfoBatch's pruning over a training stage's candidate batches (no scoring pass).

    ``observe`` keeps every sample's latest training loss (all-gathered, so every rank holds the
    same table). At each step ``n_drop = round(prune * f * n_B)`` candidates are dropped, where
    ``f`` is the share of the split whose loss is known and below the mean: the same count on
    every rank, so DDP ranks do equal work (a rank with too few below-mean candidates prunes
    fewer; one of them always stays). They are drawn uniformly from this rank's
    below-mean candidates, and the ones kept get ``1 / (1 - dropped/eligible)``; weights are
    scaled by ``n_kept / n_B`` so ``(loss * w).mean()`` is unbiased for the mean loss of the
    whole candidate batch (the LR schedule keeps its meaning). Samples never trained are never
    pruned. After ``anneal`` of training (``set_progress``) every candidate is trained. The
    table travels in the training checkpoint (``state_dict``), so a resumed run prunes on.
    """

    def __init__(self, config: SelectionConfig, split_size: int, il: torch.Tensor | None,
                 noise_mask: torch.Tensor | None):
        super().__init__(config, None, il, noise_mask)
        self.n = split_size
        self.loss = torch.zeros(split_size, dtype=torch.float32)
        self.seen = torch.zeros(split_size, dtype=torch.bool)
        self.progress = 0.0
        self._mean, self._below = math.inf, 0.0  # recomputed after each observe

    def set_progress(self, fraction: float) -> None:
        self.progress = float(fraction)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "loss": self.loss.clone(), "seen": self.seen.clone()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if state["loss"].numel() != self.n:
            raise SelectionError(f"infobatch state is for {state['loss'].numel()} samples, this "
                                 f"split has {self.n}")
        self.loss, self.seen = state["loss"].clone(), state["seen"].clone()
        self._refresh()

    def __call__(self, model, images, labels, indices) -> SelectedBatch:
        n_cand = images.shape[0]
        if n_cand < 1:
            raise SelectionError("candidate batch is empty")
        idx = _check_indices(indices.detach().cpu(), self.n)
        pruning = self.progress < self.config.anneal and self.config.prune > 0
        eligible = (self.seen[idx] & (self.loss[idx] < self._mean)).nonzero().squeeze(1)
        # at least one eligible sample stays, so its weight (1 / keep rate) is finite
        n_drop = min(round(self.config.prune * self._below * n_cand),
                     max(0, eligible.numel() - 1)) if pruning else 0
        keep = torch.ones(n_cand, dtype=torch.bool)
        w = torch.ones(n_cand, dtype=torch.float32)
        if n_drop:
            drop = eligible[torch.randperm(eligible.numel(), generator=self.generator)[:n_drop]]
            keep[drop] = False
            w[eligible] = eligible.numel() / (eligible.numel() - n_drop)
        pos = keep.nonzero().squeeze(1)
        w = w[pos] * (pos.numel() / n_cand)
        dev_pos = pos.to(images.device)
        stats = self._stats(indices, dev_pos, None)
        stats.update(ib_pruned=float(n_drop), ib_eligible=float(eligible.numel()),
                     ib_mean_loss=self._mean if math.isfinite(self._mean) else 0.0)
        return SelectedBatch(images[dev_pos], labels[dev_pos], indices[dev_pos],
                             w.to(images.device) if n_drop else None, stats)

    def observe(self, indices: torch.Tensor, losses: torch.Tensor) -> None:
        indices = _all_gather(indices.detach(), ragged=True)
        losses = _all_gather(losses.detach().float(), ragged=True)
        idx, val = indices.cpu(), losses.cpu()
        if not torch.isfinite(val).all():
            raise SelectionError("infobatch got NaN/inf losses to observe")
        self.loss[idx] = val
        self.seen[idx] = True
        self._refresh()

    def _refresh(self) -> None:
        known = self.loss[self.seen]
        if not known.numel():
            self._mean, self._below = math.inf, 0.0
            return
        self._mean = float(known.mean())
        self._below = float((known < self._mean).sum()) / self.n


def _check_indices(idx: torch.Tensor, n: int) -> torch.Tensor:
    """``idx`` (CPU) when every index lies in a split of ``n`` samples, else a clear error."""
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise SelectionError(f"sample index {int(idx.max())} outside the split of {n} samples")
    return idx


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _all_gather(t: torch.Tensor, ragged: bool = False) -> torch.Tensor:
    """Concatenate the 1-D ``t`` from every rank. Sizes must be equal unless ``ragged`` (one more
    small collective for the sizes; InfoBatch ranks can prune a few samples fewer)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t
    world = dist.get_world_size()
    t = t.contiguous()
    if not ragged:
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t)
        return torch.cat(parts)
    sizes = [torch.zeros(1, dtype=torch.int64, device=t.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([t.numel()], dtype=torch.int64, device=t.device))
    most = max(int(n) for n in sizes)
    padded = torch.cat([t, t.new_zeros(most - t.numel())])
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([part[:int(n)] for part, n in zip(parts, sizes)])


# ---------------------------------------------------------------- factory

def _as_table(values, what: str, length: int | None, dtype=torch.float32,
              device: str | torch.device | None = None) -> torch.Tensor | None:
    if values is None:
        return None
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise SelectionError(f"{what} must be 1-D, one value per sample; got shape {arr.shape}")
    if length is not None and arr.shape[0] != length:
        raise SelectionError(f"{what} has {arr.shape[0]} values but the split has {length} samples")
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise SelectionError(f"{what} contains NaN/inf (first at index "
                             f"{int(np.flatnonzero(~np.isfinite(arr))[0])})")
    return torch.as_tensor(arr.astype(np.float32 if dtype == torch.float32 else bool),
                           device=device)


def build_selector(config: SelectionConfig, il_scores: np.ndarray | Scores | None = None, *,
                   candidate_size: int | None = None, split_size: int | None = None,
                   dataset_fingerprint: str | None = None, noise_mask: np.ndarray | None = None,
                   sampler: ImportanceSampler | None = None,
                   device: str | torch.device | None = None):
    """The selector for ``config`` (None for method ``none``), checked before training starts.

    ``candidate_size`` (n_B) fixes n_b and checks 1 <= n_b <= n_B now; ``split_size`` and
    ``dataset_fingerprint`` check the IL scores belong to this split; ``noise_mask`` (bool per
    sample, known label noise) adds noisy-selection stats. ``importance`` needs ``split_size``
    (or a ``sampler``); its ``selector.sampler`` is what the loader should draw indices from.
    """
    if config.method == "none":
        return None
    n_b = config.n_select_for(candidate_size) if candidate_size is not None else None
    if config.method == "infobatch" and split_size is None:
        raise SelectionError("infobatch keeps a loss per sample: it needs split_size")
    if config.label_noise == "auto":
        acc = il_scores.extra.get("holdout_accuracy") if isinstance(il_scores, Scores) else None
        if acc is None:
            raise SelectionError("label_noise='auto' reads the noise rate off the IL model's "
                                 "holdout accuracy: pass the IL Scores record (not a bare array) "
                                 "or give label_noise a number")
        config = config.model_copy(update={"label_noise": round(max(0.0, 1.0 - acc), 4)})
    if isinstance(il_scores, Scores):
        try:
            check_scores(il_scores, fingerprint=dataset_fingerprint, length=split_size)
        except ScoresError as e:
            raise SelectionError(str(e)) from None
        il_scores = il_scores.values
    if config.method == "rho_loss" and il_scores is None:
        raise SelectionError("rho_loss needs irreducible-loss scores: compute them with "
                             "compute_irreducible_loss(...) and pass il_scores=")
    length = split_size if split_size is not None else (
        len(il_scores) if il_scores is not None else None)
    il = _as_table(il_scores, "irreducible-loss scores", length, device=device)
    noise = _as_table(noise_mask, "noise mask", length, dtype=torch.bool, device=device)
    if config.method == "importance":
        if sampler is None:
            if length is None:
                raise SelectionError("importance sampling needs split_size (or a sampler)")
            sampler = ImportanceSampler(length, config.smoothing, config.estimate_momentum,
                                        config.seed + _rank())  # ranks draw different indices
        n = n_b if config.importance_draw == "candidates" else None
        return ImportanceSelector(config, sampler, n, il, noise)
    if config.method == "infobatch":
        return InfoBatchSelector(config, split_size, il, noise)
    cls = {"uniform": UniformSelector, "loss": TopKSelector, "rho_loss": TopKSelector,
           "selective_backprop": SelectiveBackpropSelector}[config.method]
    return cls(config, n_b, il, noise)


# ---------------------------------------------------------------- label noise

@dataclass(frozen=True)
class LabelNoise:
    """Labels after injection, and exactly which indices were flipped (sorted)."""
    labels: np.ndarray
    flipped: np.ndarray
    fraction: float
    seed: int
    num_classes: int

    @property
    def mask(self) -> np.ndarray:
        m = np.zeros(len(self.labels), dtype=bool)
        m[self.flipped] = True
        return m

    def record(self) -> dict:
        """JSON-ready record of the injection (to store beside an experiment's results)."""
        return {"fraction": self.fraction, "seed": self.seed, "num_classes": self.num_classes,
                "flipped": self.flipped.tolist()}


def inject_label_noise(labels: np.ndarray, fraction: float, num_classes: int,
                       seed: int = 0) -> LabelNoise:
    """Flip ``round(fraction * N)`` labels, chosen by ``seed``, each to a different class drawn
    uniformly; the same (labels, fraction, seed) always flips the same indices the same way."""
    y = np.asarray(labels).astype(np.int64)
    if not 0.0 <= fraction < 1.0:
        raise SelectionError(f"noise fraction must be in [0, 1), got {fraction}")
    if num_classes < 2:
        raise SelectionError("label noise needs at least 2 classes")
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise SelectionError(f"labels must lie in [0, {num_classes})")
    rng = np.random.default_rng(seed)
    k = int(round(fraction * y.size))
    flipped = np.sort(rng.choice(y.size, size=k, replace=False))
    shift = rng.integers(1, num_classes, size=k)  # never 0: the new class always differs
    out = y.copy()
    out[flipped] = (y[flipped] + shift) % num_classes
    return LabelNoise(out, flipped, fraction, seed, num_classes)


def n_select(config: SelectionConfig, candidate_size: int) -> int:
    """n_b for ``candidate_size`` (public helper for loaders sizing candidate batches)."""
    return config.n_select_for(candidate_size)


def candidate_size_for(config: SelectionConfig, train_batch: int) -> int:
    """n_B so that ``ratio * n_B`` trains ``train_batch`` samples per step."""
    return max(train_batch, int(math.ceil(train_batch / config.ratio)))
