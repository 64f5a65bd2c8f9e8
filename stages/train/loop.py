"""The training stage: one loop that runs in-process (one rank) or as a ``torchrun`` worker (DDP).

``train(config, loader, eval_loader, selector)`` is the loop; ``python -m sluice.stages.train.loop --job
job.json`` is the worker entry point ``sluice.stages.train.launch`` starts under ``torchrun``. The loop
consumes any *loader* honouring :class:`Loader` (batches of ``(images, labels, indices)``,
exact mid-epoch resume), optionally passes each candidate batch through a *selector*, and
writes atomic checkpoints from which a restarted job (``torchrun --max-restarts``) continues
exactly. Budgets are optimizer steps or wall-clock seconds; the learning-rate schedule follows
the fraction of the budget used, so a time-budgeted run still decays to zero.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator

from sluice.stages.train.comm import CommHook, uncompressed_bytes
from sluice.errors import NonFiniteLoss, SluiceError, TrainError
from sluice.stages.models import build_model
from sluice.stages.precision import AmpMode, resolve_amp
from sluice.storage.atomic import write_json
from sluice.storage.checkpoint import CheckpointMismatch, checkpoint_path, load_checkpoint, save_checkpoint
from sluice.storage.fingerprint import hash_obj

# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


class CommConfig(BaseModel):
    """Gradient communication (DDP comm hook); see ``sluice.stages.train.comm``."""
    model_config = ConfigDict(extra="forbid")
    mode: Literal["none", "fp16", "bf16", "powersgd"] = "none"
    powersgd_rank: int = Field(2, ge=1)
    start_iter: int = Field(10, ge=0)  # plain all-reduce before this many steps
    error_feedback: bool = True
    warm_start: bool = True
    # what PowerSGD sends (P, Q and the small uncompressed tensors); fp16/bf16 halve the bytes
    powersgd_dtype: Literal["fp32", "fp16", "bf16"] = "fp32"
    bucket_cap_mb: float = Field(25.0, gt=0)

    @model_validator(mode="after")
    def _start_iter(self) -> "CommConfig":
        if self.mode == "powersgd" and (self.error_feedback or self.warm_start) \
                and self.start_iter <= 1:
            raise ValueError("comm.start_iter must be > 1 for powersgd with error feedback or "
                             "warm start (DDP rebuilds its buckets after the first iteration)")
        return self


# Fields that do not change what is trained: excluded from the checkpoint compatibility hash.
OPERATIONAL = {"checkpoint_dir", "checkpoint_every_steps", "checkpoint_every_seconds", "resume",
               "halt_at_step", "eval_every_steps", "log_every_steps", "metrics_path", "progress",
               "torch_threads", "compile", "dist_timeout_s", "max_skipped_steps"}


class TrainConfig(BaseModel):
    """Everything a training run needs; JSON-serialisable (Prefect parameter, YAML, Python).

    Budget: ``max_steps`` optimizer steps if set, else ``max_seconds`` of wall-clock time if set,
    else ``epochs`` passes over the loader; with both ``max_steps`` and ``max_seconds`` the run
    ends at whichever comes first. The LR schedule follows the fraction of the budget used.
    """
    model_config = ConfigDict(extra="forbid")
    # model
    model: str = "small_cnn"  # built-in name or "package.module:factory"
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    in_channels: int = Field(1, ge=1)
    num_classes: int = Field(10, ge=2)
    normalize_mean: list[float] = Field(default_factory=lambda: [0.5])
    normalize_std: list[float] = Field(default_factory=lambda: [0.5])
    # budget
    epochs: float = Field(1.0, gt=0)
    max_steps: int | None = Field(None, ge=1)
    max_seconds: float | None = Field(None, gt=0)
    # optimisation
    batch_size: int = Field(128, ge=1)  # per rank and micro-batch (used by loader specs)
    accum_steps: int = Field(1, ge=1)
    optimizer: Literal["sgd", "adamw"] = "sgd"
    lr: float = Field(0.1, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(5e-4, ge=0)
    schedule: Literal["constant", "linear", "onecycle"] = "onecycle"
    warmup_fraction: float = Field(0.1, ge=0, lt=1)  # linear warm-up; one-cycle peak position
    clip_grad_norm: float | None = Field(None, gt=0)
    label_smoothing: float = Field(0.0, ge=0, lt=1)
    ema_decay: float | None = Field(None, gt=0, lt=1)  # evaluate an EMA of the weights
    # speed
    amp: AmpMode = Field("none", description="autocast dtype; 'auto' = bf16/fp16 where the "
                         "device computes it natively, else fp32 (sluice.stages.precision)")
    channels_last: bool = False
    compile: bool = False
    comm: CommConfig = Field(default_factory=CommConfig)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    torch_threads: int | None = Field(None, ge=1)
    dist_timeout_s: float = Field(300.0, gt=0)
    # checkpoints, evaluation, logging
    seed: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every_steps: int | None = Field(None, ge=1)
    checkpoint_every_seconds: float | None = Field(None, gt=0)
    resume: bool = True  # continue from checkpoint_dir/last.pt when it exists
    halt_at_step: int | None = Field(None, ge=1)  # checkpoint and stop here (schedule unchanged)
    eval_every_steps: int | None = Field(None, ge=1)
    log_every_steps: int = Field(1, ge=1)
    metrics_path: str | None = None  # JSON lines, rank 0
    progress: bool = True
    max_skipped_steps: int = Field(20, ge=1)  # fp16: consecutive overflow skips before failing

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        if len(self.normalize_mean) != len(self.normalize_std):
            raise ValueError("normalize_mean and normalize_std must have the same length")
        if any(s <= 0 for s in self.normalize_std):
            raise ValueError("normalize_std must be positive")
        return self

    def compat(self, world_size: int) -> dict[str, Any]:
        """What a checkpoint must match to be resumed by this config."""
        trained = self.model_dump(exclude=OPERATIONAL)
        return {"model": self.model, "config_hash": hash_obj(trained), "world_size": world_size}


# ---------------------------------------------------------------------------------------------
# Contracts with the loader and the selector
# ---------------------------------------------------------------------------------------------


@runtime_checkable
class Loader(Protocol):
    """What the loop needs from a loader (``sluice.stages.load.loader`` and ``ArrayLoader`` provide it).

    Iterating yields ``(images NCHW uint8|float, labels int64, indices int64)``; ``len`` is the
    batches per epoch on this rank (equal on every rank); ``state_dict`` resumes mid-epoch at the
    exact next batch.
    """
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]: ...
    def __len__(self) -> int: ...
    def set_epoch(self, epoch: int) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclasses.dataclass
class SelectedBatch:
    """What a selector returns: the batch to train on, optional per-sample weights, stats."""
    images: torch.Tensor
    labels: torch.Tensor
    indices: torch.Tensor
    weights: torch.Tensor | None = None
    stats: dict[str, float] = dataclasses.field(default_factory=dict)


# A selector may also have ``observe(indices, losses)``: called with the trained samples' losses
# after every step whose losses were finite on all ranks (importance sampling and InfoBatch keep
# estimates), and ``set_progress(fraction)``: called before each selection with the fraction of
# the budget done (InfoBatch stops pruning near the end); ``state_dict()``/``load_state_dict()``
# put its state (loss tables, RNG) in each rank's part of the checkpoint.
Selector = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], SelectedBatch]


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


# ---------------------------------------------------------------------------------------------
# Loader specs: JSON descriptions resolved inside each worker process
# ---------------------------------------------------------------------------------------------

LoaderFactory = Callable[..., Loader]
_LOADERS: dict[str, LoaderFactory] = {}


def register_loader(kind: str) -> Callable[[LoaderFactory], LoaderFactory]:
    """Register ``fn(spec, *, rank, world_size, batch_size, seed, train) -> Loader``."""
    def deco(fn: LoaderFactory) -> LoaderFactory:
        _LOADERS[kind] = fn
        return fn
    return deco


def build_loader(spec: dict[str, Any], *, rank: int = 0, world_size: int = 1,
                 batch_size: int = 128, seed: int = 0, train: bool = True) -> Loader:
    """Turn a loader spec such as ``{"kind": "arrays", "path": "x.npz"}`` into a loader."""
    if not isinstance(spec, dict) or "kind" not in spec:
        raise TrainError(f"a loader spec is a dict with a 'kind', got {spec!r}")
    kind = spec["kind"]
    if kind not in _LOADERS:
        with contextlib.suppress(ImportError):  # sluice.stages.load.loader registers its own kinds
            importlib.import_module("sluice.stages.load.loader")
    if kind not in _LOADERS:
        raise TrainError(f"unknown loader kind {kind!r}; known: {sorted(_LOADERS)}")
    return _LOADERS[kind](spec, rank=rank, world_size=world_size, batch_size=batch_size,
                          seed=seed, train=train)


@register_loader("arrays")
def _arrays_loader(spec: dict[str, Any], *, rank: int, world_size: int, batch_size: int,
                   seed: int, train: bool) -> Loader:
    """``{"kind": "arrays", "path": "x.npz" | "fashion-mnist:train", "limit": n, ...}``."""
    from sluice.stages.load.arrays import ArrayLoader, load_arrays
    unknown = set(spec) - {"kind", "path", "limit", "batch_size", "delay_s", "shuffle"}
    if unknown:
        raise TrainError(f"arrays loader spec has unknown keys {sorted(unknown)}")
    images, labels = load_arrays(spec["path"])
    if spec.get("limit"):
        images, labels = images[:spec["limit"]], labels[:spec["limit"]]
    return ArrayLoader(images, labels, int(spec.get("batch_size", batch_size)),
                       shuffle=spec.get("shuffle", train), seed=seed, rank=rank,
                       world_size=world_size, drop_last=train, even=train,
                       delay_s=float(spec.get("delay_s", 0.0)))


@register_loader("factory")
def _factory_loader(spec: dict[str, Any], **kw: Any) -> Loader:
    """``{"kind": "factory", "factory": "package.module:fn", "kwargs": {...}}``."""
    return _import(spec["factory"])(**spec.get("kwargs", {}), **kw)


def _import(ref: str) -> Any:
    mod, _, attr = ref.partition(":")
    try:
        return getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise TrainError(f"cannot import {ref!r} (want 'package.module:name'): {e}") from None


# ---------------------------------------------------------------------------------------------
# Pieces of the loop
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def on(self) -> bool:
        return self.world > 1

    def tensor(self, values: list[float]) -> torch.Tensor:
        """A float64 tensor on the device the process group communicates from."""
        return torch.tensor(values, dtype=torch.float64, device=self.device)


def _dist_context(cfg: TrainConfig) -> _Dist:
    want_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        raise TrainError("device='cuda' but CUDA is not available")
    if cfg.amp == "fp16" and not want_cuda:
        raise TrainError("amp='fp16' needs CUDA (GradScaler); use amp='bf16' on CPU")
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    if want_cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return _Dist(rank, world, torch.device("cuda", local))
    return _Dist(rank, world, torch.device("cpu"))


def lr_at(cfg: TrainConfig, progress: float) -> float:
    """The learning rate at ``progress`` in [0, 1] of the budget."""
    p = min(max(progress, 0.0), 1.0)
    w = cfg.warmup_fraction
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "linear":  # optional warm-up, then linear decay to zero
        if p < w:
            return cfg.lr * p / w
        return cfg.lr * (1 - p) / (1 - w)
    # one-cycle: from lr/25 up to lr at w (linear), then cosine down to ~0
    if p < w:
        return cfg.lr * (0.04 + 0.96 * p / w)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * (p - w) / (1 - w)))


def _optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0)


class _Prep:
    """Moves a batch to the device and turns uint8 into normalised float."""

    def __init__(self, cfg: TrainConfig, device: torch.device):
        c = cfg.in_channels
        mean, std = cfg.normalize_mean, cfg.normalize_std
        if len(mean) not in (1, c):
            raise TrainError(f"normalize_mean has {len(mean)} values for {c} channels")
        self.mean = torch.tensor(mean, device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(std, device=device).view(1, -1, 1, 1)
        self.device, self.channels_last, self.c = device, cfg.channels_last, c

    def __call__(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        try:
            images, labels, indices = batch
        except (TypeError, ValueError):
            raise TrainError("a loader batch must be (images, labels, indices)") from None
        if images.ndim != 4 or images.shape[1] != self.c:
            raise TrainError(f"images must be NCHW with {self.c} channels, got {tuple(images.shape)}")
        nb = self.device.type == "cuda"
        x = images.to(self.device, non_blocking=nb)
        if x.dtype == torch.uint8:
            x = x.float().div_(255).sub_(self.mean).div_(self.std)
        else:
            x = x.float()
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return (x, labels.to(self.device, torch.int64, non_blocking=nb),
                indices.to(self.device, torch.int64, non_blocking=nb))


def _autocast(cfg: TrainConfig, device: torch.device) -> contextlib.AbstractContextManager:
    if cfg.amp == "none":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if cfg.amp == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def evaluate(model: torch.nn.Module, loader: Loader, prep: _Prep, cfg: TrainConfig,
             d: _Dist) -> dict[str, float]:
    """Accuracy and mean loss over ``loader`` (each rank its shard, summed across ranks)."""
    was = model.training
    model.eval()
    tot = d.tensor([0.0, 0.0, 0.0])
    loader.set_epoch(0)
    with torch.no_grad(), _autocast(cfg, d.device):
        for batch in loader:
            x, y, _ = prep(batch)
            out = model(x).float()
            tot[0] += (out.argmax(1) == y).sum()
            tot[1] += F.cross_entropy(out, y, reduction="sum")
            tot[2] += len(y)
    if d.on:
        dist.all_reduce(tot)
    model.train(was)
    n = max(tot[2].item(), 1.0)
    return {"acc": tot[0].item() / n, "loss": tot[1].item() / n, "n": int(tot[2].item())}


def _rng_state(device: torch.device) -> dict[str, Any]:
    s: dict[str, Any] = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        s["cuda"] = torch.cuda.get_rng_state(device)
    return s


def _set_rng_state(s: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(s["torch"])
    if device.type == "cuda" and "cuda" in s:
        torch.cuda.set_rng_state(s["cuda"], device)


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------


class _Run:
    """State of one run; methods are the loop's steps (kept small, one concern each)."""

    def __init__(self, cfg: TrainConfig, loader: Loader, eval_loader: Loader | None,
                 selector: Selector | None):
        self.d = _dist_context(cfg)
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
        if cfg.channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.hook = CommHook(cfg.comm.mode, powersgd_rank=cfg.comm.powersgd_rank,
                             start_iter=cfg.comm.start_iter,
                             error_feedback=cfg.comm.error_feedback,
                             warm_start=cfg.comm.warm_start, seed=cfg.seed,
                             wire_dtype=cfg.comm.powersgd_dtype)
        self.ddp: torch.nn.parallel.DistributedDataParallel | None = None
        fwd: torch.nn.Module = self.model
        if self.d.on:
            self.ddp = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.d.device.index] if self.d.device.type == "cuda"
                else None, bucket_cap_mb=cfg.comm.bucket_cap_mb)
            self.hook.register(self.ddp)
            fwd = self.ddp
        elif cfg.comm.mode != "none":
            pass  # one rank: nothing to communicate, the hook never runs
        self.fwd = torch.compile(fwd) if cfg.compile else fwd
        self.opt = _optimizer(cfg, self.model)
        self.scaler = torch.amp.GradScaler(self.d.device.type, enabled=cfg.amp == "fp16")
        self.ema = None
        if cfg.ema_decay:
            from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
            self.ema = AveragedModel(self.model, multi_avg_fn=get_ema_multi_avg_fn(cfg.ema_decay),
                                     use_buffers=True)
        self.prep = _Prep(cfg, self.d.device)
        self.full_bytes = uncompressed_bytes(self.model)
        self.compat = cfg.compat(self.d.world)
        self.ckpt = checkpoint_path(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
        self.total_steps = self._budget_steps()
        self.step, self.epoch, self.elapsed = 0, 0, 0.0
        self.resumed_from: int | None = None
        self.metrics: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.skipped = 0
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
            p = self.step / self.total_steps
        if self.cfg.max_seconds:
            p = max(p, self.elapsed / self.cfg.max_seconds)
        return p

    def maybe_resume(self) -> None:
        if not (self.ckpt and self.cfg.resume and self.ckpt.exists()):
            self.loader.set_epoch(0)
            torch.manual_seed(self.cfg.seed * 1000 + 1 + self.d.rank)  # dropout differs per rank
            return
        s = load_checkpoint(self.ckpt, self.compat)
        self.model.load_state_dict(s["model"])
        self.opt.load_state_dict(s["optimizer"])
        self.scaler.load_state_dict(s["scaler"])
        if self.ema is not None and s.get("ema") is not None:
            self.ema.load_state_dict(s["ema"])
        mine = s["ranks"][self.d.rank]
        self.hook.load_state_dict(mine["comm"], self.d.device)
        self.loader.load_state_dict(mine["loader"])
        if mine.get("selector") is not None and hasattr(self.selector, "load_state_dict"):
            self.selector.load_state_dict(mine["selector"])
        _set_rng_state(mine["rng"], self.d.device)
        self.step, self.epoch, self.elapsed = s["step"], s["epoch"], s["elapsed"]
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
        lr = lr_at(cfg, self.progress())
        for g in self.opt.param_groups:
            g["lr"] = lr
        data_s = select_s = 0.0
        loss_sum, n_samples, nonfinite = 0.0, 0, 0
        sel_stats: dict[str, float] = {}
        trained: list[tuple[torch.Tensor, torch.Tensor]] = []  # (indices, losses) to observe
        for micro in range(cfg.accum_steps):
            td = time.perf_counter()
            x, y, idx = self.prep(next(it))
            data_s += time.perf_counter() - td
            w = None
            if self.selector is not None:
                ts = time.perf_counter()
                if self.set_progress is not None:
                    self.set_progress(self.progress())
                with _autocast(cfg, self.d.device):  # the scoring pass gets AMP's speed too
                    sb = self.selector(self.model, x, y, idx)
                select_s += time.perf_counter() - ts
                x, y, w = sb.images, sb.labels, sb.weights
                for k, v in sb.stats.items():
                    sel_stats[k] = sel_stats.get(k, 0.0) + float(v) / cfg.accum_steps
            sync = (self.ddp.no_sync() if self.ddp is not None and micro < cfg.accum_steps - 1
                    else contextlib.nullcontext())
            with sync:
                with _autocast(cfg, self.d.device):
                    out = self.fwd(x)
                per = F.cross_entropy(out.float(), y, reduction="none",
                                      label_smoothing=cfg.label_smoothing)
                loss = (per * w).mean() if w is not None else per.mean()
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
        self.opt.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update_parameters(self.model)
        self.step += 1
        step_s = time.perf_counter() - t0
        self.elapsed += step_s
        sent = self.hook.take_bytes() if self.d.on and cfg.comm.mode != "none" else (
            self.full_bytes if self.d.on else 0)
        rec = {"step": self.step, "epoch": self.epoch, "loss": stats[0].item(), "lr": lr,
               "samples_per_s": stats[2].item() / step_s, "step_s": step_s, "data_s": data_s,
               "data_wait_frac": data_s / step_s, "select_s": select_s,
               "bytes_comm": sent, "bytes_uncompressed": self.full_bytes if self.d.on else 0,
               "elapsed_s": self.elapsed}
        if scale is not None:
            rec["grad_scale"] = scale
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
                            f"{lr_at(self.cfg, self.progress()):.3g}){where}. Lower the lr, "
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
        mine = {"rng": _rng_state(self.d.device), "loader": self.loader.state_dict(),
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
                "config": self.cfg.model_dump()})
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
        e = {"step": self.step, "elapsed_s": self.elapsed,
             **evaluate(model, self.eval_loader, self.prep, self.cfg, self.d)}
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

    def finished(self) -> bool:
        if self.total_steps and self.step >= self.total_steps:
            return True
        return bool(self.cfg.max_seconds and self.elapsed >= self.cfg.max_seconds)

    def stopped_by(self, halted: bool) -> str:
        """Why the run ended: ``halt_at_step``, its step budget, or ``max_seconds``."""
        if halted:
            return "halt_at_step"
        return "steps" if self.total_steps and self.step >= self.total_steps else "max_seconds"

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
            if self.metrics_file is not None:
                self.metrics_file.close()
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

    def _result(self, final: dict[str, Any] | None, halted: bool) -> TrainResult:
        ms = self.metrics
        summary: dict[str, Any] = {"world_size": self.d.world, "uncompressed_bytes": self.full_bytes,
                                   "elapsed_s": self.elapsed, "comm": self.cfg.comm.mode,
                                   "amp": self.cfg.amp,  # as resolved on this device
                                   "stopped_by": self.stopped_by(halted),
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
            if self.cfg.comm.mode == "powersgd":  # the compressed phase only
                late = [m["bytes_comm"] for m in ms if m["step"] > self.cfg.comm.start_iter]
                if late:
                    summary["bytes_per_step_compressed_phase"] = sum(late) / len(late)
        return TrainResult(metrics=ms, evals=self.evals,
                           final_acc=final["acc"] if final else None,
                           checkpoint=str(self.ckpt) if self.ckpt and self.ckpt.exists() else None,
                           steps=self.step, halted=halted, resumed_from=self.resumed_from,
                           summary=summary)


def train(config: TrainConfig | dict[str, Any], loader: Loader, eval_loader: Loader | None = None,
          selector: Selector | None = None) -> TrainResult:
    """Train with ``config`` on ``loader``: one rank in-process, or one DDP rank under torchrun.

    When ``torch.distributed`` is initialised the model is wrapped in DDP over that group.
    Raises ``TrainError`` for bad input and ``NonFiniteLoss`` when the loss diverges.
    """
    cfg = config if isinstance(config, TrainConfig) else TrainConfig.model_validate(config)
    if not isinstance(loader, Loader):
        raise TrainError("loader must be iterable with __len__, set_epoch, state_dict and "
                         f"load_state_dict; got {type(loader).__name__}")
    return _Run(cfg, loader, eval_loader, selector).run()


def param_digest(model: torch.nn.Module) -> str:
    """sha256 of all parameters and buffers, in order (bitwise equality check)."""
    import hashlib
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def final_parameters(checkpoint: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model weights stored in a checkpoint (for comparisons and export)."""
    return load_checkpoint(checkpoint)["model"]


# ---------------------------------------------------------------------------------------------
# Worker entry point (run by torchrun via sluice.stages.train.launch)
# ---------------------------------------------------------------------------------------------

FATAL = "error.json"
RESULT = "result.json"


def _init_dist(cfg: TrainConfig) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    backend = "nccl" if use_cuda else "gloo"
    timeout = datetime.timedelta(seconds=cfg.dist_timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # After torchrun restarts a group (a rank was killed), peers could read the dead
        # attempt's addresses from the agent's store and fail to connect ("Connection refused"),
        # burning every restart in seconds. Keys prefixed by the attempt keep attempts apart.
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                             is_master=False, timeout=timeout)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"sluice/attempt-{attempt}", base)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)


def _selector_from(spec: dict[str, Any] | None) -> Selector | None:
    if not spec:
        return None
    return _import(spec["factory"])(**spec.get("kwargs", {}))


def worker(job_path: str) -> int:
    """Run one rank of a job described by ``job.json``; rank 0 writes ``result.json``."""
    job = json.loads(Path(job_path).read_text())
    out = Path(job["out_dir"])
    if (out / FATAL).exists():  # a restart after a fatal error would only repeat it
        print(f"[sluice] not restarting: {(out / FATAL).read_text()}", file=sys.stderr)
        return 3
    rank = int(os.environ.get("RANK", 0))
    try:
        cfg = TrainConfig.model_validate(job["config"])
        if cfg.torch_threads is None:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
        _init_dist(cfg)
        world = dist.get_world_size() if dist.is_initialized() else 1
        (out / "pids").mkdir(parents=True, exist_ok=True)
        (out / "pids" / f"rank{rank}.pid").write_text(str(os.getpid()))
        kw = dict(rank=rank, world_size=world, batch_size=cfg.batch_size, seed=cfg.seed)
        loader = build_loader(job["loader"], train=True, **kw)
        ev = build_loader(job["eval"], train=False, **kw) if job.get("eval") else None
        result = train(cfg, loader, ev, _selector_from(job.get("selector")))
        if rank == 0:
            write_json(out / RESULT, result.to_dict())
        if dist.is_initialized():
            # Every rank leaves together: a rank that tears gloo down while a peer still has
            # traffic in flight aborts ("terminate called without an active exception").
            dist.barrier()
        return 0
    except (SluiceError, CheckpointMismatch, ValueError) as e:
        write_json(out / FATAL, {"type": type(e).__name__, "message": str(e), "rank": rank})
        print(f"[sluice] rank {rank}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Sluice training worker (run under torchrun)")
    ap.add_argument("--job", required=True, help="job.json written by sluice.stages.train.launch")
    return worker(ap.parse_args(argv).job)


if __name__ == "__main__":
    # run the imported module, not __main__, so registries (register_loader) are shared
    from sluice.stages.train.loop import main as _main
    code = _main()
    # Leave without interpreter/C++ teardown: results are already written atomically, and
    # destructors of gloo's and the loader's threads can abort a finished rank at exit
    # ("terminate called without an active exception"), which torchrun reports as a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
