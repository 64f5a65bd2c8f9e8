"""Warm starts: tonight's run begins from the champion's weights and trains on what it has not
seen plus a replay of what it has, instead of every sample from random weights.

What the champion has seen is its registry lineage (``storage/lineage.py``): the key hashes of
the samples it trained on, which include its own parent's. The champion's dataset version must
be an ancestor of tonight's (``storage/ancestry.py``: the manifest's ``ancestors``). A sample of
tonight's train split is *new* when its key is not among the champion's, or when a version since
the champion's relabelled it, gave it new pixels or removed and re-added it: the champion learnt
something else under that key. The run trains for ``warm.epochs`` over new + replay with the
recipe's schedule at ``warm.lr_scale`` of its peak and its own warm-up (no floor in steps: the
floor guards random weights), and its own lineage is the champion's plus tonight's training
splits, so a warm model is never graded on anything its ancestors saw.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from sluice.errors import ConfigError, StorageError
from sluice.stages.select.infobatch_carry import CarriedTable, carry_table, checkpoint_table
from sluice.stages.select.spec import SelectionSpec
from sluice.stages.train.loss_cache import losses_by_key
from sluice.stages.train.initial_weights import architecture_of
from sluice.stages.train.job import TrainJob
from sluice.stages.run.replay import REPLAY_POLICIES, ReplayContext
from sluice.storage.ancestry import changes_since
from sluice.storage.artifact import open_artifact
from sluice.storage.checkpoint import load_checkpoint
from sluice.storage.lineage import hash_keys, save_hashes
from sluice.storage.registry import Registry
from sluice.storage.scores import open_scores


class WarmStartConfig(BaseModel):
    """Where tonight's weights start, and what a warm run trains on."""
    model_config = ConfigDict(extra="forbid")
    init: Literal["scratch", "champion", "auto"] = Field(
        "scratch", description="scratch: random weights, every sample; champion: the champion's weights "
        "(refused, naming why, when it cannot be); auto: the champion when it can be, else scratch")
    replay: str = Field("uniform", description="a registered replay policy: uniform, champion_loss, reducible_loss")
    # The pipeline's recipe (flows/recipes/default.yaml) turns warm starts on: init auto, every old
    # sample replayed, 2 epochs at half the peak (nightly_growth_warm_sweep.json); every bounded
    # replay tried fell 0.29-1.05 points behind plain scratch on some night.
    replay_ratio: float | None = Field(None, ge=0, description="old samples replayed per new sample "
                                       "(None: every old sample)")
    epochs: float = Field(2.0, gt=0, description="passes over new + replayed samples")
    lr_scale: float = Field(0.5, gt=0, le=1, description="the warm run's peak lr, as a share of the recipe's")
    warmup_fraction: float = Field(0.1, ge=0, lt=1, description="the warm run's share of steps warming up "
                                   "to its peak (the champion's weights are trained: no floor in steps)")

    @field_validator("replay")
    @classmethod
    def _registered(cls, v: str) -> str:
        return REPLAY_POLICIES.validate(v)

    def replay_count(self, old: int, new: int) -> int:
        """How many of ``old`` already-learnt samples a warm run with ``new`` new ones replays."""
        return old if self.replay_ratio is None else min(old, int(round(self.replay_ratio * new)))


class WarmPlan(BaseModel):
    """A warm run, as decided: recorded with the model it produces."""
    model_config = ConfigDict(extra="forbid")
    parent_model: str
    parent_version: str
    checkpoint: str
    subset: str  # .npy of the split indices trained on (new + replayed)
    replayed_keys: str  # .npy of the replayed samples' key hashes
    new: int
    replayed: int
    policy: str
    # InfoBatch's per-sample table carried from the champion (select/infobatch_carry.py): the
    # .npz the selector starts from (None: it starts empty), its matched rows, and why
    selector_state: str | None = None
    selector_rows_carried: int = 0
    selector_why: str = ""


def _refuse(warm: WarmStartConfig, reason: str) -> tuple[None, str]:
    if warm.init == "champion":
        raise ConfigError(f"warm.init=champion cannot start from the champion: {reason} "
                          "(warm.init=auto falls back to scratch instead)")
    return None, reason


