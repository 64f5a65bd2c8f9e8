"""The training loop: one run in-process (one rank) or as one DDP rank under torchrun.

``train(config, loader, eval_loader, selector)`` consumes any loader honouring
``contracts.ResumableLoader`` (batches of ``(images, labels, indices)``, exact mid-epoch resume),
optionally passes each candidate batch through a ``contracts.Selector``, and writes atomic
checkpoints from which a restarted job (``torchrun --max-restarts``) continues exactly. Budgets
are optimizer steps or wall-clock seconds; the learning-rate schedule follows the fraction of
the budget used, so a time-budgeted run still decays to zero. ``sluice.stages.train.worker`` runs
it inside each torchrun process.

The loop only wires the parts (torchtitan's shape): ``parts`` (model, optimizer, scaler, EMA,
comm hook), ``state`` (counters and budget), ``step.train_step``, ``checkpointer`` (save, load,
the world-size re-cut; ``elastic`` says what a resized run sees) and ``metrics`` (records,
logs, summary).
"""
from __future__ import annotations

import dataclasses
import time
from fractions import Fraction
from typing import Any

import torch

from sluice.errors import TrainError
from sluice.stages.compute import resolve_amp
from sluice.stages.contracts import ResumableLoader, Selector
from sluice.stages.train.checkpointer import Checkpointer, finite_weights
from sluice.stages.train.config import TrainConfig
from sluice.stages.train.dist import dist_context
from sluice.stages.train.evaluate import evaluate
from sluice.stages.train.metrics import MetricsLogger, non_finite_error, summarize
from sluice.stages.train.parts import TrainParts, param_digest
from sluice.stages.train.state import RunState, endless_batches
from sluice.stages.train.step import train_step

__all__ = ["TrainResult", "train", "param_digest"]  # param_digest: imported from here before the split


@dataclasses.dataclass
class TrainResult:
    """What a run returns (and what the launcher reads back from rank 0)."""
    metrics: list[dict[str, Any]]  # one record per logged step
    evals: list[dict[str, Any]]  # one record per evaluation
    final_acc: float | None
    checkpoint: str | None
    steps: int
    halted: bool = False  # stopped at ``halt_at_step`` (resumable), not at the budget
    resumed_from: int | None = None
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainResult":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


def train(config: TrainConfig | dict[str, Any], loader: ResumableLoader,
          eval_loader: ResumableLoader | None = None, selector: Selector | None = None,
          batch_scale: Fraction | int = 1) -> TrainResult:
    """Train with ``config`` on ``loader``: one rank in-process, or one DDP rank under torchrun.

    When ``torch.distributed`` is initialised the model is wrapped in DDP over that group.
    ``batch_scale``: what the loaders' per-rank sizes were multiplied by to resume a checkpoint
    of another world size (``elastic.batch_scale_for``; the worker does this).
    Raises ``TrainError`` for bad input and ``NonFiniteLoss`` when the loss diverges.
    """
    cfg = config if isinstance(config, TrainConfig) else TrainConfig.model_validate(config)
    if not isinstance(loader, ResumableLoader):
        raise TrainError("loader must be iterable with __len__, set_epoch, state_dict and "
                         f"load_state_dict; got {type(loader).__name__}")
    d = dist_context(cfg)
    if cfg.amp == "auto":  # decided once, by the device this run got
        cfg = cfg.model_copy(update={"amp": resolve_amp(cfg.amp, d.device)})
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    if len(loader) < 1:
        raise TrainError("the train loader yields no batches")
    parts = TrainParts.build(cfg, d)
    state = RunState.start(cfg, len(loader), d.world)
    checkpointer = Checkpointer(parts, loader, selector, Fraction(batch_scale))
    checkpointer.load(state)
    state.agree_on_clock(d)  # elapsed must agree across ranks for time budgets
    logger = MetricsLogger(cfg, d, state)
    batches = endless_batches(loader, state)
    log_samples = logger.log_samples if cfg.log_samples else None
    clock_matters = d.on and bool(cfg.max_seconds or cfg.checkpoint_every_seconds)
    halted, final = False, None
    parts.model.train()
    try:
        while not state.finished():
            logger.add(train_step(parts, state, batches, selector, log_samples, checkpointer.path))
            if logger.due(state.step):  # the one read of log_every_steps steps (NaN/inf found here)
                logger.read(state, checkpointer.path, count_wait=True)
            if clock_matters:  # time-based decisions must agree across ranks: rank 0's clock
                state.agree_on_clock(d)
            logger.write_due(state)
            if cfg.eval_every_steps and state.step % cfg.eval_every_steps == 0 and not state.finished():
                run_eval(parts, state, eval_loader, logger, checkpointer)
            if cfg.halt_at_step and state.step >= cfg.halt_at_step and not state.finished():
                save(parts, state, logger, checkpointer)
                halted = True
                break
            if checkpointer.due(state) and not state.finished():
                save(parts, state, logger, checkpointer)
        logger.read(state, checkpointer.path)  # the end of the run reads what waits
        if not halted:
            final = run_eval(parts, state, eval_loader, logger, checkpointer)
            save(parts, state, logger, checkpointer)
    finally:
        logger.close()
    written = checkpointer.written()
    return TrainResult(metrics=logger.records, evals=state.evals,
                       final_acc=final["acc"] if final else None,
                       checkpoint=str(written) if written else None, steps=state.step,
                       halted=halted, resumed_from=state.resumed_from,
                       summary=summarize(parts, state, logger.records, loader, halted))


def save(parts: TrainParts, state: RunState, logger: MetricsLogger, checkpointer: Checkpointer) -> None:
    """Write the checkpoint, never with NaN/inf in it: the waiting steps are read first (a
    non-finite loss raises, naming its step) and the weights checked (one more read)."""
    if checkpointer.path is None:
        return
    logger.read(state, checkpointer.path)
    if not finite_weights(parts.model):
        raise non_finite_error(state.step, parts.opt.param_groups[0]["lr"], checkpointer.path, "weights")
    checkpointer.save(state)


def run_eval(parts: TrainParts, state: RunState, eval_loader: ResumableLoader | None,
             logger: MetricsLogger, checkpointer: Checkpointer | None = None) -> dict[str, Any] | None:
    """Evaluate the current (EMA) weights on every rank's shard; record and log the result
    (after reading the waiting steps: a NaN/inf loss raises first)."""
    if eval_loader is None:
        return None
    logger.read(state, checkpointer.path if checkpointer is not None else None)
    parts.sync_buffers()
    e = {"step": state.step, "elapsed_s": state.elapsed, "wall_time": time.time(),
         **evaluate(parts.eval_model(), eval_loader, parts.prep, parts.cfg.amp, parts.d,
                    tta=parts.cfg.eval_tta)}
    state.evals.append(e)
    logger.log_eval(e)
    return e
