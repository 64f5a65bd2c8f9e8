"""What one rank runs, top to bottom — the shape of torchtitan's ``train.py``.

``run_rank(job, out)`` is the rank: set its device before anything allocates, join the process
group (several ranks), re-cut the job for this world size (a checkpoint of another world size),
build the data and the selector from the job's specs on that device, then ``train``: the model
and its components, the run's state, the checkpoint it resumes from, the loop of
``step.train_step`` with its logs, evaluations and saves, and the result. ``launch`` runs
``run_rank`` in-process for one rank; under torchrun each worker runs
``python -m sluice.stages.train.rank --job job.json`` (``worker``), and rank 0 writes
``result.json``.

``train(config, loader, eval_loader, selector)`` is also the entry for a training script of
your own: any loader honouring ``contracts.ResumableLoader`` (batches of ``(images, labels,
indices)``, exact mid-epoch resume), optionally a ``contracts.Selector``; atomic checkpoints from
which a restarted job (``torchrun --max-restarts``) continues exactly. Budgets are optimizer steps
or wall-clock seconds; the learning-rate schedule follows the fraction of the budget used.

A ``SluiceError`` (bad config, bad data, a diverged loss) is written to ``error.json`` and ends
the job for good: a restart would only repeat it. Any other exception is a crash, which
torchrun's ``--max-restarts`` restarts from the last checkpoint.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from pydantic import ValidationError

from sluice.errors import ConfigError, SluiceError, TrainError
from sluice.stages.precision import resolve_amp
from sluice.stages.contracts import ResumableLoader, Selector
from sluice.stages.host import threads_per_rank
from sluice.stages.train.checkpointer import Checkpointer, finite_weights
from sluice.stages.train.components import Components
from sluice.stages.train.config import TrainConfig
from sluice.stages.train.dist import dist_context, init_process_group, place_rank
from sluice.stages.train.elastic import batch_scale_for
from sluice.stages.train.evaluate import evaluate
from sluice.stages.train.faults import device_failure_line, is_device_failure, out_of_memory
from sluice.stages.train.job import TrainJob
from sluice.stages.train.metrics import MetricsLogger, non_finite_error, summarize
from sluice.stages.train.state import RunState, endless_batches
from sluice.stages.train.step import train_step
from sluice.storage.atomic import write_json

FATAL = "error.json"
RESULT = "result.json"
JOB = "job.json"


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


def run_rank(job: TrainJob, out: Path, *, rank: int = 0, local_rank: int = 0, local_world: int = 1,
             wrap_loader: Callable[[ResumableLoader], ResumableLoader] | None = None) -> TrainResult:
    """One rank of ``job``: its device set before anything allocates, the process group joined
    (several ranks), its loaders and selector built from the specs on that device, the loop run.
    What a torchrun worker runs, and what ``launch`` runs in-process for one rank.
    ``wrap_loader`` wraps the train loader (the in-process launch's time limit)."""
    cfg = job.config
    device = place_rank(cfg, local_rank)
    if cfg.torch_threads is None:  # the cores split among this machine's ranks
        torch.set_num_threads(threads_per_rank(local_world))
    init_process_group(cfg)
    world = dist.get_world_size() if dist.is_initialized() else 1
    (out / "pids").mkdir(parents=True, exist_ok=True)
    (out / "pids" / f"rank{rank}.pid").write_text(str(os.getpid()))
    # a checkpoint of another world size: per-rank sizes scaled so the global batch is kept
    scale = batch_scale_for(cfg, world)
    try:
        loader = job.data.build(rank=rank, world_size=world, device=device, batch_scale=scale)
        ev = job.eval_data.build(rank=rank, world_size=world, device=device) if job.eval_data else None
        selector = job.selection.build(scale) if job.selection else None
        return train(cfg, wrap_loader(loader) if wrap_loader else loader, ev, selector, batch_scale=scale)
    except torch.OutOfMemoryError as e:  # a restart would only repeat it: say what to set instead
        raise out_of_memory(e, cfg, rank, device, job.data.batch_size) from None
    except Exception as e:
        if is_device_failure(e):  # a crash (restartable), with the rank, host and device named
            print(device_failure_line(e, rank, device), file=sys.stderr, flush=True)
        raise


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
        raise TrainError("the loader must be a sluice.stages.contracts.ResumableLoader (iteration, len, epoch, "
                         "set_epoch, state_dict, load_state_dict, names, device, report): subclass "
                         f"sluice.stages.load.LoaderBase; got {type(loader).__name__}")
    d = dist_context(cfg)
    if cfg.amp == "auto":  # decided once, by the device this run got
        cfg = cfg.model_copy(update={"amp": resolve_amp(cfg.amp, d.device)})
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    if len(loader) < 1:
        raise TrainError("the train loader yields no batches")
    parts = Components.build(cfg, d)
    if selector is not None:
        if not isinstance(selector, Selector):
            raise TrainError(f"selector {type(selector).__name__} lacks the Selector hooks: subclass "
                             "sluice.stages.contracts.SelectorHooks")
        selector = parts.task.selector_for(selector)  # token rows: infobatch by document, or refused
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


def save(parts: Components, state: RunState, logger: MetricsLogger, checkpointer: Checkpointer) -> None:
    """Write the checkpoint, never with NaN/inf in it: the waiting steps are read first (a
    non-finite loss raises, naming its step) and the weights checked (one more read)."""
    if checkpointer.path is None:
        return
    logger.read(state, checkpointer.path)
    if not finite_weights(parts.model):
        raise non_finite_error(state.step, parts.opt.param_groups[0]["lr"], checkpointer.path, "weights")
    checkpointer.save(state)


def run_eval(parts: Components, state: RunState, eval_loader: ResumableLoader | None,
             logger: MetricsLogger, checkpointer: Checkpointer | None = None) -> dict[str, Any] | None:
    """Evaluate the current (EMA) weights on every rank's shard; record and log the result
    (after reading the waiting steps: a NaN/inf loss raises first)."""
    if eval_loader is None:
        return None
    logger.read(state, checkpointer.path if checkpointer is not None else None)
    parts.sync_buffers()
    e = {"step": state.step, "elapsed_s": state.elapsed, "wall_time": time.time(),
         **evaluate(parts.eval_model(), eval_loader, parts.task, parts.cfg.amp, parts.d,
                    tta=parts.cfg.eval_tta)}
    state.evals.append(e)
    logger.log_eval(e)
    return e


def read_job(path: Path) -> TrainJob:
    try:
        return TrainJob.model_validate_json(path.read_text())
    except ValidationError as e:
        raise ConfigError(f"invalid training job {path}: {e}") from None


def worker(job_path: str) -> int:
    """Run one torchrun rank of the job in ``job_path``; its directory receives the results."""
    out = Path(job_path).parent
    if (out / FATAL).exists():  # a restart after a fatal error would only repeat it
        print(f"[sluice] not restarting: {(out / FATAL).read_text()}", file=sys.stderr)
        return 3
    rank = int(os.environ.get("RANK", 0))
    try:
        result = run_rank(read_job(Path(job_path)), out, rank=rank, local_rank=int(os.environ.get("LOCAL_RANK", 0)),
                          local_world=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        if rank == 0:
            write_json(out / RESULT, result.to_dict())
        if dist.is_initialized():
            # Every rank leaves together: a rank that tears gloo down while a peer still has
            # traffic in flight aborts ("terminate called without an active exception").
            dist.barrier()
        return 0
    except SluiceError as e:
        write_json(out / FATAL, {"type": type(e).__name__, "message": str(e), "rank": rank})
        print(f"[sluice] rank {rank}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Sluice training worker (run under torchrun)")
    ap.add_argument("--job", required=True, help="job.json written by sluice.stages.run.launch")
    return worker(ap.parse_args(argv).job)


if __name__ == "__main__":  # sluice.process_rules, rule 7: run the imported copy, leave by os._exit
    from sluice.process_rules import run_as_imported
    run_as_imported("sluice.stages.train.rank")
