"""What one rank trains with: the model (and its DDP and compiled wrappers), optimizer, GradScaler,
EMA, gradient-communication hook and its task (input preparation, the loss), built once per run.

Built in one fixed order after seeding with ``cfg.seed``, so every rank starts from identical
weights and a resumed run rebuilds the same objects its checkpoint is loaded into.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import torch
import torch.distributed as dist

from sluice.stages.optimizer import build_optimizer
from sluice.stages.pixels import channels_last
from sluice.stages.models import build_model
from sluice.stages.train.comm import build_hook, uncompressed_bytes
from sluice.stages.train.config import TrainConfig
from sluice.stages.train.dist import DistContext
from sluice.stages.train.ema import build_ema
from sluice.stages.train.initial_weights import load_initial_weights
from sluice.stages.train.tasks import ImageTask, TokenTask, build_task


@dataclasses.dataclass
class Components:
    """The run's trainable objects; ``fwd`` is what the step calls (DDP and/or compiled model)."""
    cfg: TrainConfig
    d: DistContext
    model: torch.nn.Module
    ddp: torch.nn.parallel.DistributedDataParallel | None
    fwd: torch.nn.Module
    opt: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    ema: torch.optim.swa_utils.AveragedModel | None
    hook: Any  # comm.CommHook
    task: ImageTask | TokenTask  # what a batch becomes, and the loss per sample
    full_bytes: int  # one uncompressed gradient all-reduce

    @classmethod
    def build(cls, cfg: TrainConfig, d: DistContext) -> "Components":
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        model = build_model(cfg.model, cfg.in_channels, cfg.num_classes, **cfg.model_kwargs).to(d.device)
        if cfg.init_from:  # every rank loads the same file: identical starting weights
            load_initial_weights(model, cfg.init_from, cfg.model_dump())
        if cfg.channels_last:
            model = channels_last(model)
        hook = build_hook(cfg.comm, seed=cfg.seed)
        ddp = None
        fwd: torch.nn.Module = model
        if d.on:
            ddp = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[d.device.index] if d.device.type == "cuda" else None,
                bucket_cap_mb=cfg.comm.bucket_cap_mb)
            hook.register(ddp)  # one rank: nothing to communicate, no hook
            fwd = ddp
        fwd = torch.compile(fwd) if cfg.compile else fwd
        opt = build_optimizer(cfg.optimizer, model, cfg.lr, momentum=cfg.momentum,
                              weight_decay=cfg.weight_decay, betas=cfg.betas)
        scaler = torch.amp.GradScaler(d.device.type, enabled=cfg.amp == "fp16")
        ema = build_ema(model, cfg.ema_decay) if cfg.ema_decay else None
        return cls(cfg, d, model, ddp, fwd, opt, scaler, ema, hook, build_task(cfg, d.device),
                   uncompressed_bytes(model))

    def eval_model(self) -> torch.nn.Module:
        """The weights evaluation reads: the EMA's when there is one."""
        return self.ema.module if self.ema is not None else self.model

    def sync_buffers(self) -> None:
        """Give every rank rank 0's buffers (BN statistics drift per rank after the last forward;
        DDP re-broadcasts them at the next forward anyway, so training is unaffected)."""
        if self.d.on:
            ema = list(self.ema.buffers()) if self.ema is not None else []
            for b in [*self.model.buffers(), *ema]:
                dist.broadcast(b, 0)

    def digests(self) -> list[str]:
        """A hash of the weights on every rank (collective; DDP must keep them identical)."""
        self.sync_buffers()
        mine = param_digest(self.model)
        if not self.d.on:
            return [mine]
        out: list[Any] = [None] * self.d.world
        dist.all_gather_object(out, mine)
        return out


def param_digest(model: torch.nn.Module) -> str:
    """sha256 of all parameters and buffers, in order (bitwise equality check)."""
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
