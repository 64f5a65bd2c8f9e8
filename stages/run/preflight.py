"""The pre-flight check: the config, the data and the model together, on one batch, before any
rank starts. A model that cannot take the data's input shape, logits of the wrong size for the
task, a label the loss cannot take or non-finite outputs fail here, once, naming the model, the
shapes and the setting to change, instead of in every rank (and again in the flow's retry).

It builds the model as a rank does (seeded from ``train.seed``, the starting weights of
``train.init_from`` loaded, channels-last where set), takes one batch from the job's train spec
and one from its eval spec on the CPU, and runs ``rows`` of each through the model in eval mode
(BatchNorm statistics untouched; the model is thrown away) and through the task's own loss
(``stages/train/tasks.TASKS``); every target of both batches goes through that loss too (on
logits of zeros), so a label the model has no output for is caught whichever row holds it. The
same code for every kind of data. What it does not run: ``torch.compile``, DDP, mixed precision
and the selector (each decided per rank; none changes a shape). The process's random state is
left as it was.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from sluice.errors import PreflightError, SluiceError
from sluice.stages.load.specs import DataSpec
from sluice.stages.models import build_model
from sluice.stages.pixels import channels_last
from sluice.stages.run.launch import as_job
from sluice.stages.train.config import TrainConfig
from sluice.stages.train.initial_weights import load_initial_weights
from sluice.stages.train.job import TrainJob
from sluice.stages.train.tasks import Task, build_task

CPU = torch.device("cpu")
ROWS = 2  # samples (rows) of each batch run through the model: a shape check, not a benchmark
TARGET_CHECK = 1 << 22  # logits of zeros the targets check holds at once (16 MiB)
# What a failure on one batch may be besides a misfit: never turned into a PreflightError, so the
# flow's retry still sees a lack of memory as what it is.
NOT_A_MISFIT = (MemoryError, torch.OutOfMemoryError)


@dataclasses.dataclass(frozen=True)
class PreflightReport:
    """What the pre-flight checked, on which batches, and how long it took."""
    model: str
    task: str
    batches: dict[str, dict[str, Any]]  # split -> {"inputs": {name: shape}, "targets", "logits", "rows"}
    checked: tuple[str, ...]
    seconds: float

    def line(self) -> str:
        """One line for the log and the report."""
        seen = "; ".join(f"{split} {_shapes(b['inputs'])} -> logits {list(b['logits'])}"
                         for split, b in self.batches.items())
        return (f"{self.model} ({self.task}) took one batch of each split: {seen}; checked "
                f"{', '.join(self.checked)} in {1000 * self.seconds:.0f} ms")

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "checked": list(self.checked), "line": self.line()}


def preflight(job: TrainJob, data_settings: str = "the data section's settings that shape a batch",
              rows: int = ROWS) -> PreflightReport:
    """Check that ``job``'s model takes its data: one batch of the train spec and one of the
    eval spec, on the CPU, through the model and the task's loss. Raises ``PreflightError``
    (a ``ConfigError``) naming the model, the shapes and the settings to change (the kind's
    ``data_settings``), chained from the error underneath; returns what was checked."""
    t0 = time.perf_counter()
    job = as_job(job)  # complete, as the ranks get it (an arrays spec takes the job's normalisation)
    cfg = job.config
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        model = _model(cfg)
        task = build_task(cfg, CPU)
        batches = {split: _check(model, task, cfg, split, spec, data_settings, rows)
                   for split, spec in (("train", job.data), ("eval", job.eval_data)) if spec is not None}
    checked = ["the model builds" + (" and loads train.init_from" if cfg.init_from else ""),
               "the task's loss takes every target", "the model takes each batch's inputs",
               f"logits of {cfg.num_classes} per target", "finite outputs and losses"]
    return PreflightReport(cfg.model, task.name, batches, tuple(checked), time.perf_counter() - t0)


def _model(cfg: TrainConfig) -> torch.nn.Module:
    """The model as ``Components.build`` makes it on a rank (seed, weights, memory format), in
    eval mode."""
    torch.manual_seed(cfg.seed)
    try:
        model = build_model(cfg.model, cfg.in_channels, cfg.num_classes, **cfg.model_kwargs)
    except (SluiceError, *NOT_A_MISFIT):
        raise
    except Exception as e:  # noqa: BLE001 - a factory's own error (an unknown keyword, a bad size)
        raise PreflightError(f"train.model={cfg.model!r} cannot be built with in_channels={cfg.in_channels}, "
                             f"num_classes={cfg.num_classes} and train.model_kwargs={cfg.model_kwargs}: "
                             f"{type(e).__name__}: {e}. Change train.model_kwargs (or train.model)") from e
    if cfg.init_from:  # a checkpoint of another architecture is a CheckpointMismatch, as on a rank
        load_initial_weights(model, cfg.init_from, cfg.model_dump())
    if cfg.channels_last:
        model = channels_last(model)
    return model.eval()


def _check(model: torch.nn.Module, task: Task, cfg: TrainConfig, split: str, spec: DataSpec,
           data_settings: str, rows: int) -> dict[str, Any]:
    """One batch of ``spec`` through ``model`` and ``task``'s loss; what it saw."""
    batch = _first_batch(spec, split)
    inputs = {name: list(t.shape) for name, t in batch.inputs.items()}
    what = f"the {split} batch ({_shapes(inputs)}, targets {list(batch.targets.shape)})"
    model_is = (f"train.model={cfg.model!r} (built for in_channels={cfg.in_channels}, num_classes={cfg.num_classes}"
                + (f", train.model_kwargs={cfg.model_kwargs})" if cfg.model_kwargs else ")"))
    with _misfit(f"{model_is} cannot read {what}", "Check the data section's loader settings"):
        x, y, _ = task.prep(batch)
    with _misfit(f"the {task.name} loss cannot take {what} with {cfg.num_classes} outputs: its targets are "
                 f"{_span(y)}", f"Check the data's labels against its {cfg.num_classes} classes "
                 "(train.num_classes comes from the dataset version: prepare it again after relabelling)"):
        _every_target(task, y, cfg.num_classes)
    x, y = x[:rows], y[:rows]
    with _misfit(f"{model_is} cannot take {what}",
                 f"Change train.model (or train.model_kwargs) to a model that takes inputs of this shape, "
                 f"or {data_settings} to a shape this model takes"):
        out = model(x)
    logits = list(out.shape)
    if logits[:-1] != list(y.shape) or logits[-1] != cfg.num_classes:
        raise PreflightError(f"{model_is} gives logits {logits} for {len(y)} rows of {what}; the {task.name} task "
                             f"needs {list(y.shape) + [cfg.num_classes]} (num_classes={cfg.num_classes} per target, "
                             "from the dataset version). Change train.model (or train.model_kwargs)")
    with _misfit(f"the {task.name} loss cannot take the logits of {model_is} on {what}",
                 "Change train.model (or train.model_kwargs)"):
        loss = task.per_sample(out, y, cfg.label_smoothing)
    if not (torch.isfinite(out).all() and torch.isfinite(loss).all()):
        bad_input = any(t.is_floating_point() and not torch.isfinite(t).all() for t in batch.inputs.values())
        raise PreflightError(f"{model_is} gives non-finite outputs or losses on {what}: "
                             + ("the inputs themselves hold NaN/inf; check the data and train.normalize_std"
                                if bad_input else "the starting weights (train.init_from) or the model's "
                                "initialisation give them; change train.model or start from scratch (warm.init)"))
    return {"inputs": inputs, "targets": list(batch.targets.shape), "logits": logits, "rows": len(y)}


