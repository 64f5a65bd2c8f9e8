"""The training loop: one run in-process (one rank) or as one DDP rank under torchrun.

``train(config, loader, eval_loader, selector)`` consumes any loader honouring
``contracts.ResumableLoader`` (batches of ``(images, labels, indices)``, exact mid-epoch resume),
optionally passes each candidate batch through a ``contracts.Selector``, and writes atomic
checkpoints from which a restarted job (``torchrun --max-restarts``) continues exactly. Budgets
are optimizer steps or wall-clock seconds; the learning-rate schedule follows the fraction of
the budget used, so a time-budgeted run still decays to zero. ``sluice.stages.train.worker`` runs
it inside each torchrun process.

A checkpoint of another world size resumes too (``train.resize``; ``elastic`` says what the
resumed run sees): the budget is counted in units of the starting global batch, so the schedule
keeps its meaning when the global batch changes.

This module is longer than most (~500 lines) because ``TrainingRun`` is one state machine whose
steps (resume, step, checkpoint, evaluate, report) share its state; each method has one concern.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from fractions import Fraction
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sluice.errors import NonFiniteLoss, TrainError
from sluice.stages.compute import autocast, build_optimizer, channel_values, normalize_uint8, resolve_amp
from sluice.stages.contracts import ResumableLoader, Selector
from sluice.stages.host import describe, host_class
from sluice.stages.models import build_model
from sluice.stages.train.comm import build_hook, uncompressed_bytes
from sluice.stages.train.config import TrainConfig
from sluice.stages.train.dist import dist_context
from sluice.stages.train.elastic import Resize, rank_part
from sluice.stages.train.ema import build_ema
from sluice.stages.train.init import load_initial_weights
from sluice.stages.train.evaluate import evaluate
from sluice.stages.train.schedule import lr_at, momentum_at
from sluice.storage.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint


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


class InputPrep:
    """Moves a batch to the device and turns uint8 pixels into normalised float."""

    def __init__(self, cfg: TrainConfig, device: torch.device):
        c = cfg.in_channels
        self.mean = channel_values(cfg.normalize_mean, c, device, "normalize_mean")
        self.std = channel_values(cfg.normalize_std, c, device, "normalize_std")
        self.device, self.channels_last, self.c = device, cfg.channels_last, c

    def __call__(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        try:
            images, labels, indices = batch
        except (TypeError, ValueError):
            raise TrainError("a loader batch must be (images, labels, indices)") from None
        if images.ndim != 4 or images.shape[1] != self.c:
            raise TrainError(f"images must be NCHW with {self.c} channels (train.in_channels), got "
                             f"{tuple(images.shape)}")
        nb = self.device.type == "cuda"
        x = images.to(self.device, non_blocking=nb)
        x = normalize_uint8(x, self.mean, self.std) if x.dtype == torch.uint8 else x.float()
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return (x, labels.to(self.device, torch.int64, non_blocking=nb),
                indices.to(self.device, torch.int64, non_blocking=nb))


def rng_state(device: torch.device) -> dict[str, Any]:
    s: dict[str, Any] = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        s["cuda"] = torch.cuda.get_rng_state(device)
    return s


def set_rng_state(s: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(s["torch"])
    if device.type == "cuda" and "cuda" in s:
        torch.cuda.set_rng_state(s["cuda"], device)


class TrainingRun:
    """State of one run; methods are the loop's steps (kept small, one concern each)."""

    def __init__(self, cfg: TrainConfig, loader: ResumableLoader,
                 eval_loader: ResumableLoader | None, selector: Selector | None,
                 batch_scale: Fraction = Fraction(1)):
        self.d = dist_context(cfg)
        if cfg.amp == "auto":  # decided once, by the device this run got
            cfg = cfg.model_copy(update={"amp": resolve_amp(cfg.amp, self.d.device)})
        self.cfg, self.loader, self.eval_loader, self.selector = cfg, loader, eval_loader, selector
        # stateful selectors (importance estimates) learn from the trained samples' losses
        self.observe = getattr(selector, "observe", None)
        self.set_progress = getattr(selector, "set_progress", None)  # InfoBatch's annealing
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        if len(loader) < 1:
            raise TrainError("the train loader yields no batches")
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        self.model = build_model(cfg.model, cfg.in_channels, cfg.num_classes,
                                 **cfg.model_kwargs).to(self.d.device)
        if cfg.init_from:  # every rank loads the same file: identical starting weights
            load_initial_weights(self.model, cfg.init_from, cfg.model_dump())
        if cfg.channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.hook = build_hook(cfg.comm, seed=cfg.seed)
        self.ddp: torch.nn.parallel.DistributedDataParallel | None = None
        fwd: torch.nn.Module = self.model
        if self.d.on:
            self.ddp = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.d.device.index] if self.d.device.type == "cuda"
                else None, bucket_cap_mb=cfg.comm.bucket_cap_mb)
            self.hook.register(self.ddp)  # one rank: nothing to communicate, no hook
            fwd = self.ddp
        self.fwd = torch.compile(fwd) if cfg.compile else fwd
        self.opt = build_optimizer(cfg.optimizer, self.model, cfg.lr, momentum=cfg.momentum,
                                   weight_decay=cfg.weight_decay)
        self.scaler = torch.amp.GradScaler(self.d.device.type, enabled=cfg.amp == "fp16")
        self.ema = None
        if cfg.ema_decay:
            self.ema = build_ema(self.model, cfg.ema_decay)
        self.prep = InputPrep(cfg, self.d.device)
        self.lr_scale = self._reference_lr_scale(self.d.world)
        self.full_bytes = uncompressed_bytes(self.model)
        self.compat = cfg.compat(self.d.world)
        self.ckpt = checkpoint_path(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
        self.total_steps = self._budget_steps()
        self.batch_scale = Fraction(batch_scale)
        self.resize = Resize.fresh(self.d.world)
        self.units = 0.0  # budget used, in steps of the starting global batch
        self.samples_log = None
        self.step, self.epoch, self.elapsed = 0, 0, 0.0
        self.resumed_from: int | None = None
        self.metrics: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.skipped = 0
        self.scaler_skips = 0  # fp16: optimizer steps the GradScaler skipped (inf/NaN gradients)
        self.last_ckpt_elapsed = 0.0
        self.metrics_file = None

    # -- setup ------------------------------------------------------------------------------
    def _budget_steps(self) -> int | None:
        c = self.cfg
        if c.max_steps:
            return c.max_steps
        if c.max_seconds:
            return None
        return max(1, math.ceil(c.epochs * len(self.loader) / c.accum_steps))

    def progress(self) -> float:
        p = 0.0
        if self.total_steps:
            p = self.units / self.total_steps
        if self.cfg.max_seconds:
            p = max(p, self.elapsed / self.cfg.max_seconds)
        return p

    def _reference_lr_scale(self, world: int) -> float:
        """lr_reference_batch's factor for the global batch of a run started on ``world`` ranks."""
        global_batch = self.cfg.batch_size * world * self.cfg.accum_steps
        return global_batch / self.cfg.lr_reference_batch if self.cfg.lr_reference_batch else 1.0

    def maybe_resume(self) -> None:
        if not (self.ckpt and self.cfg.resume and self.ckpt.exists()):
            self.loader.set_epoch(0)
            torch.manual_seed(self.cfg.seed * 1000 + 1 + self.d.rank)  # dropout differs per rank
            return
        s = load_checkpoint(self.ckpt, self.compat,
                            ignore=("world_size",) if self.cfg.resize != "refuse" else ())
        self.resize = Resize.resumed(self.cfg, s, self.d.world, self.batch_scale)
        # lr_reference_batch refers to the starting global batch; a resize rescales on top
        self.lr_scale = self._reference_lr_scale(self.resize.world_origin) * self.resize.lr_scale
        self.model.load_state_dict(s["model"])
        self.opt.load_state_dict(s["optimizer"])
        self.scaler.load_state_dict(s["scaler"])
        if self.ema is not None and s.get("ema") is not None:
            self.ema.load_state_dict(s["ema"])
        if self.resize.world_from == self.d.world:
            mine = s["ranks"][self.d.rank]
        else:  # another world size wrote it: global parts carry over, per-rank ones are dealt
            mine = rank_part(s["ranks"], self.d.rank, s["step"], self.cfg.seed, self.hook)
        self.hook.load_state_dict(mine["comm"], self.d.device)
        self.loader.load_state_dict(mine["loader"])
        if mine.get("selector") is not None and hasattr(self.selector, "load_state_dict"):
            self.selector.load_state_dict(mine["selector"])
        set_rng_state(mine["rng"], self.d.device)
        self.step, self.epoch, self.elapsed = s["step"], s["epoch"], s["elapsed"]
        e = s.get("elastic") or {}
        self.total_steps = e.get("total_steps", self.total_steps)
        self.units = float(e.get("units", self.step))
        self.last_ckpt_elapsed = self.elapsed
        self.resumed_from = self.step
        self.evals = list(s.get("evals", []))

    # -- data -------------------------------------------------------------------------------
    def batches(self) -> Iterator[Any]:
        """Endless batches across epochs, starting where the loader state says."""
        while True:
            yield from self.loader
            self.epoch += 1
            self.loader.set_epoch(self.epoch)

    # -- one optimizer step -----------------------------------------------------------------
    def train_step(self, it: Iterator[Any]) -> dict[str, Any]:
        cfg = self.cfg
        t0 = time.perf_counter()
        lr = lr_at(cfg, self.progress(), self.total_steps) * self.lr_scale
        momentum = momentum_at(cfg, self.progress())
        for g in self.opt.param_groups:
            g["lr"] = lr
            if "momentum" in g:  # SGD; AdamW keeps its betas
                g["momentum"] = momentum
        data_s = select_s = 0.0
        loss_sum, n_samples, nonfinite = 0.0, 0, 0
        sel_stats: dict[str, float] = {}
        trained: list[tuple[torch.Tensor, torch.Tensor]] = []  # (indices, losses) to observe
        for micro in range(cfg.accum_steps):
            td = time.perf_counter()
            x, y, idx = self.prep(next(it))
            data_s += time.perf_counter() - td
            if self.cfg.log_samples:
                self.log_samples(idx)
            w = None
            if self.selector is not None:
                ts = time.perf_counter()
                if self.set_progress is not None:
                    self.set_progress(self.progress())
                with autocast(cfg.amp, self.d.device):  # the scoring pass gets AMP's speed too
                    sb = self.selector(self.model, x, y, idx)
                select_s += time.perf_counter() - ts
                x, y, w = sb.images, sb.labels, sb.weights
                for k, v in sb.stats.items():
                    sel_stats[k] = sel_stats.get(k, 0.0) + float(v) / cfg.accum_steps
            sync = (self.ddp.no_sync() if self.ddp is not None and micro < cfg.accum_steps - 1
                    else contextlib.nullcontext())
            with sync:
                with autocast(cfg.amp, self.d.device):
                    out = self.fwd(x)
                per = F.cross_entropy(out.float(), y, reduction="none",
                                      label_smoothing=cfg.label_smoothing)
                loss = (per * w).mean() if w is not None else per.mean()
                loss = loss if len(per) else per.sum()  # an empty batch (loader.on_corrupt=skip): 0, not NaN
                self.scaler.scale(loss / cfg.accum_steps).backward()
            if self.observe is not None:
                trained.append((sb.indices, per.detach()))
            lv = loss.item()
            nonfinite += 0 if math.isfinite(lv) else 1
            loss_sum += lv if math.isfinite(lv) else 0.0
            n_samples += len(y)
        # one small all-reduce: mean loss, any non-finite, samples (same decisions everywhere)
        stats = self.d.tensor([loss_sum / cfg.accum_steps, nonfinite, n_samples])
        if self.d.on:
            dist.all_reduce(stats)
            stats[0] /= self.d.world
        if stats[1] > 0:
            self._non_finite()
        else:
            self.skipped = 0
            for indices, losses in trained:  # every rank observes (it may all-gather), or none
                self.observe(indices, losses)
        if cfg.clip_grad_norm:
            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip_grad_norm)
        scale = self.scaler.get_scale() if self.scaler.is_enabled() else None
        self.scaler.step(self.opt)
        self.scaler.update()
        if scale is not None and self.scaler.get_scale() < scale:  # it found inf/NaN and skipped
            self.scaler_skips += 1
        self.opt.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update_parameters(self.model)
        self.step += 1
        self.units += self.resize.step_weight
        step_s = time.perf_counter() - t0
        self.elapsed += step_s
        sent = self.hook.take_bytes() if self.d.on else 0
        busy = self.hook.take_busy_s() if self.d.on else 0.0  # the hook's thread (compress + wire)
        rec = {"step": self.step, "epoch": self.epoch, "loss": stats[0].item(), "lr": lr,
               "samples_per_s": stats[2].item() / step_s, "step_s": step_s, "data_s": data_s,
               "data_wait_frac": data_s / step_s, "select_s": select_s,
               "bytes_comm": sent, "bytes_uncompressed": self.full_bytes if self.d.on else 0,
               "comm_busy_s": busy,
               "elapsed_s": self.elapsed}
        if scale is not None:
            rec["grad_scale"], rec["skipped_steps"] = scale, self.scaler_skips
        rec.update({f"select/{k}": v for k, v in sel_stats.items()})
        return rec

    def _non_finite(self) -> None:
        if self.scaler.is_enabled():  # fp16: the scaler skips this step and lowers the scale
            self.skipped += 1
            if self.skipped <= self.cfg.max_skipped_steps:
                return
        where = f"; the last good checkpoint is {self.ckpt}" if self.ckpt and self.ckpt.exists() \
            else "; no checkpoint was written"
        raise NonFiniteLoss(f"loss became NaN/inf at step {self.step + 1} (lr "
                            f"{lr_at(self.cfg, self.progress(), self.total_steps) * self.lr_scale:.3g}){where}. Lower the lr, "
                            "enable clip_grad_norm, or check the data")

    # -- checkpoints, eval, logging ---------------------------------------------------------
    def sync_buffers(self) -> None:
        """Give every rank rank 0's buffers (BN statistics drift per rank after the last forward;
        DDP re-broadcasts them at the next forward anyway, so training is unaffected)."""
        if self.d.on:
            ema = list(self.ema.buffers()) if self.ema is not None else []
            for b in [*self.model.buffers(), *ema]:
                dist.broadcast(b, 0)

    def save(self) -> None:
        if self.ckpt is None:
            return
        self.sync_buffers()
        # per rank: RNG, loader position and comm-hook state (error feedback differs per rank)
        mine = {"rng": rng_state(self.d.device), "loader": self.loader.state_dict(),
                "comm": self.hook.state_dict()}
        if hasattr(self.selector, "state_dict"):  # loss tables, RNG: a resume selects on as before
            mine["selector"] = self.selector.state_dict()
        ranks = [mine]
        if self.d.on:
            ranks = [None] * self.d.world
            dist.all_gather_object(ranks, mine)
        if self.d.rank == 0:
            save_checkpoint(self.ckpt, {
                "compat": self.compat, "step": self.step, "epoch": self.epoch,
                "elapsed": self.elapsed, "model": self.model.state_dict(),
                "optimizer": self.opt.state_dict(), "scaler": self.scaler.state_dict(),
                "ema": self.ema.state_dict() if self.ema is not None else None,
                "comm": ranks[0]["comm"], "ranks": ranks, "evals": self.evals,
                "config": self.cfg.model_dump(),
                "elastic": self.resize.record(self.total_steps, self.units)})
        if self.d.on:
            dist.barrier()
        self.last_ckpt_elapsed = self.elapsed

    def due(self, every_steps: int | None, every_s: float | None) -> bool:
        if every_steps and self.step % every_steps == 0:
            return True
        return bool(every_s and self.elapsed - self.last_ckpt_elapsed >= every_s)

    def run_eval(self) -> dict[str, Any] | None:
        if self.eval_loader is None:
            return None
        self.sync_buffers()
        model = self.ema.module if self.ema is not None else self.model
        e = {"step": self.step, "elapsed_s": self.elapsed, "wall_time": time.time(),
             **evaluate(model, self.eval_loader, self.prep, self.cfg.amp, self.d,
                        tta=self.cfg.eval_tta)}
        self.evals.append(e)
        self.log({"eval": e})
        return e

    def log(self, rec: dict[str, Any]) -> None:
        if self.d.rank != 0 or not self.cfg.metrics_path:
            return
        if self.metrics_file is None:
            Path(self.cfg.metrics_path).parent.mkdir(parents=True, exist_ok=True)
            self.metrics_file = open(self.cfg.metrics_path, "a")
        self.metrics_file.write(json.dumps(rec) + "\n")
        self.metrics_file.flush()

    def log_samples(self, indices: torch.Tensor) -> None:
        """This rank's batch, as split indices, in ``samples-rank<R>.jsonl`` (``log_samples``)."""
        if self.samples_log is None:
            where = Path(self.cfg.metrics_path or self.cfg.checkpoint_dir or ".")
            where = where.parent if where.suffix else where
            where.mkdir(parents=True, exist_ok=True)
            self.samples_log = open(where / f"samples-rank{self.d.rank}.jsonl", "a")
        self.samples_log.write(json.dumps({"step": self.step + 1, "epoch": self.epoch,
                                           "world": self.d.world,
                                           "indices": indices.tolist()}) + "\n")
        self.samples_log.flush()

    def finished(self) -> bool:
        if self.total_steps and self.units >= self.total_steps - 1e-9:
            return True
        return bool(self.cfg.max_seconds and self.elapsed >= self.cfg.max_seconds)

    def stopped_by(self, halted: bool) -> str:
        """Why the run ended: ``halt_at_step``, its step budget, or ``max_seconds``."""
        if halted:
            return "halt_at_step"
        return "steps" if self.total_steps and self.units >= self.total_steps - 1e-9 else "max_seconds"

    # -- main -------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        self.maybe_resume()
        if self.d.on:  # elapsed must agree across ranks for time budgets
            t = self.d.tensor([self.elapsed])
            dist.broadcast(t, 0)
            self.elapsed = t.item()
        bar = self._bar()
        it = self.batches()
        halted = False
        self.model.train()
        try:
            while not self.finished():
                rec = self.train_step(it)
                if self.d.on and (self.cfg.max_seconds or self.cfg.checkpoint_every_seconds):
                    # time-based decisions must agree across ranks: use rank 0's clock
                    t = self.d.tensor([self.elapsed])
                    dist.broadcast(t, 0)
                    self.elapsed = rec["elapsed_s"] = t.item()
                if self.step % self.cfg.log_every_steps == 0:
                    self.metrics.append(rec)
                    self.log(rec)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", lr=f"{rec['lr']:.3g}")
                if self.cfg.eval_every_steps and self.step % self.cfg.eval_every_steps == 0 \
                        and not self.finished():
                    self.run_eval()
                if self.cfg.halt_at_step and self.step >= self.cfg.halt_at_step \
                        and not self.finished():
                    self.save()
                    halted = True
                    break
                if self.due(self.cfg.checkpoint_every_steps, self.cfg.checkpoint_every_seconds) \
                        and not self.finished():
                    self.save()
            final = None if halted else self.run_eval()
            if not halted:
                self.save()
        finally:
            if bar is not None:
                bar.close()
            for f in (self.metrics_file, self.samples_log):
                if f is not None:
                    f.close()
        return self._result(final, halted)

    def _bar(self) -> Any:
        if self.d.rank != 0 or not self.cfg.progress:
            return None
        from tqdm import tqdm
        return tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step",
                    dynamic_ncols=True, mininterval=1.0)

    def digests(self) -> list[str]:
        """A hash of the weights on every rank (DDP must keep them identical)."""
        self.sync_buffers()
        mine = param_digest(self.model)
        if not self.d.on:
            return [mine]
        out: list[Any] = [None] * self.d.world
        dist.all_gather_object(out, mine)
        return out

    def corrupt_skipped(self) -> int:
        """Damaged samples the loader dropped (``loader.on_corrupt: skip``), summed over ranks (collective)."""
        n = self.d.tensor([float(self.loader.profile().get("corrupt_skipped", 0))])
        if self.d.on:
            dist.all_reduce(n)
        return int(n.item())

    def _result(self, final: dict[str, Any] | None, halted: bool) -> TrainResult:
        ms = self.metrics
        summary: dict[str, Any] = {"world_size": self.d.world, "uncompressed_bytes": self.full_bytes,
                                   "elapsed_s": self.elapsed, "comm": self.cfg.comm.mode,
                                   "amp": self.cfg.amp,  # as resolved on this device
                                   "host": describe(host_class(self.d.device), self.cfg.amp, self.d.world,
                                                    torch.get_num_threads(), self.cfg.batch_size),
                                   "stopped_by": self.stopped_by(halted),
                                   "skipped_steps": self.scaler_skips,  # fp16's GradScaler, this process
                                   "param_digests": self.digests()}
        if ms:
            n = len(ms)
            summary.update({
                "bytes_per_step": sum(m["bytes_comm"] for m in ms) / n,
                "seconds_per_step": sum(m["step_s"] for m in ms) / n,
                "samples_per_s": sum(m["samples_per_s"] for m in ms) / n,
                "data_wait_frac": sum(m["data_s"] for m in ms) / max(sum(m["step_s"] for m in ms), 1e-9),
                "final_loss": ms[-1]["loss"]})
            cand = sum(m.get("select/n_candidates", 0.0) for m in ms)
            if cand:  # rank 0's share of its candidates trained, and its scoring cost
                summary["selection_trained_fraction"] = sum(m["select/n_selected"] for m in ms) / cand
                summary["selection_seconds_per_step"] = sum(m["select_s"] for m in ms) / n
            bottleneck = getattr(self.loader, "bottleneck", None)  # sluice's Loader profiles itself
            if callable(bottleneck):
                summary["loader"] = {"backend": getattr(self.loader, "backend_name", None),
                                     "choice": getattr(self.loader, "backend_reason", None),
                                     **{k: v for k, v in bottleneck().items() if k in ("verdict", "summary")},
                                     "corrupt_skipped": self.corrupt_skipped()}  # every rank's, summed
            if self.cfg.comm.mode == "powersgd":  # the compressed phase only
                late = [m["bytes_comm"] for m in ms if m["step"] > self.cfg.comm.start_iter]
                if late:
                    summary["bytes_per_step_compressed_phase"] = sum(late) / len(late)
        return TrainResult(metrics=ms, evals=self.evals,
                           final_acc=final["acc"] if final else None,
                           checkpoint=str(self.ckpt) if self.ckpt and self.ckpt.exists() else None,
                           steps=self.step, halted=halted, resumed_from=self.resumed_from,
                           summary=summary)


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
    return TrainingRun(cfg, loader, eval_loader, selector, Fraction(batch_scale)).run()


def param_digest(model: torch.nn.Module) -> str:
    """sha256 of all parameters and buffers, in order (bitwise equality check)."""
    import hashlib
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
