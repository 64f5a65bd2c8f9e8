"""``importance`` (Katharopoulos & Fleuret 2018): per-sample loss estimates give sampling
probabilities (smoothed toward uniform); ``ImportanceSampler`` draws the loader's indices and the
selector attaches weights ``1 / (N p_i)`` so the weighted loss is unbiased — or, inside the
training stage, redraws n_b of a uniform candidate batch with weights ``1 / (n_B q_i)``."""
from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from pydantic import Field

from sluice.errors import SelectionError
from sluice.stages.contracts import SelectedBatch
from sluice.stages.select.base import SELECTION_METHODS, BaseSelector, MethodParams, SelectorContext, check_indices
from sluice.stages.select.collectives import all_gather_1d, rank


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


class ImportanceParams(MethodParams):
    smoothing: float = Field(0.1, ge=0, le=1, description="mix of uniform in p")
    estimate_momentum: float = Field(0.0, ge=0, lt=1, description="EMA of loss estimates (0 = latest)")
    importance_draw: Literal["sampler", "candidates"] = Field(
        "sampler", description="'sampler' = batches are drawn from selector.sampler (a plain loop), "
        "weights 1/(N p); 'candidates' = any loader's uniform candidate batch of n_B, n_b of them "
        "redrawn in proportion to p, weights 1/(n_B q) (the training stage)")


@SELECTION_METHODS.register("importance")
class ImportanceSelector(BaseSelector):
    """Importance-sampled batches with unbiased weights, in one of two ways (``importance_draw``):

    * ``sampler``: the batch was drawn from ``self.sampler`` (p over the split); it passes
      through with weights ``1/(N p_i)``.
    * ``candidates``: the batch is a *uniform* candidate batch of n_B from any loader (the
      training stage's shuffled shards); ``n_b`` of them are redrawn with replacement in
      proportion to p restricted to the batch (``q_i = p_i / sum_batch p``) and weighted
      ``1/(n_B q_i)``: unbiased for the candidate mean, hence for the split's mean
      (Katharopoulos & Fleuret 2018's presampling). No scoring pass: p comes from estimates.
    """
    Params = ImportanceParams

    def __init__(self, config, ctx: SelectorContext):
        super().__init__(config, ctx)
        self.sampler: ImportanceSampler = ctx.sampler

    @classmethod
    def build(cls, config, ctx: SelectorContext) -> "ImportanceSelector":
        if ctx.sampler is None:
            if ctx.split_size is None:
                raise SelectionError("importance sampling needs split_size (or a sampler)")
            params = config.method_params
            ctx.sampler = ImportanceSampler(ctx.split_size, params.smoothing, params.estimate_momentum,
                                            config.seed + rank())  # ranks draw different indices
        if config.method_params.importance_draw != "candidates":
            ctx.n_select = None  # the batch drawn from the sampler passes through whole
        return cls(config, ctx)

    @classmethod
    def for_training_stage(cls, config):
        return config.model_copy(update={"params": {**config.params, "importance_draw": "candidates"}})

    def __call__(self, model, images, labels, indices) -> SelectedBatch:
        idx = check_indices(indices.detach().cpu(), self.sampler.n).numpy()
        cand = indices
        if self.params.importance_draw == "candidates":
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
        stats.update(weight_mean=w.mean(), weight_max=w.max())
        return SelectedBatch(images, labels, indices, w, stats)

    def observe(self, indices: torch.Tensor, losses: torch.Tensor) -> None:
        """Every rank's losses into the estimates (read on the host: the sampler draws there);
        NaN/inf losses leave their samples' estimates as they were."""
        indices, losses = all_gather_1d(indices.detach()), all_gather_1d(losses.detach().float())
        indices, losses = indices.cpu().numpy(), losses.cpu().numpy()
        finite = np.isfinite(losses)
        self.sampler.update(indices[finite], losses[finite])

    def state_dict(self) -> dict:
        return {**super().state_dict(), "sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.sampler.load_state_dict(state["sampler"])
