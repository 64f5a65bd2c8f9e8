"""A source that grows night after night, run as the deployment runs it (a fresh process per
night): every model is graded on samples it never trained on, a warm night trains the champion on
what is new plus a replay, and a night that cannot be fair is refused, leaving the registry as it was."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sluice.storage.lineage import overlap, split_key_hashes
from sluice.storage.registry import Registry
from tests.nights import night, result


def _version(data: Path, fingerprint: str) -> Path:
    return next(p.parent for p in (data / "datasets").rglob("manifest.json") if fingerprint[:16] in str(p))


@pytest.mark.slow
def test_growing_source_warm_nights_and_fair_grading(tmp_path):
    data = tmp_path / "data"
    reg = Registry(data / "registry")

    # Night 0: 400 images, from scratch.
    rc, out = night(data, 400)
    assert rc == 0, out[-3000:]
    first = result(out)
    assert first["promoted"] and first["warm"]["init"] == "scratch" and first["unseen"]["samples_checked"] > 0

    # Night 1: 700 images. Warm: the champion's weights on the new samples plus half as many replayed.
    warm = {"init": "champion", "replay": "champion_loss", "replay_ratio": 0.5}
    rc, out = night(data, 700, warm=warm, train={"max_steps": 8, "batch_size": 32, "log_samples": True})
    assert rc == 0, out[-3000:]
    second = result(out)
    w = second["warm"]
    assert w["init"] == "champion" and w["parent_model"] == first["model_id"]
    assert w["new"] > 0 and w["replayed"] == round(0.5 * w["new"])
    (subset_file,) = w["subsets"].values()  # one source
    subset = set(np.load(subset_file).tolist())
    assert len(subset) == w["new"] + w["replayed"]
    trained = {i for line in (Path(second["run_dir"]) / "samples-rank0.jsonl").read_text().splitlines()
               for i in json.loads(line)["indices"]}
    assert trained and trained <= subset  # nothing outside new + replay was trained on

    # The champion was re-graded on the grown version's val, which holds none of its samples.
    assert second["champion_before"] == first["model_id"]
    assert second["unseen"]["champion_samples_checked"] == second["unseen"]["samples_checked"] > 0
    parent, child = reg.get(first["model_id"]), reg.get(second["model_id"])
    assert parent.trained_on.dataset_fingerprint != child.trained_on.dataset_fingerprint
    grown_val = split_key_hashes(_version(data, child.trained_on.dataset_fingerprint), ["val"])
    assert overlap(reg.trained_hashes(parent), grown_val) == 0
    # The warm model's record names its parent and what it replayed, and inherits all its parent saw.
    assert child.warm_start["parent_model"] == parent.model_id and child.warm_start["replayed"] == w["replayed"]
    assert np.load(data / "registry" / child.warm_start["replayed_keys"]).size == w["replayed"]
    assert np.isin(reg.trained_hashes(parent), reg.trained_hashes(child)).all()

    # Another split rule puts the champion's training samples into val: refused, registry unchanged.
    models, champion = {r.model_id for r in reg.list()}, reg.champion().model_id
    rc, out = night(data, 700, seed=5)
    assert rc != 0 and "GradedOnTrainingData" in out and f"champion {champion}" in out, out[-3000:]
    assert {r.model_id for r in reg.list()} == models and reg.champion().model_id == champion

    # A champion of another architecture: `champion` refuses naming why, `auto` trains from scratch.
    other = {"train": {"model": "small_cnn", "max_steps": 4, "batch_size": 32}}
    rc, out = night(data, 700, warm={"init": "champion"}, **other)
    assert rc != 0 and "warm.init=champion cannot start from the champion" in out, out[-3000:]
    rc, out = night(data, 700, warm={"init": "auto"}, **other)
    assert rc == 0, out[-3000:]
    assert result(out)["warm"]["init"] == "scratch"
