"""No model is graded on samples it trained on: lineage by key, checked at every promotion."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sluice.errors import GradedOnTrainingData, RegistryError
from sluice.stages.kinds.image import ImageData, ImageKind
from sluice.stages.run.grading import champion_lineage, grade
from sluice.storage.artifact import open_artifact
from sluice.storage.lineage import ensure_unseen, key_hashes, overlap, split_key_hashes
from sluice.storage.registry import Candidate, Registry


def _ckpt(tmp_path: Path) -> Path:
    p = tmp_path / "c.pt"
    p.write_bytes(b"weights")
    return p


def test_key_hashes_count_exactly_the_shared_keys():
    a = key_hashes([f"train-{i:06d}" for i in range(1000)])
    b = key_hashes([f"train-{i:06d}" for i in range(990, 1500)] + ["train-000990"])  # a repeat
    assert a.dtype == np.uint64 and a.size == 1000 and b.size == 510
    assert overlap(a, b) == 10 and overlap(a, key_hashes(["test-000001"])) == 0
    assert np.array_equal(key_hashes(["x", "y"]), key_hashes(["y", "x"]))  # stable, order-free


def test_registry_keeps_what_each_model_trained_on(tmp_path):
    reg = Registry(tmp_path / "reg")
    hashes = key_hashes(["a", "b", "c"])
    rec = reg.register(Candidate(_ckpt(tmp_path), dataset_fingerprint="f" * 64, eval_split="f/val", metric="val_acc",
                                 value=0.9, trained_on=("f" * 64, ["train", "holdout"], hashes)))
    again = reg.get(rec.model_id)
    assert again.trained_on.splits == ["train", "holdout"] and again.trained_on.count == 3
    assert np.array_equal(reg.trained_hashes(again), hashes)
    legacy = reg.register(Candidate(_ckpt(tmp_path), dataset_fingerprint="f" * 64, eval_split="f/val", metric="val_acc",
                                    value=0.9))
    assert legacy.trained_on is None and reg.trained_hashes(legacy) is None


def test_a_model_is_refused_on_its_own_training_samples_and_allowed_elsewhere(fmnist_artifact):
    root = fmnist_artifact.root
    trained = split_key_hashes(root, ["train"])
    assert trained.size == fmnist_artifact.manifest.counts()["train"]
    kind = ImageKind()
    version = kind.version_of([root])
    with pytest.raises(GradedOnTrainingData, match=rf"'train' of .*trained on {trained.size} of"):
        grade(kind, "never-read.pt", "candidate", trained, "train", version, "train", kind.key_hashes(version, ["train"]),
              data=ImageData(source=str(root)), files={}, facts={})
    assert ensure_unseen("candidate", trained, root, "val", "train") == fmnist_artifact.manifest.counts()["val"]
    # One training sample slipped into what it is graded on: refused, naming the count.
    one_val_key = key_hashes([open_artifact(root).keys("val")[0]])
    with pytest.raises(GradedOnTrainingData, match="trained on 1 of"):
        ensure_unseen("candidate", np.union1d(trained, one_val_key), root, "val", "train")


def test_a_legacy_champion_is_checked_against_its_own_version_or_refused(tmp_path, fmnist_artifact):
    reg = Registry(tmp_path / "reg")
    fp = fmnist_artifact.manifest.fingerprint
    rec = reg.register(Candidate(_ckpt(tmp_path), dataset_fingerprint=fp, eval_split=f"{fp[:16]}/val", metric="val_acc",
                                 value=0.9))  # no lineage: recorded before it existed
    kind = ImageKind()
    version = kind.version_of([fmnist_artifact.root])
    datasets = Path(fmnist_artifact.root).parent.parent  # the datasets folder: <name>/<version>
    hashes, where = champion_lineage(reg, rec, kind, datasets, version)  # re-read from the version it names
    counts = fmnist_artifact.manifest.counts()
    assert hashes.size == counts["train"] + counts["holdout"] and "re-read" in where
    with pytest.raises(GradedOnTrainingData, match="gone"):
        champion_lineage(reg, rec, kind, tmp_path / "no-datasets-here", version)


def test_a_champion_that_moved_while_grading_is_not_compared(tmp_path):
    reg = Registry(tmp_path / "reg")
    first = reg.register(Candidate(_ckpt(tmp_path), dataset_fingerprint="a", eval_split="a/val", metric="val_acc", value=0.8))
    reg.promote_if_better(first)
    other = reg.register(Candidate(_ckpt(tmp_path), dataset_fingerprint="b", eval_split="b/val", metric="val_acc", value=0.9))
    reg.promote_if_better(other, champion_value_now=0.7, graded_champion=first.model_id)  # graded `first`
    late = reg.register(Candidate(_ckpt(tmp_path), dataset_fingerprint="c", eval_split="c/val", metric="val_acc", value=0.95))
    with pytest.raises(RegistryError, match="changed"):
        reg.promote_if_better(late, champion_value_now=0.7, graded_champion=first.model_id)
    assert reg.champion().model_id == other.model_id
