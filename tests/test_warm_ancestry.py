"""Warm starts follow dataset ancestry: the champion's version must be one tonight's
descends from (recorded in the manifest, so gc cannot break it), and a sample relabelled, given
new pixels or deleted since the champion's version is never replayed as "already learnt"."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from sluice.stages.data.config import IngestConfig, ShardConfig
from sluice.stages.data.shard import shard_dataset
from sluice.stages.train.config import TrainConfig
from sluice.stages.run.warm import WarmStartConfig
from warm_plans import job, plan as planned
from sluice.storage.ancestry import changes_since, is_ancestor
from sluice.storage.artifact import DatasetArtifact
from sluice.storage.checkpoint import save_checkpoint
from sluice.storage.lineage import split_key_hashes
from sluice.storage.manifest import read_manifest
from sluice.storage.registry import Candidate, Registry

CFG = ShardConfig(workers=1, progress=False, shard_samples=200, formats=["webdataset"])


def _write(path, x, y, keys) -> str:
    np.savez(path, images=x, labels=y, keys=np.array([f"s{k}" for k in keys]))
    return str(path)


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """v0: 400 samples; v1: +100; v2: +100, and s5's pixels change, s7 is relabelled, s3 deleted."""
    d = tmp_path_factory.mktemp("anc")
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (600, 8, 8, 1), dtype=np.uint8), rng.integers(0, 10, 600)
    out, src = d / "out", d / "src.npz"
    v0 = shard_dataset(IngestConfig(source=_write(src, x[:400], y[:400], range(400))), out, CFG)
    v1 = shard_dataset(IngestConfig(source=_write(src, x[:500], y[:500], range(500))), out, CFG)
    x2, y2 = x.copy(), y.copy()
    x2[5] = 255 - x2[5]
    y2[7] = (y2[7] + 3) % 10
    keep = [k for k in range(600) if k != 3]
    v2 = shard_dataset(IngestConfig(source=_write(src, x2[keep], y2[keep], keep)), out, CFG)
    whole = shard_dataset(IngestConfig(source=_write(src, x2[keep], y2[keep], keep)), d / "other",
                          CFG.model_copy(update={"incremental": False}))
    return {"v": [v0, v1, v2], "whole": whole, "dir": d}


def test_manifest_records_every_ancestor(versions):
    v0, v1, v2 = versions["v"]
    m2 = read_manifest(v2.root)
    assert m2.ancestors == [v1.manifest.fingerprint, v0.manifest.fingerprint]
    assert is_ancestor(m2, v0.manifest.fingerprint) and is_ancestor(m2, v2.manifest.fingerprint)
    assert not is_ancestor(read_manifest(v0.root), v2.manifest.fingerprint)
    assert read_manifest(versions["whole"].root).ancestors == []


def test_changes_since_an_ancestor_collect_every_delta(versions, tmp_path):
    v0, v1, v2 = versions["v"]
    since = changes_since(v2.root, v0.manifest.fingerprint)
    assert not isinstance(since, str)
    assert since.versions == 2 and since.relabelled == {"s7"} and since.changed == {"s5"} and since.removed == {"s3"}
    assert changes_since(v1.root, v0.manifest.fingerprint).relabelled == set()
    why = changes_since(versions["whole"].root, v0.manifest.fingerprint)
    assert isinstance(why, str) and "not an ancestor" in why
    # a version in between gone (gc): still an ancestor, but what changed cannot be told
    copy = tmp_path / "out"
    shutil.copytree(versions["dir"] / "out", copy)
    shutil.rmtree(copy / v1.root.rsplit("/", 1)[-1])
    m = read_manifest(copy / v2.root.rsplit("/", 1)[-1])
    assert is_ancestor(m, v0.manifest.fingerprint)
    why = changes_since(copy / v2.root.rsplit("/", 1)[-1], v0.manifest.fingerprint)
    assert isinstance(why, str) and "gone" in why


def _champion(reg: Registry, version, tmp_path) -> None:
    cfg = TrainConfig(model="small_cnn")
    ckpt = save_checkpoint(tmp_path / "c.pt", {"config": cfg.model_dump(mode="json"), "compat": {"model": "small_cnn"}})
    rec = reg.register(Candidate(ckpt, dataset_fingerprint=version.manifest.fingerprint, eval_split=f"{version.manifest.fingerprint[:16]}/val",
                                 metric="acc", value=0.5,
                                 trained_on=(version.manifest.fingerprint, ["train"], split_key_hashes(version.root, ["train"]))))
    assert reg.promote_if_better(rec).promoted


TRAIN = TrainConfig(model="small_cnn", lr=0.2, warmup_min_steps=100)


def test_warm_plan_treats_changed_relabelled_and_new_as_new(versions, tmp_path):
    v0, _, v2 = versions["v"]
    reg = Registry(tmp_path / "reg")
    _champion(reg, v0, tmp_path)
    warm = WarmStartConfig(init="champion", replay_ratio=1.0)
    start = planned(warm, reg, v2.root, tmp_path / "run", train=TRAIN)
    plan, why = start.plan, start.why
    assert plan is not None, why
    art = DatasetArtifact(v2.root)
    keys = art.keys("train")
    live = set(art.live("train").tolist())
    subset = set(np.load(plan.subsets[v2.root.split("/")[-2]]).tolist())
    assert subset <= live  # the deleted sample and s5's old pixels are never trained on
    champion_keys = set(DatasetArtifact(v0.root).keys("train"))
    for i in live:
        k = keys[i]
        if k not in champion_keys or k in ("s5", "s7"):
            assert i in subset, k  # every sample the champion did not learn as it is now
    expected_new = sum(1 for i in live if keys[i] not in champion_keys or keys[i] in ("s5", "s7"))
    assert plan.new == expected_new
    # the warm run's own warm-up: no floor in steps
    warm_job = job(v2.root, start=start, train=TRAIN)
    assert warm_job.config.warmup_min_steps is None and warm_job.config.warmup_fraction == warm.warmup_fraction
    assert warm_job.config.lr == pytest.approx(0.2 * warm.lr_scale) and warm_job.config.init_from == plan.checkpoint


def test_warm_start_refused_when_the_champions_version_is_no_ancestor(versions, tmp_path):
    v0 = versions["v"][0]
    reg = Registry(tmp_path / "reg")
    _champion(reg, v0, tmp_path)
    start = planned(WarmStartConfig(init="auto"), reg, versions["whole"].root, tmp_path / "r", train=TRAIN)
    assert start.plan is None and "not an ancestor" in start.why
    from sluice.errors import ConfigError
    with pytest.raises(ConfigError, match="not an ancestor"):
        planned(WarmStartConfig(init="champion"), reg, versions["whole"].root, tmp_path / "r", train=TRAIN)
