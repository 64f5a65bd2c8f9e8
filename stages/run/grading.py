"""Grading a model on a split it never trained on: the candidate and the champion alike, for
every kind of data (its ``key_hashes`` name the samples, its ``grade`` measures them).

Every evaluation that feeds promotion goes through here, so "no model is graded on data it
trained on" is checked sample by sample (``storage.lineage``), not assumed from the split rule:
the rule keeps a key in its split across versions, but a changed rule (seed, fractions) or a
champion trained on a schema-1 version breaks that, and the check says so instead of promoting
on an inflated score.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from sluice.errors import GradedOnTrainingData
from sluice.stages.kinds import DataConfig, DataKind, DatasetVersion
from sluice.storage.lineage import ensure_unseen
from sluice.storage.registry import ModelRecord, Registry


def trained_splits(needs_il: bool) -> list[str]:
    """The splits a pipeline model learns from: train, and holdout when an IL model was fit on it
    (its scores steer which samples the model trains on)."""
    return ["train", "holdout"] if needs_il else ["train"]


def grade(kind: DataKind, checkpoint: str | os.PathLike, name: str, trained: np.ndarray, trained_where: str,
          version: DatasetVersion, split: str, graded: np.ndarray, *, data: DataConfig, files: dict[str, str],
          facts: dict[str, Any]) -> dict[str, Any]:
    """Evaluate ``checkpoint`` on ``split`` after proving it trained on none of its samples
    (``graded``: the split's key hashes, read once for every model graded on it)."""
    checked = ensure_unseen(name, trained, version.root if len(version.sources) == 1 else "the sources", split,
                            trained_where, graded, split_rule=kind.split_rule)
    return {**kind.grade(checkpoint, version, split, data=data, files=files, facts=facts).model_dump(),
            "unseen_checked": checked}


def candidate_lineage(kind: DataKind, version: DatasetVersion, needs_il: bool,
                      inherited: np.ndarray | None = None) -> tuple[str, list[str], np.ndarray]:
    """(fingerprint, splits, key hashes) a candidate trained on this version learnt from; a warm
    start ``inherited`` its parent's, which count as its own."""
    splits = trained_splits(needs_il)
    hashes = kind.key_hashes(version, splits)
    if inherited is not None:
        hashes = np.union1d(hashes, inherited)
    return version.fingerprint, splits, hashes


def champion_lineage(reg: Registry, champ: ModelRecord, kind: DataKind, datasets_dir: str | os.PathLike,
                     version: DatasetVersion) -> tuple[np.ndarray, str]:
    """The champion's trained key hashes and a phrase saying where they come from.

    A record from before lineage was kept has none: the kind re-reads them from its version when
    that is still on disk (``reread_lineage``). When it cannot, nothing can prove the champion
    unseen on tonight's split, and grading it is refused.
    """
    hashes = reg.trained_hashes(champ)
    if hashes is not None and champ.trained_on is not None:
        return hashes, f"{champ.trained_on.splits} of version {champ.trained_on.dataset_fingerprint[:16]}"
    again = kind.reread_lineage(champ.dataset_fingerprint, Path(datasets_dir), version.names)
    if again is None:
        raise GradedOnTrainingData(
            f"champion {champ.model_id} has no record of what it trained on, and its dataset version "
            f"{champ.dataset_fingerprint[:16]} is gone, so nothing proves it unseen on tonight's split. "
            "Re-register it, or promote by hand after checking.")
    return again, f"{trained_splits(needs_il=True)} of version {champ.dataset_fingerprint[:16]} (re-read)"
