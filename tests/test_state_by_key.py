"""Per-sample state carried by key: IL scores and a champion's per-sample losses of
unchanged samples are reused in the next dataset version; only new, changed and relabelled
samples are scored, and a holdout the IL model may no longer keep forces a full recompute."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from sluice.stages.data.config import IngestConfig, ShardConfig
from sluice.stages.data.shard import shard_dataset
from sluice.stages.load import split_arrays
from sluice.stages.models import build_model
from sluice.stages.select import il_carry
from sluice.stages.select.config import ILModelConfig
from sluice.stages.select.il_carry import il_scores_for_version
from sluice.stages.select.il_store import load_il
from sluice.stages.train.config import TrainConfig
from sluice.stages.train.evaluate import per_sample_losses
from sluice.stages.train.loss_cache import cache_path, losses_by_key
from sluice.storage.artifact import open_artifact
from sluice.storage.checkpoint import save_checkpoint

CFG = ShardConfig(workers=1, progress=False, shard_samples=250, formats=["webdataset", "dali"])
IL = ILModelConfig(epochs=1, batch_size=16, model_kwargs={"width": 4}, progress=False, amp="none")


def _shard(d, out, x, y, keys) -> str:
    """One night: the source (one path, rewritten) holds ``keys``; returns the version's root."""
    src = d / "src.npz"
    np.savez(src, images=x[keys], labels=y[keys], keys=np.array([f"s{k}" for k in keys]))
    return shard_dataset(IngestConfig(source=str(src)), out, CFG).root


def _keys(root, split) -> list[str]:
    with open_artifact(root) as art:
        return art.keys(split)


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """v1: s0..s399. v2: s400..s499 added, a train sample deleted, one changed, one relabelled.
    v3: a holdout sample relabelled. v4: a holdout sample deleted. v5: 250 more samples."""
    d = tmp_path_factory.mktemp("bykey")
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (800, 8, 8, 1), dtype=np.uint8), rng.integers(0, 10, 800)
    out = d / "out"
    v1 = _shard(d, out, x, y, list(range(400)))
    train1, hold1 = _keys(v1, "train"), _keys(v1, "holdout")
    deleted, changed, relabelled = (int(k[1:]) for k in train1[:3])
    x[changed] = 255 - x[changed]
    y[relabelled] = (y[relabelled] + 1) % 10
    keys = [k for k in range(500) if k != deleted]
    v2 = _shard(d, out, x, y, keys)
    y[int(hold1[0][1:])] = (y[int(hold1[0][1:])] + 1) % 10
    v3 = _shard(d, out, x, y, keys)
    keys = [k for k in keys if k != int(hold1[1][1:])]
    v4 = _shard(d, out, x, y, keys)
    v5 = _shard(d, out, x, y, keys + list(range(500, 750)))
    return {"v1": v1, "v2": v2, "v3": v3, "v4": v4, "v5": v5, "dir": d,
            "touched": {f"s{k}" for k in (changed, relabelled)}, "deleted": f"s{deleted}"}


def _il(root, scores, cfg: ILModelConfig = IL):
    with open_artifact(root) as art:
        return il_scores_for_version(cfg, art, lambda s, live: split_arrays(art, s, live_only=live), str(scores))


@pytest.fixture
def counted(monkeypatch):
    """How many samples the stored IL model was asked to score."""
    seen = []
    real = il_carry.score_with

    def score_with(model, config, images, labels, *a, **k):
        seen.append(len(labels))
        return real(model, config, images, labels, *a, **k)
    monkeypatch.setattr(il_carry, "score_with", score_with)
    return seen


def _live_keys(root, split="train") -> dict[str, int]:
    with open_artifact(root) as art:
        keys = art.keys(split)
        return {keys[i]: int(i) for i in art.live(split)}


def test_unchanged_samples_keep_their_il_scores_and_only_the_rest_are_scored(versions, tmp_path, counted):
    v1, v2 = versions["v1"], versions["v2"]
    first = _il(v1, tmp_path)
    assert first.extra["reused_from"] is None and first.extra["scored"] == len(first)
    second = _il(v2, tmp_path)
    old, new = _live_keys(v1), _live_keys(v2)
    fresh = {k for k in new if k not in old} | versions["touched"]
    assert versions["deleted"] not in new and versions["touched"] <= set(new)
    x = second.extra
    assert x["reused_from"] == first.fingerprint and not x["reused"] and x["retrained"] is None
    assert x["scored"] == len(fresh) == sum(counted) and x["reused_samples"] == len(new) - len(fresh)
    same = sorted(set(new) - fresh)
    assert np.array_equal(second.values[[new[k] for k in same]], first.values[[old[k] for k in same]])
    # the new, changed and relabelled ones are the stored model's loss on them as they are now
    stored, why = load_il(second)
    assert stored is not None and stored.trained_on == first.fingerprint, why
    with open_artifact(v2) as art:
        tx, ty = split_arrays(art, "train")
    idx = np.array([new[k] for k in sorted(fresh)])
    want, _ = il_carry.score_with(stored.model(IL), il_carry.resolved_config(IL, "cpu"), tx[idx], ty[idx],
                                  stored.num_classes)
    np.testing.assert_allclose(second.values[idx], want, rtol=1e-5, atol=1e-6)
    assert np.isfinite(second.values).all() and len(second) == len(ty)  # aligned to v2's index space
    again = _il(v2, tmp_path)
    assert again.extra["reused"] and np.array_equal(again.values, second.values)