def plan_warm_start(warm: WarmStartConfig, reg: Registry, job: TrainJob, il_path: str | None,
                    out_dir: str | os.PathLike) -> tuple[WarmPlan | None, str]:
    """The warm run for ``job`` (None and why when it starts from scratch)."""
    if warm.init == "scratch":
        return None, "warm.init is scratch"
    if job.data.kind != "artifact":  # e.g. a language model's token rows
        return _refuse(warm, f"warm starts are planned over an image artifact's samples, and tonight's "
                             f"data is {job.data.kind} (token rows have no per-document subset to train on yet)")
    champ = reg.champion()
    if champ is None:
        return _refuse(warm, "there is no champion yet")
    try:
        hashes = reg.trained_hashes(champ)
        ckpt = reg.checkpoint_path(champ)
        state = load_checkpoint(ckpt)
        theirs = architecture_of(state.get("config") or {})
        table = checkpoint_table(state)  # InfoBatch's (loss, seen), or why there is none
        del state
    except (StorageError, OSError) as e:  # a missing or corrupt champion: say so, never crash auto
        return _refuse(warm, f"champion {champ.model_id} is unreadable: {e}")
    if hashes is None or champ.trained_on is None:
        return _refuse(warm, f"champion {champ.model_id} has no record of what it trained on")
    ours = architecture_of(job.config.model_dump())
    if theirs != ours:
        return _refuse(warm, f"champion {champ.model_id} is a {theirs}, tonight's model a {ours}")
    root, split = job.data.root, job.data.loader.split
    since = changes_since(root, champ.trained_on.dataset_fingerprint)
    if isinstance(since, str):
        return _refuse(warm, f"champion {champ.model_id}'s dataset version cannot be traced to tonight's: {since}")
    art = open_artifact(root)
    keys = art.keys(split)
    train = hash_keys(keys)
    live = np.zeros(train.size, bool)
    live[art.live(split)] = True  # a removed sample is never trained on
    # new pixels, a new label or a removed-then-returned key since the champion's version: the
    # champion learnt something else under that key, so the sample counts as new
    redo = since.relabelled | since.changed | since.removed
    other = np.fromiter((k in redo for k in keys), bool, count=len(keys)) if redo else np.zeros(train.size, bool)
    seen = np.isin(train, hashes) & ~other
    old, new = np.flatnonzero(seen & live), np.flatnonzero(live & ~seen)
    if new.size == 0:
        return _refuse(warm, f"tonight's {split} split holds nothing champion {champ.model_id} has not seen")
    count = warm.replay_count(old.size, new.size)
    ctx = ReplayContext(old=old, count=count, rng=np.random.default_rng([job.config.seed, 0x5EED]),
                        champion_losses=lambda idx: losses_by_key(ckpt, root, split, idx).values,
                        irreducible=lambda: open_scores(il_path).values if il_path else None)
    replay = np.asarray(REPLAY_POLICIES.get(warm.replay)(ctx), dtype=np.int64) if count else \
        np.empty(0, dtype=np.int64)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "warm_subset.npy", np.union1d(new, replay), allow_pickle=False)
    save_hashes(out / "warm_replayed_keys.npy", np.unique(train[replay]))
    carried = _carry_selector(job, table, since.root, old, out)
    return WarmPlan(parent_model=champ.model_id, parent_version=champ.trained_on.dataset_fingerprint,
                    checkpoint=str(ckpt), subset=str(out / "warm_subset.npy"),
                    replayed_keys=str(out / "warm_replayed_keys.npy"), new=int(new.size),
                    replayed=int(replay.size), policy=warm.replay, selector_state=carried.path,
                    selector_rows_carried=carried.rows, selector_why=carried.why), \
        f"from champion {champ.model_id}: {new.size} new samples + {replay.size} replayed ({warm.replay})"


def _carry_selector(job: TrainJob, table: tuple[np.ndarray, np.ndarray] | str, champion_root: str,
                    learnt: np.ndarray, out: Path) -> CarriedTable:
    """InfoBatch's table from the champion, matched into tonight's index for the ``learnt``
    samples (new, changed and relabelled ones start unseen), when tonight's run selects with it."""
    method = job.selection.config.method if job.selection else "none"
    if method != "infobatch":
        return CarriedTable(None, 0, f"tonight's selection method is {method}: no InfoBatch table to carry")
    if isinstance(table, str):
        return CarriedTable(None, 0, f"InfoBatch starts empty: no table in the champion's checkpoint ({table})")
    try:
        return carry_table(table, champion_root, job.data.root, job.data.loader.split, learnt, out)
    except (StorageError, OSError) as e:  # an unreadable version costs the table, never the warm start
        return CarriedTable(None, 0, f"InfoBatch starts empty: the champion's version is unreadable ({e})")


def warm_job(job: TrainJob, plan: WarmPlan, warm: WarmStartConfig) -> TrainJob:
    """``job`` trained from the champion's weights on the plan's subset, with the warm budget."""
    sampler = job.data.loader.sampler.model_copy(update={"subset": plan.subset})
    loader = job.data.loader.model_copy(update={"sampler": sampler})
    if plan.selector_state and job.selection is not None:  # validated again: a table only for InfoBatch
        selection = SelectionSpec.model_validate({**job.selection.model_dump(), "carried_table": plan.selector_state})
        job = job.model_copy(update={"selection": selection})
    config = job.config.model_copy(update={"init_from": plan.checkpoint, "epochs": warm.epochs,
                                           "lr": job.config.lr * warm.lr_scale,
                                           "warmup_fraction": warm.warmup_fraction, "warmup_min_steps": None})
    return job.model_copy(update={"config": config, "data": job.data.model_copy(update={"loader": loader})})


def plan_summary(plan: WarmPlan | None, why: str) -> dict[str, Any]:
    """What the report and the registry record say about where the weights started."""
    return {"init": "champion" if plan else "scratch", "why": why, **(plan.model_dump() if plan else {})}


def starting_point(warm: WarmStartConfig, registry_dir: str | os.PathLike, job: TrainJob, il_path: str | None,
                   out_dir: str | os.PathLike) -> tuple[TrainJob, dict[str, Any]]:
    """``job`` as tonight's run will train it (warm when ``warm.init`` allows), and the summary of
    where its weights start."""
    plan, why = plan_warm_start(warm, Registry(registry_dir), job, il_path, out_dir)
    return (warm_job(job, plan, warm) if plan else job), plan_summary(plan, why)
