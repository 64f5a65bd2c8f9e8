"""Warm starts: tonight's run begins from the champion's weights and trains on what it has not
seen plus a replay of what it has, instead of every sample from random weights — for every kind
of data, through its ``warm_sources`` (images: samples; tokens: documents).

What the champion has seen is its registry lineage (``storage/lineage.py``): the key hashes of
the samples it trained on, which include its own parent's. Each source's version the champion
trained on must be an ancestor of tonight's (``storage/ancestry.py``: the manifest's
``ancestors``). A sample of tonight's train split is *new* when its key is not among the
champion's, or when a version since the champion's gave it new content (or a new label) or
removed and re-added it: the champion learnt something else under that key. The run trains for
``warm.epochs`` over new + replay with the recipe's schedule at ``warm.lr_scale`` of its peak and
its own warm-up (no floor in steps: the floor guards random weights), and its own lineage is the
champion's plus tonight's training splits, so a warm model is never graded on anything its
ancestors saw. The plan is made before the job is assembled (``assemble.py`` takes it).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from sluice.errors import ConfigError, StorageError
from sluice.stages.kinds import DataKind, DatasetVersion
from sluice.stages.run.replay import REPLAY_POLICIES, ReplayContext
from sluice.stages.select.infobatch_carry import CarriedTable, checkpoint_table
from sluice.stages.train.initial_weights import architecture_of
from sluice.stages.train.config import TrainConfig
from sluice.storage.checkpoint import load_checkpoint
from sluice.storage.lineage import hash_keys, save_hashes
from sluice.storage.registry import ModelRecord, Registry
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
    max_steps: int | None = Field(None, ge=1, description="the warm run's step budget in place of train.max_steps "
                                  "(None: train.max_steps where set, else warm.epochs)")
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
    subsets: dict[str, str]  # source name -> .npy of its split indices trained on (new + replayed)
    replayed_keys: str  # .npy of the replayed samples' key hashes
    new: int
    replayed: int
    policy: str
    epochs: float
    max_steps: int | None = None
    lr_scale: float
    warmup_fraction: float
    # a selection table carried from the champion (select/infobatch_carry.py): the .npz the
    # selector starts from (None: it starts empty), its matched rows, and why
    selector_state: str | None = None
    selector_rows_carried: int = 0
    selector_why: str = ""

    def warm_config(self, config: TrainConfig) -> TrainConfig:
        """``config`` from the champion's weights with the warm budget and schedule."""
        return config.model_copy(update={"init_from": self.checkpoint, "epochs": self.epochs,
                                         "max_steps": self.max_steps or config.max_steps,
                                         "lr": config.lr * self.lr_scale, "warmup_fraction": self.warmup_fraction,
                                         "warmup_min_steps": None})


class Start(BaseModel):
    """Where tonight's weights start: the warm plan, or scratch and why."""
    model_config = ConfigDict(extra="forbid")
    plan: WarmPlan | None = None
    why: str

    def summary(self) -> dict[str, Any]:
        """What the report and the registry record say about where the weights started."""
        return {"init": "champion" if self.plan else "scratch", "why": self.why,
                **(self.plan.model_dump() if self.plan else {})}


def champion_versions(champ: ModelRecord, version: DatasetVersion) -> dict[str, str]:
    """The champion's version of each source (source name -> fingerprint): its record's, or for a
    record of one source from before they were kept, its dataset fingerprint under tonight's
    single source's name."""
    recorded = (champ.metrics.get("data") or {}).get("sources")
    if recorded:
        return dict(recorded)
    if champ.trained_on is not None and len(version.sources) == 1:
        return {version.sources[0].name: champ.trained_on.dataset_fingerprint}
    return {}


def _refuse(warm: WarmStartConfig, reason: str) -> Start:
    if warm.init == "champion":
        raise ConfigError(f"warm.init=champion cannot start from the champion: {reason} "
                          "(warm.init=auto falls back to scratch instead)")
    return Start(why=reason)


