"""One optimizer step: schedule, selection, accumulated forward/backward, the agreement across
ranks, the optimizer (through the GradScaler) and the EMA; it returns the step's metrics record,
unread.

The order of the collectives is fixed (DDP's gradient all-reduce on the last micro-batch, then
one small all-reduce of loss and sample counts): every rank takes the same decisions from the
same numbers, which is what keeps their weights bitwise identical.

A step never waits for the device: loss, non-finite count, samples and selection statistics stay
device tensors, and the loop reads them every ``log_every_steps`` (``metrics.MetricsLogger.read``),
where a NaN/inf loss is found and reported by its step. Selectors observe every step; a
non-finite step's losses reach them as NaN, which they drop on the device. The exception is fp16:
the GradScaler reads its inf check on the host to skip a step, so that path reads the agreed
non-finite count too and keeps counting skipped steps as before.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from sluice.stages.precision import autocast
from sluice.stages.contracts import Selector, raw_stats
from sluice.stages.train.metrics import StepRecord, non_finite_error
from sluice.stages.train.components import Components
from sluice.stages.train.schedule import momentum_at
from sluice.stages.train.state import RunState

SampleLog = Callable[[RunState, torch.Tensor], None]
Number = float | torch.Tensor  # a host number, or a 0-dim device tensor not yet read


def set_schedule(opt: torch.optim.Optimizer, lr: float, momentum: float) -> None:
    """This step's lr and (one-cycle) momentum, set on every parameter group."""
    for g in opt.param_groups:
        g["lr"] = lr
        if "momentum" in g:  # SGD; AdamW keeps its betas
            g["momentum"] = momentum


@dataclasses.dataclass
class MicroBatchSums:
    """What one step's micro-batches add up to (device sums in float64, as Python's floats were)."""
    data_s: float = 0.0  # waiting for and preparing batches
    select_s: float = 0.0  # the selector's scoring
    loss_sum: Number = 0.0  # finite micro-batch losses
    nonfinite: Number = 0.0
    n_samples: int = 0  # trained (after selection): known from shapes
    sel_stats: dict[str, Number] = dataclasses.field(default_factory=dict)  # means over micro-batches
    trained: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)  # to observe


def train_step(parts: Components, state: RunState, batches: Iterator[Any], selector: Selector | None,
               log_samples: SampleLog | None = None, checkpoint: Path | str | None = None) -> StepRecord:
    """Take ``accum_steps`` batches from ``batches`` and make one optimizer step.

    ``log_samples`` receives each micro-batch's indices; ``checkpoint`` is named when the loss
    diverges. Under fp16 raises ``NonFiniteLoss`` past ``max_skipped_steps``; otherwise a NaN/inf
    loss is found when the record is read.
    """
    cfg = parts.cfg
    t0 = time.perf_counter()
    lr = state.lr()
    set_schedule(parts.opt, lr, momentum_at(cfg, state.progress()))
    sums = MicroBatchSums()
    for micro in range(cfg.accum_steps):  # DDP all-reduces the gradients on the last one only
        micro_batch(parts, state, batches, selector, log_samples, sums,
                    sync_grads=micro == cfg.accum_steps - 1)
    stats = reduce_over_ranks(parts, sums)
    checked = parts.scaler.is_enabled()
    if checked:  # fp16: the scaler reads its inf check anyway; skip or fail as before
        if stats[1].item() > 0:
            _fp16_non_finite(parts, state, checkpoint)
        else:
            state.skipped = 0
    # stateful selectors (importance estimates) learn from the trained samples' losses; every
    # rank observes (it may all-gather); a step non-finite on any rank hands over NaN only
    finite = stats[1] == 0
    for indices, losses in sums.trained:
        selector.observe(indices, torch.where(finite, losses, float("nan")))
    scale = _optimizer_step(parts, state)
    step_s = time.perf_counter() - t0
    state.advance(step_s)
    return _record(parts, state, stats, lr, step_s, sums, scale, checked)


