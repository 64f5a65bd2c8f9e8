"""Warm starts: the champion's weights, trained on what it has not seen plus a replay."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from sluice.errors import CheckpointMismatch, ConfigError, LoaderError
from sluice.stages.load.samplers import SamplerConfig, build_sampler
from sluice.stages.models import build_model
from sluice.stages.train.config import TrainConfig
from sluice.stages.train.initial_weights import load_initial_weights, trained_weights
from sluice.stages.run.replay import REPLAY_POLICIES, ReplayContext
from sluice.stages.run.warm import WarmStartConfig
from sluice.storage.checkpoint import load_checkpoint, save_checkpoint


def test_a_subset_sampler_draws_only_and_all_of_its_subset(tmp_path):
    sub = np.array([3, 9, 10, 42, 77], dtype=np.int64)
    np.save(tmp_path / "s.npy", sub)
    s = build_sampler(SamplerConfig(kind="shuffle", subset=str(tmp_path / "s.npy")), 100, 2)
    orders = [s.epoch_order(e) for e in range(3)]
    assert len(s) == 5 and all(sorted(o.tolist()) == sub.tolist() for o in orders)
    assert any(not np.array_equal(orders[0], o) for o in orders[1:])  # still shuffled
    w = np.zeros(100)
    w[[9, 42]] = 1.0  # weights stay split-aligned: only 9 and 42 can be drawn
    s = build_sampler(SamplerConfig(kind="weighted", subset=str(tmp_path / "s.npy")), 100, 2, scores=w)
    assert set(s.epoch_order(0).tolist()) <= {9, 42}
    np.save(tmp_path / "bad.npy", np.array([1, 100]))
    with pytest.raises(LoaderError, match="outside"):
        build_sampler(SamplerConfig(subset=str(tmp_path / "bad.npy")), 100, 2)
    with pytest.raises(LoaderError, match="shard_block"):
        build_sampler(SamplerConfig(kind="shard_block", subset=str(tmp_path / "s.npy")), 100, 2, shard_sizes=[100])


def _ckpt(path: Path, cfg: TrainConfig, ema: bool = False) -> dict:
    torch.manual_seed(7)
    model = build_model(cfg.model, cfg.in_channels, cfg.num_classes, **cfg.model_kwargs)
    state = {"compat": cfg.compat(1), "model": model.state_dict(), "config": cfg.model_dump(),
             "ema": {f"module.{k}": v + 1 for k, v in model.state_dict().items()} if ema else None}
    save_checkpoint(path, state)
    return state


def test_initial_weights_are_the_checkpoints_ema_and_another_architecture_is_refused(tmp_path):
    cfg = TrainConfig(model="small_cnn")
    state = _ckpt(tmp_path / "a.pt", cfg, ema=True)
    model = build_model("small_cnn", 1, 10)
    load_initial_weights(model, tmp_path / "a.pt", cfg.model_dump())
    want = trained_weights(load_checkpoint(tmp_path / "a.pt"))
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    k = next(iter(want))
    assert not torch.equal(want[k], state["model"][k])  # the EMA's weights, not the raw ones
    with pytest.raises(CheckpointMismatch, match="num_classes"):
        load_initial_weights(build_model("small_cnn", 1, 7), tmp_path / "a.pt",
                             cfg.model_copy(update={"num_classes": 7}).model_dump())


def _ctx(old, count, losses=None, il=None):
    return ReplayContext(old=np.asarray(old), count=count, rng=np.random.default_rng(0),
                         champion_losses=lambda idx: losses[idx], irreducible=lambda: il)


def test_replay_policies_pick_distinct_old_samples_by_their_rule():
    old = np.arange(100, 200)
    for name in REPLAY_POLICIES.names():
        losses = np.zeros(200)
        losses[150:] = 5.0  # the champion still gets the upper half wrong
        il = np.zeros(200)
        il[180:] = 5.0  # ... and 180-199 are noise no model learns
        pick = REPLAY_POLICIES.get(name)(_ctx(old, 20, losses, il))
        assert pick.size == 20 and np.unique(pick).size == 20 and np.isin(pick, old).all(), name
        if name == "champion_loss":
            assert (pick >= 150).all()  # weights ~0 below 150
        if name == "reducible_loss":
            assert ((pick >= 150) & (pick < 180)).all()
    with pytest.raises(ConfigError, match="irreducible"):
        REPLAY_POLICIES.get("reducible_loss")(_ctx(old, 5, np.ones(200), None))
    with pytest.raises(ValueError, match="replay"):
        WarmStartConfig(replay="nope")


def test_a_missing_or_corrupt_champion_falls_back_under_auto_and_is_refused_under_champion(tmp_path,
                                                                                           fmnist_artifact):
    from sluice.storage.lineage import split_key_hashes
    from warm_plans import plan as planned
    from sluice.storage.registry import Candidate, Registry
    root = fmnist_artifact.root
    reg = Registry(tmp_path / "reg")
    half = split_key_hashes(root, ["train"])[::2]
    ckpt = tmp_path / "good.pt"
    _ckpt(ckpt, TrainConfig(model="small_cnn"))
    fp = fmnist_artifact.manifest.fingerprint  # the champion saw half of this very version
    rec = reg.register(Candidate(ckpt, dataset_fingerprint=fp, eval_split="f/val", metric="val_acc", value=0.5,
                                 trained_on=(fp, ["train"], half)))
    reg.promote_if_better(rec)
    start = planned(WarmStartConfig(init="auto"), reg, root, tmp_path / "run")
    plan, why = start.plan, start.why
    assert plan is not None and plan.new > 0 and plan.replayed == min(plan.new, half.size), why
    reg.checkpoint_path(rec).write_bytes(b"not a checkpoint")  # damaged at rest
    start = planned(WarmStartConfig(init="auto"), reg, root, tmp_path / "run")
    plan, why = start.plan, start.why
    assert plan is None and "unreadable" in why
    with pytest.raises(ConfigError, match="unreadable"):
        planned(WarmStartConfig(init="champion"), reg, root, tmp_path / "run")
    reg.checkpoint_path(rec).unlink()  # gone
    start = planned(WarmStartConfig(init="auto"), reg, root, tmp_path / "run")
    plan, why = start.plan, start.why
    assert plan is None and "unreadable" in why
