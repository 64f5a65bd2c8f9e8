"""Resuming a run at another world size (``train.resize``).

A checkpoint written by W ranks can be resumed by W' ranks (1 ↔ 2 ↔ 3 ↔ 4 …, one node or
several). What the resumed run sees:

* **The epoch in progress** continues exactly: the loaders' positions are global
  (``sluice.stages.load.epochs``), so the samples of that epoch seen before and after the resize
  are those of the uninterrupted run — none twice, none skipped. Later epochs are ordered and cut
  for W'.
* ``keep_global_batch`` (default): every per-rank size (loader batch, candidates n_B, selected
  n_b) is scaled by W/W', so each step trains the same global batch — the same samples, split
  over W' ranks — with the same learning rate and schedule (it fails, naming the sizes, when the
  global batch does not divide by W'). ``scale_global_batch``: per-rank sizes stay, the global
  batch becomes W'/W times as large, the learning rate follows ``resize_lr`` (linear: ×W'/W,
  sqrt, or none) and each step counts W'/W of a step towards the budget, so the schedule and
  the budget keep their meaning in samples. ``refuse``: a checkpoint of another world size is an
  error (the behaviour before this option).
* **State**: model, optimizer, EMA, scaler and the step count are global. Selector tables
  (InfoBatch losses, importance estimates) are identical on every rank and carry over; a new
  rank beyond the old world takes the state of rank ``rank mod W``. Each rank's dropout RNG is
  its own when it existed, else seeded from (seed, rank, step). PowerSGD's error feedback is per
  rank: the residuals are averaged and every new rank starts from the average, so the group
  still applies exactly the correction it owed (its warm-start factors are shared already).
  ``checkpointer.rank_part`` deals these per-rank parts; this module holds the arithmetic
  (``Resize``) and the scale of the per-rank sizes (``batch_scale_for``), which the data and
  selection specs apply where they build (``stages/per_rank.py``): the job itself stays as it
  was assembled.
* Batch statistics (BatchNorm) see per-rank batches of the new size; a resumed run is therefore
  sample-exact but not bit-identical to an uninterrupted one.
"""
from __future__ import annotations

import dataclasses
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from sluice.errors import TrainError
from sluice.stages.train.config import TrainConfig
from sluice.storage.checkpoint import checkpoint_exists, checkpoint_path, load_checkpoint


def _ckpt(cfg: TrainConfig) -> Path | str | None:
    if not (cfg.checkpoint_dir and cfg.resume):
        return None
    p = checkpoint_path(cfg.checkpoint_dir)
    return p if checkpoint_exists(p) else None


def saved_geometry(state: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's world and batch record (older checkpoints: their world, scale 1)."""
    world = len(state["ranks"])
    e = state.get("elastic") or {}
    return {"world": world, "world_origin": int(e.get("world_origin", world)),
            "batch_scale": Fraction(*e.get("batch_scale", (1, 1))),
            "total_steps": e.get("total_steps"), "units": float(e.get("units", state["step"]))}


def batch_scale_for(cfg: TrainConfig, world: int) -> Fraction:
    """What this run's per-rank batch sizes are multiplied by: 1 for a fresh run or the same
    world size; under ``keep_global_batch``, old world / new world times the checkpoint's own
    scale. Use it to build your loaders when resuming in your own loop."""
    path = _ckpt(cfg)
    if path is None:
        return Fraction(1)
    if isinstance(path, Path):
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    else:  # a remote checkpoint (launch.ray.storage): read whole, as load_checkpoint does
        state = load_checkpoint(path)
    g = saved_geometry(state)
    if cfg.resize == "keep_global_batch":
        return g["batch_scale"] * g["world"] / world
    return g["batch_scale"]


@dataclasses.dataclass
class Resize:
    """How a resumed run relates to the one that wrote its checkpoint."""
    world_from: int
    world_to: int
    world_origin: int  # the world size the run started with (its learning rate's reference)
    batch_scale: Fraction
    step_weight: float  # budget units per step: this run's global batch / the starting one's
    lr_scale: float

    @classmethod
    def fresh(cls, world: int) -> "Resize":
        return cls(world, world, world, Fraction(1), 1.0, 1.0)

    @classmethod
    def resumed(cls, cfg: TrainConfig, state: dict[str, Any], world: int, batch_scale: Fraction) -> "Resize":
        g = saved_geometry(state)
        if g["world"] != world and cfg.resize == "refuse":
            raise TrainError(f"the checkpoint was written by {g['world']} ranks, this run has {world} "
                             "and train.resize=refuse; resume on the same world size or choose "
                             "keep_global_batch or scale_global_batch")
        want = g["batch_scale"] * (Fraction(g["world"], world) if cfg.resize == "keep_global_batch" else 1)
        if Fraction(batch_scale) != want:
            raise TrainError(f"resuming {g['world']} ranks' checkpoint on {world} with train.resize="
                             f"{cfg.resize} needs per-rank batches scaled by {want} (got {batch_scale}); "
                             "build the loaders with sluice.stages.train.elastic.batch_scale_for")
        weight = float(world * want / g["world_origin"])
        lr = {"linear": weight, "sqrt": weight ** 0.5, "none": 1.0}[cfg.resize_lr] \
            if cfg.resize == "scale_global_batch" else 1.0
        return cls(g["world"], world, g["world_origin"], want, weight, lr)

    def record(self, total_steps: int | None, budget_used: float) -> dict[str, Any]:
        """What the checkpoint keeps (plain values, for ``weights_only`` loading)."""
        return {"world_origin": self.world_origin, "batch_scale": [self.batch_scale.numerator,
                                                                   self.batch_scale.denominator],
                "total_steps": total_steps, "units": budget_used}