def test_a_relabelled_or_deleted_holdout_sample_forces_a_full_recompute(versions, tmp_path, counted):
    _il(versions["v2"], tmp_path)
    for v, what in (("v3", "relabelled"), ("v4", "deleted")):
        s = _il(versions[v], tmp_path)
        assert s.extra["reused_from"] is None and s.extra["scored"] == len(s), v
        assert "1 of the" in s.extra["retrained"] and what in s.extra["retrained"]
        stored, _ = load_il(s)
        assert stored.trained_on == s.fingerprint  # a new model, trained on this version's holdout
        with open_artifact(versions[v]) as art:
            assert len(stored.holdout) == art.manifest.split("holdout").live_count
    assert counted == []  # no old model scored anything


def test_a_grown_holdout_retrains_past_refresh_growth(versions, tmp_path, counted):
    _il(versions["v4"], tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    with open_artifact(versions["v4"]) as a4, open_artifact(versions["v5"]) as a5:
        growth = a5.manifest.split("holdout").live_count / a4.manifest.split("holdout").live_count - 1
    assert 0.2 < growth < 0.9
    kept = _il(versions["v5"], tmp_path / "a", IL.model_copy(update={"refresh_growth": 1.0}))
    assert kept.extra["reused_from"] is not None and kept.extra["scored"] == sum(counted) > 0
    retrained = _il(versions["v5"], tmp_path / "b", IL.model_copy(update={"refresh_growth": 0.1}))
    assert retrained.extra["reused_from"] is None and "grew by" in retrained.extra["retrained"]
    assert kept.path.replace(str(tmp_path / "a"), "") == retrained.path.replace(str(tmp_path / "b"), "")


def _checkpoint(path, seed: int = 7) -> None:
    cfg = TrainConfig(model="small_cnn", model_kwargs={"width": 4})
    torch.manual_seed(seed)
    model = build_model(cfg.model, cfg.in_channels, cfg.num_classes, **cfg.model_kwargs)
    save_checkpoint(path, {"compat": cfg.compat(1), "model": model.state_dict(), "config": cfg.model_dump()})


def test_champion_losses_are_cached_by_key(versions, tmp_path):
    v1, v2 = versions["v1"], versions["v2"]
    ckpt = tmp_path / "checkpoint.pt"
    _checkpoint(ckpt)
    old, new = _live_keys(v1), _live_keys(v2)
    i1 = np.array(sorted(old.values()))
    a = losses_by_key(ckpt, v1, "train", i1)
    assert a.computed == i1.size and a.cached == 0 and cache_path(ckpt).is_file()
    b = losses_by_key(ckpt, v1, "train", i1[::-1])
    assert b.computed == 0 and np.array_equal(b.values, a.values[::-1])
    i2 = np.array(sorted(new.values()))
    c = losses_by_key(ckpt, v2, "train", i2)
    fresh = {k for k in new if k not in old} | versions["touched"]
    assert c.computed == len(fresh) and c.cached == i2.size - len(fresh)
    np.testing.assert_allclose(c.values, per_sample_losses(ckpt, v2, "train", i2), rtol=1e-5, atol=1e-6)
    same = sorted(set(new) - fresh)
    pos = {int(i): n for n, i in enumerate(i2)}
    assert np.array_equal(c.values[[pos[new[k]] for k in same]], a.values[np.searchsorted(i1, [old[k] for k in same])])
    assert losses_by_key(ckpt, v2, "train", i2).computed == 0
    _checkpoint(ckpt, seed=8)  # other weights at the same path: the table is not theirs
    assert losses_by_key(ckpt, v2, "train", i2[:10]).computed == 10


def test_a_warm_start_weighs_replay_by_cached_champion_losses(versions, tmp_path):
    from sluice.stages.run.warm import WarmStartConfig
    from warm_plans import plan as planned
    from sluice.storage.lineage import split_key_hashes
    from sluice.storage.registry import Candidate, Registry
    v1, v2 = versions["v1"], versions["v2"]
    _checkpoint(tmp_path / "c.pt")
    reg = Registry(tmp_path / "reg")
    fp = open_artifact(v1).fingerprint
    rec = reg.register(Candidate(tmp_path / "c.pt", dataset_fingerprint=fp, eval_split=f"{fp[:16]}/val", metric="val_acc",
                                 value=0.5, trained_on=(fp, ["train"], split_key_hashes(v1, ["train"]))))
    reg.promote_if_better(rec)
    warm = WarmStartConfig(init="champion", replay="champion_loss", replay_ratio=0.5)
    start = planned(warm, reg, v2, tmp_path / "run", train=TrainConfig(model="small_cnn", model_kwargs={"width": 4}))
    plan, why = start.plan, start.why
    assert plan is not None and plan.replayed > 0, why
    table = cache_path(reg.checkpoint_path(rec))
    assert table.is_file() and np.load(table)["losses"].size >= plan.replayed