def plan_start(warm: WarmStartConfig, kind: DataKind, version: DatasetVersion, train: TrainConfig,
               selection_method: str, registry_dir: str | os.PathLike, il_path: str | None,
               out_dir: str | os.PathLike, split: str = "train") -> Start:
    """Where tonight's run starts: from the champion when ``warm`` allows and it can, on its
    unseen samples plus a replay (files written to ``out_dir``), else from scratch, and why."""
    if warm.init == "scratch":
        return Start(why="warm.init is scratch")
    why = kind.replay_refusal(warm.replay)
    if why:
        return _refuse(warm, why)
    reg = Registry(registry_dir)
    champ = reg.champion()
    if champ is None:
        return _refuse(warm, "there is no champion yet")
    why = kind.champion_refusal(champ.metrics.get("data") or {})
    if why:
        return _refuse(warm, f"champion {champ.model_id}: {why}")
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
    why = kind.warm_refusal(champ.metrics.get("data") or {}, version)
    if why:
        return _refuse(warm, f"champion {champ.model_id}: {why}")
    ours = architecture_of(kind.config_for(train, version).model_dump())
    if theirs != ours:
        return _refuse(warm, f"champion {champ.model_id} is a {theirs}, tonight's model a {ours}")
    versions = champion_versions(champ, version)
    sources = kind.warm_sources(version, split, versions)
    if isinstance(sources, str):
        return _refuse(warm, f"champion {champ.model_id}: {sources}")
    if not versions or not set(versions) & {s.name for s in sources}:
        return _refuse(warm, f"champion {champ.model_id} trained on none of tonight's sources")
    train_hashes = hash_keys(k for s in sources for k in s.keys)
    live = np.concatenate([s.live for s in sources])
    redo = set().union(*(s.redo for s in sources))
    keys = [k for s in sources for k in s.keys]
    other = np.fromiter((k in redo for k in keys), bool, count=len(keys)) if redo else np.zeros(len(keys), bool)
    seen = np.isin(train_hashes, hashes) & ~other
    old, new = np.flatnonzero(seen & live), np.flatnonzero(live & ~seen)
    if new.size == 0:
        return _refuse(warm, f"tonight's {split} split holds nothing champion {champ.model_id} has not seen")
    count = warm.replay_count(old.size, new.size)
    ctx = ReplayContext(old=old, count=count, rng=np.random.default_rng([train.seed, 0x5EED]),
                        champion_losses=lambda idx: kind.champion_losses(ckpt, version, split, idx),
                        irreducible=lambda: open_scores(il_path).values if il_path else None)
    replay = np.asarray(REPLAY_POLICIES.get(warm.replay)(ctx), dtype=np.int64) if count else \
        np.empty(0, dtype=np.int64)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    chosen = np.union1d(new, replay)
    edges = np.cumsum([0] + [len(s.keys) for s in sources])
    subsets = {}
    for i, s in enumerate(sources):
        mine = chosen[(chosen >= edges[i]) & (chosen < edges[i + 1])] - edges[i]
        path = out / (f"warm_subset-{s.name}.npy")
        np.save(path, mine.astype(np.int64), allow_pickle=False)
        subsets[s.name] = str(path)
    save_hashes(out / "warm_replayed_keys.npy", np.unique(train_hashes[replay]))
    carried = _carry_selector(kind, selection_method, table, versions, version, split, old, out)
    plan = WarmPlan(parent_model=champ.model_id, parent_version=champ.trained_on.dataset_fingerprint,
                    checkpoint=str(ckpt), subsets=subsets, replayed_keys=str(out / "warm_replayed_keys.npy"),
                    new=int(new.size), replayed=int(replay.size), policy=warm.replay, epochs=warm.epochs,
                    max_steps=warm.max_steps, lr_scale=warm.lr_scale, warmup_fraction=warm.warmup_fraction, selector_state=carried.path,
                    selector_rows_carried=carried.rows, selector_why=carried.why)
    return Start(plan=plan, why=f"from champion {champ.model_id}: {new.size} new {kind.samples} + "
                                f"{replay.size} replayed ({warm.replay})")


def _carry_selector(kind: DataKind, method: str, table: tuple[np.ndarray, np.ndarray] | str,
                    versions: dict[str, str], version: DatasetVersion, split: str, learnt: np.ndarray,
                    out: Path) -> CarriedTable:
    """InfoBatch's table from the champion, matched into tonight's index for the ``learnt``
    samples (new, changed and relabelled ones start unseen), when tonight's run selects with it."""
    if method != "infobatch":
        return CarriedTable(None, 0, f"tonight's selection method is {method}: no InfoBatch table to carry")
    if isinstance(table, str):
        return CarriedTable(None, 0, f"InfoBatch starts empty: no table in the champion's checkpoint ({table})")
    try:
        return kind.carry_selector(table, versions, version, split, learnt, out)
    except (StorageError, OSError) as e:  # an unreadable version costs the table, never the warm start
        return CarriedTable(None, 0, f"InfoBatch starts empty: the champion's version is unreadable ({e})")