def micro_batch(parts: Components, state: RunState, batches: Iterator[Any], selector: Selector | None,
                log_samples: SampleLog | None, sums: MicroBatchSums, sync_grads: bool) -> None:
    """One micro-batch: prepare, select, forward, backward (gradients accumulate)."""
    cfg, d = parts.cfg, parts.d
    td = time.perf_counter()
    x, y, idx = parts.task.prep(next(batches))
    sums.data_s += time.perf_counter() - td
    if log_samples is not None:
        log_samples(state, idx)
    w = None
    if selector is not None:
        ts = time.perf_counter()
        selector.set_progress(state.progress())  # InfoBatch's annealing
        selector.set_epoch(state.epoch)  # InfoBatch's threshold per epoch
        with autocast(cfg.amp, d.device):  # the scoring pass gets AMP's speed too
            sb = selector(parts.model, x, y, idx)
        sums.select_s += time.perf_counter() - ts
        x, y, w = sb.inputs, sb.targets, sb.weights
        for k, v in raw_stats(sb.stats).items():  # averaged on the device, read with the record
            v = v.detach().to(torch.float64) if isinstance(v, torch.Tensor) else float(v)
            sums.sel_stats[k] = sums.sel_stats.get(k, 0.0) + v / cfg.accum_steps
    sync = parts.ddp.no_sync() if parts.ddp is not None and not sync_grads else contextlib.nullcontext()
    with sync:
        with autocast(cfg.amp, d.device):
            out = parts.fwd(x)
        per, observed = parts.task.losses(out, y, cfg.label_smoothing)  # observed: per-token for rows
        loss = (per * w).mean() if w is not None else per.mean()
        loss = loss if len(per) else per.sum()  # an empty batch (loader.on_corrupt=skip): 0, not NaN
        parts.scaler.scale(loss / cfg.accum_steps).backward()
    if selector is not None:  # what observe() learns from, after the step
        sums.trained.append((sb.indices, observed.detach()))
    lv = loss.detach().to(torch.float64)
    finite = torch.isfinite(lv)
    sums.nonfinite = sums.nonfinite + (~finite).to(torch.float64)
    sums.loss_sum = sums.loss_sum + torch.where(finite, lv, 0.0)
    sums.n_samples += len(y)


def reduce_over_ranks(parts: Components, sums: MicroBatchSums) -> torch.Tensor:
    """[mean loss, non-finite count, samples] over all ranks, on the device: one small
    all-reduce, so every rank takes the same decisions (skip, fail, observe) from the same
    numbers, and none of them waits to read them."""
    d = parts.d
    samples = torch.full((), float(sums.n_samples), dtype=torch.float64, device=d.device)  # a fill, not a copy
    stats = torch.stack([torch.as_tensor(sums.loss_sum / parts.cfg.accum_steps, device=d.device),
                         torch.as_tensor(sums.nonfinite, device=d.device), samples])
    if d.on:
        dist.all_reduce(stats)
        stats[0] /= d.world
    return stats


def _optimizer_step(parts: Components, state: RunState) -> float | None:
    """Clip, step through the scaler, zero the gradients, update the EMA; the scale stepped at."""
    cfg, scaler = parts.cfg, parts.scaler
    if cfg.clip_grad_norm:
        scaler.unscale_(parts.opt)
        torch.nn.utils.clip_grad_norm_(parts.model.parameters(), cfg.clip_grad_norm)
    scale = scaler.get_scale() if scaler.is_enabled() else None
    scaler.step(parts.opt)
    scaler.update()
    if scale is not None and scaler.get_scale() < scale:  # it found inf/NaN and skipped
        state.scaler_skips += 1
    parts.opt.zero_grad(set_to_none=True)
    if parts.ema is not None:
        parts.ema.update_parameters(parts.model)
    return scale


def _record(parts: Components, state: RunState, stats: torch.Tensor, lr: float, step_s: float,
            sums: MicroBatchSums, scale: float | None, checked: bool) -> StepRecord:
    """The step's metrics record, unread: host numbers (keys in metrics.jsonl's order, with
    ``loss`` and ``samples_per_s`` filled in when read) and the device tensors."""
    d = parts.d
    sent = parts.hook.take_bytes() if d.on else 0
    busy = parts.hook.take_busy_s() if d.on else 0.0  # the hook's thread (compress + wire)
    host = {"step": state.step, "epoch": state.epoch, "loss": None, "lr": lr,
            "samples_per_s": None, "step_s": step_s, "data_s": sums.data_s,
            "data_wait_frac": None, "select_s": sums.select_s,
            "bytes_comm": sent, "bytes_uncompressed": parts.full_bytes if d.on else 0,
            "comm_busy_s": busy,
            "elapsed_s": state.elapsed}
    if scale is not None:
        host["grad_scale"], host["skipped_steps"] = scale, state.scaler_skips
    return StepRecord(host, stats, sums.sel_stats, checked)


def _fp16_non_finite(parts: Components, state: RunState, checkpoint: Path | str | None) -> None:
    """fp16: the scaler skips this step and lowers the scale; too many in a row fail the run."""
    state.skipped += 1
    if state.skipped <= parts.cfg.max_skipped_steps:
        return
    raise non_finite_error(state.step + 1, state.lr(), checkpoint)
