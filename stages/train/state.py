"""Where a run stands (step, epoch, clock) and the budget it is measured against.

The budget is counted in steps of the starting global batch (``budget_used``): a run resumed at another
world size adds ``Resize.step_weight`` per step, so the schedule, which follows ``progress``,
keeps its meaning in samples. The checkpointer saves and restores this state with the weights.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator

import torch.distributed as dist

from sluice.stages.contracts import ResumableLoader
from sluice.stages.train.config import TrainConfig
from sluice.stages.train.dist import DistContext
from sluice.stages.train.elastic import Resize
from sluice.stages.train.schedule import lr_at


def budget_steps(cfg: TrainConfig, n_batches: int) -> int | None:
    """The step budget: ``max_steps``, none for a time-only budget, else ``epochs`` of batches."""
    if cfg.max_steps:
        return cfg.max_steps
    if cfg.max_seconds:
        return None
    return max(1, math.ceil(cfg.epochs * n_batches / cfg.accum_steps))


def reference_lr_scale(cfg: TrainConfig, world: int) -> float:
    """lr_reference_batch's factor for the global batch of a run started on ``world`` ranks."""
    global_batch = cfg.batch_size * world * cfg.accum_steps
    return global_batch / cfg.lr_reference_batch if cfg.lr_reference_batch else 1.0


@dataclasses.dataclass
class RunState:
    """The counters a resumed run must continue from, and the budget they are checked against."""
    cfg: TrainConfig
    total_steps: int | None
    lr_scale: float
    resize: Resize
    budget_used: float = 0.0  # budget used, in steps of the starting global batch
    step: int = 0
    epoch: int = 0
    elapsed: float = 0.0
    resumed_from: int | None = None
    evals: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    skipped: int = 0  # fp16: consecutive non-finite steps the scaler skipped (not checkpointed)
    scaler_skips: int = 0  # fp16: optimizer steps the GradScaler skipped, this process

    @classmethod
    def start(cls, cfg: TrainConfig, n_batches: int, world: int) -> "RunState":
        return cls(cfg, budget_steps(cfg, n_batches), reference_lr_scale(cfg, world),
                   Resize.fresh(world))

    # -- budget ------------------------------------------------------------------------------
    def progress(self) -> float:
        """Fraction of the budget used (steps or seconds, whichever is further along)."""
        p = 0.0
        if self.total_steps:
            p = self.budget_used / self.total_steps
        if self.cfg.max_seconds:
            p = max(p, self.elapsed / self.cfg.max_seconds)
        return p

    def lr(self) -> float:
        return lr_at(self.cfg, self.progress(), self.total_steps) * self.lr_scale

    def steps_done(self) -> bool:
        return bool(self.total_steps and self.budget_used >= self.total_steps - 1e-9)

    def finished(self) -> bool:
        return self.steps_done() or bool(self.cfg.max_seconds and self.elapsed >= self.cfg.max_seconds)

    def stopped_by(self, halted: bool) -> str:
        """Why the run ended: ``halt_at_step``, its step budget, or ``max_seconds``."""
        if halted:
            return "halt_at_step"
        return "steps" if self.steps_done() else "max_seconds"

    # -- progress ----------------------------------------------------------------------------
    def advance(self, seconds: float) -> None:
        """One optimizer step taken in ``seconds``."""
        self.step += 1
        self.budget_used += self.resize.step_weight
        self.elapsed += seconds

    def agree_on_clock(self, d: DistContext) -> float:
        """Take rank 0's ``elapsed`` (collective): time-based decisions must agree across ranks."""
        if d.on:
            t = d.tensor([self.elapsed])
            dist.broadcast(t, 0)
            self.elapsed = t.item()
        return self.elapsed

    # -- checkpoint --------------------------------------------------------------------------
    def elastic_record(self) -> dict[str, Any]:
        return self.resize.record(self.total_steps, self.budget_used)

    def restore(self, s: dict[str, Any]) -> None:
        """Continue from checkpoint ``s`` (its step, epoch, clock, budget and evaluations)."""
        self.step, self.epoch, self.elapsed = s["step"], s["epoch"], s["elapsed"]
        e = s.get("elastic") or {}
        self.total_steps = e.get("total_steps", self.total_steps)
        self.budget_used = float(e.get("units", self.step))
        self.resumed_from = self.step
        self.evals = list(s.get("evals", []))


def endless_batches(loader: ResumableLoader, state: RunState) -> Iterator[Any]:
    """Batches across epochs, starting where the loader's state says (a resumed epoch continues,
    a finished one moves on); ``state.epoch`` is the epoch each batch comes from."""
    while True:
        for batch in loader:
            state.epoch = loader.epoch
            yield batch
        loader.set_epoch(loader.epoch + 1)
