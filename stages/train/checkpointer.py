"""Saving and resuming a run: one checkpoint (``checkpoint_dir/last.pt``) holding the global state
(weights, optimizer, scaler, EMA, counters) and every rank's own part (RNG, loader position,
comm-hook residuals, selector tables), from which a restarted job continues exactly.

A checkpoint written by another world size is re-cut here (``rank_part``): global parts carry
over, per-rank parts are dealt to the new ranks; ``elastic`` says what the resumed run sees and
how its batch, learning rate and budget relate to the old run's. The file itself is written and
read by ``sluice.storage.checkpoint`` (atomic, ``weights_only``, compatibility-checked).
"""
from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sluice.stages.contracts import ResumableLoader, Selector
from sluice.stages.train.elastic import Resize
from sluice.stages.train.components import Components
from sluice.stages.train.state import RunState, reference_lr_scale
from sluice.storage.checkpoint import checkpoint_exists, checkpoint_path, load_checkpoint, save_checkpoint


def rng_state(device: torch.device) -> dict[str, Any]:
    """This rank's RNG (dropout, selectors drawing from torch), so a resume draws on as before."""
    s: dict[str, Any] = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        s["cuda"] = torch.cuda.get_rng_state(device)
    return s


def set_rng_state(s: dict[str, Any], device: torch.device) -> None:
    """Restore what :func:`rng_state` saved (the CUDA part only where this run is on CUDA)."""
    torch.set_rng_state(s["torch"])
    if device.type == "cuda" and "cuda" in s:
        torch.cuda.set_rng_state(s["cuda"], device)


def rank_part(ranks: list[dict[str, Any]], rank: int, step: int, seed: int, hook: Any) -> dict[str, Any]:
    """Rank ``rank``'s part of a checkpoint written by ``len(ranks)`` ranks: the loader position
    is global (any rank's), PowerSGD's residuals are averaged (``hook.merge_rank_states``), a rank
    beyond the old world takes rank ``rank mod W``'s selector state and an RNG of its own."""
    world = len(ranks)
    own = dict(ranks[rank % world])
    own["loader"] = ranks[0]["loader"]  # global positions: any rank's says where the epoch is
    own["comm"] = hook.merge_rank_states([r["comm"] for r in ranks])
    if rank >= world:
        g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 7919 + step)
        own["rng"] = {"torch": g.get_state()}
    return own


def finite_weights(model: torch.nn.Module) -> bool:
    """Whether every floating-point parameter and buffer is finite (one read)."""
    checks = [torch.isfinite(t).all() for t in model.state_dict().values() if t.is_floating_point()]
    return bool(torch.stack(checks).all()) if checks else True


class Checkpointer:
    """Owns the run's checkpoint: when to save, what goes in, and loading it back (any world size)."""

    def __init__(self, parts: Components, loader: ResumableLoader, selector: Selector | None,
                 batch_scale: Fraction = Fraction(1)):
        self.parts, self.loader, self.selector = parts, loader, selector
        self.cfg, self.d = parts.cfg, parts.d
        self.batch_scale = Fraction(batch_scale)
        self.path = checkpoint_path(self.cfg.checkpoint_dir) if self.cfg.checkpoint_dir else None
        self.compat = self.cfg.compat(self.d.world)
        self.saved_elapsed = 0.0  # the clock at the last save (checkpoint_every_seconds)

    def written(self) -> Path | str | None:
        """The checkpoint file, once one exists."""
        return self.path if checkpoint_exists(self.path) else None

    def due(self, state: RunState) -> bool:
        """``checkpoint_every_steps`` or ``checkpoint_every_seconds`` says save now."""
        every_steps, every_s = self.cfg.checkpoint_every_steps, self.cfg.checkpoint_every_seconds
        if every_steps and state.step % every_steps == 0:
            return True
        return bool(every_s and state.elapsed - self.saved_elapsed >= every_s)

    # -- load --------------------------------------------------------------------------------
    def load(self, state: RunState) -> bool:
        """Resume from the checkpoint when there is one (and ``resume``); else start the fresh
        run's epoch and per-rank RNG. True when it resumed."""
        cfg, d, p = self.cfg, self.d, self.parts
        if not (self.path and cfg.resume and checkpoint_exists(self.path)):
            self.loader.set_epoch(0)
            torch.manual_seed(cfg.seed * 1000 + 1 + d.rank)  # dropout differs per rank
            return False
        s = load_checkpoint(self.path, self.compat,
                            ignore=("world_size",) if cfg.resize != "refuse" else ())
        state.resize = Resize.resumed(cfg, s, d.world, self.batch_scale)
        # lr_reference_batch refers to the starting global batch; a resize rescales on top
        state.lr_scale = reference_lr_scale(cfg, state.resize.world_origin) * state.resize.lr_scale
        p.model.load_state_dict(s["model"])
        p.opt.load_state_dict(s["optimizer"])
        p.scaler.load_state_dict(s["scaler"])
        if p.ema is not None and s.get("ema") is not None:
            p.ema.load_state_dict(s["ema"])
        if state.resize.world_from == d.world:
            mine = s["ranks"][d.rank]
        else:  # another world size wrote it: global parts carry over, per-rank ones are dealt
            mine = rank_part(s["ranks"], d.rank, s["step"], cfg.seed, p.hook)
        p.hook.load_state_dict(mine["comm"], d.device)
        self.loader.load_state_dict(mine["loader"])
        if mine.get("selector") is not None and self.selector is not None:
            self.selector.load_state_dict(mine["selector"])
        set_rng_state(mine["rng"], d.device)
        state.restore(s)
        self.saved_elapsed = state.elapsed
        return True

    # -- save --------------------------------------------------------------------------------
    def save(self, state: RunState) -> None:
        """Write the checkpoint (collective: every rank contributes its part, rank 0 writes)."""
        if self.path is None:
            return
        p, d = self.parts, self.d
        p.sync_buffers()
        # per rank: RNG, loader position and comm-hook state (error feedback differs per rank)
        mine = {"rng": rng_state(d.device), "loader": self.loader.state_dict(),
                "comm": p.hook.state_dict()}
        if self.selector is not None:  # loss tables, RNG: a resume selects on as before
            mine["selector"] = self.selector.state_dict()
        ranks: list[Any] = [mine]
        if d.on:
            ranks = [None] * d.world
            dist.all_gather_object(ranks, mine)
        if d.rank == 0:
            save_checkpoint(self.path, {
                "compat": self.compat, "step": state.step, "epoch": state.epoch,
                "elapsed": state.elapsed, "model": p.model.state_dict(),
                "optimizer": p.opt.state_dict(), "scaler": p.scaler.state_dict(),
                "ema": p.ema.state_dict() if p.ema is not None else None,
                "comm": ranks[0]["comm"], "ranks": ranks, "evals": state.evals,
                "config": self.cfg.model_dump(), "elastic": state.elastic_record()})
        if d.on:
            dist.barrier()
        self.saved_elapsed = state.elapsed