def _every_target(task: Task, targets: torch.Tensor, classes: int) -> None:
    """Every target of the batch through the task's own loss, on logits of zeros (a label the
    model has no output for raises there), in pieces of at most ``TARGET_CHECK`` logits."""
    per_row = max(1, targets[0].numel() * classes) if len(targets) else 1
    step = max(1, TARGET_CHECK // per_row)
    for i in range(0, len(targets), step):
        part = targets[i:i + step]
        task.per_sample(torch.zeros(*part.shape, classes), part)


def _first_batch(spec: DataSpec, split: str) -> Any:
    """The first batch ``spec`` yields to rank 0 of one (its loader closed after), read the
    cheapest way that gives the same batch (``for_preflight``)."""
    loader = spec.for_preflight().build(rank=0, world_size=1, device=CPU)
    try:
        batch = next(iter(loader), None)
    finally:
        loader.close()
    if batch is None:
        raise PreflightError(f"the {split} data yields no batch of {spec.batch_size} samples per rank: give it more "
                             "samples" + (" or lower train.batch_size" if split == "train" else ""))
    return batch


class _misfit:
    """Any error of the block (a ``SluiceError`` and a lack of memory excepted, which pass as
    they are) as a ``PreflightError``: ``what`` failed, the error, then ``change``."""

    def __init__(self, what: str, change: str):
        self.what, self.change = what, change

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: Any) -> bool:
        if e is None or isinstance(e, NOT_A_MISFIT) or not isinstance(e, Exception):
            return False
        if isinstance(e, PreflightError):
            return False
        first = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else ""
        raise PreflightError(f"{self.what}: {type(e).__name__}: {first}. {self.change}") from e


def _shapes(inputs: dict[str, list[int]]) -> str:
    return ", ".join(f"{name} {shape}" for name, shape in inputs.items())


def _span(y: torch.Tensor) -> str:
    """The range of the targets a loss counts (ignored ones, -100, left out)."""
    counted = y[y >= 0]
    return f"in [{int(counted.min())}, {int(counted.max())}]" if counted.numel() else "all ignored"
