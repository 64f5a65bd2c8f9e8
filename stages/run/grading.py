"""Grading a model on a split it never trained on: the candidate and the champion alike.

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
from sluice.stages.train.evaluate import evaluate_checkpoint, token_checkpoint_pass
from sluice.storage.lineage import ensure_unseen, key_hashes, split_key_hashes
from sluice.storage.registry import ModelRecord, Registry
from sluice.storage.tokens import open_token_split


def trained_splits(needs_il: bool) -> list[str]:
    """The splits a pipeline model learns from: train, and holdout when an IL model was fit on it
    (its scores steer which samples the model trains on)."""
    return ["train", "holdout"] if needs_il else ["train"]


def grade(checkpoint: str | os.PathLike, name: str, trained: np.ndarray, trained_where: str,
          artifact_root: str | os.PathLike, split: str, graded: np.ndarray | None = None) -> dict[str, Any]:
    """Evaluate ``checkpoint`` on ``split`` after proving it trained on none of its samples
    (``graded``: the split's key hashes, read once for every model graded on it)."""
    checked = ensure_unseen(name, trained, artifact_root, split, trained_where, graded)
    return {**evaluate_checkpoint(checkpoint, artifact_root, split), "unseen_checked": checked}


def candidate_lineage(artifact_root: str | os.PathLike, fingerprint: str, needs_il: bool,
                      inherited: np.ndarray | None = None) -> tuple[str, list[str], np.ndarray]:
    """(fingerprint, splits, key hashes) a candidate trained on this version learnt from; a warm
    start ``inherited`` its parent's, which count as its own."""
    splits = trained_splits(needs_il)
    hashes = split_key_hashes(artifact_root, splits)
    if inherited is not None:
        hashes = np.union1d(hashes, inherited)
    return fingerprint, splits, hashes


def champion_lineage(reg: Registry, champ: ModelRecord, datasets_dir: str | os.PathLike) -> tuple[np.ndarray, str]:
    """The champion's trained key hashes and a phrase saying where they come from.

    A record from before lineage was kept has none: its version is found under ``datasets_dir``
    by fingerprint and its train and holdout splits re-read from it (holdout too whatever its
    selection was: a superset can only refuse more, never allow an unfair comparison). When that version is gone too, nothing can prove the champion unseen on
    tonight's split, and grading it is refused.
    """
    hashes = reg.trained_hashes(champ)
    if hashes is not None and champ.trained_on is not None:
        return hashes, f"{champ.trained_on.splits} of version {champ.trained_on.dataset_fingerprint[:16]}"
    root = Path(datasets_dir) / champ.dataset_fingerprint[:16]
    splits = trained_splits(needs_il=True)
    if not (root / "manifest.json").is_file():
        raise GradedOnTrainingData(
            f"champion {champ.model_id} has no record of what it trained on, and its dataset version "
            f"{root} is gone, so nothing proves it unseen on tonight's split. Re-register it, or "
            "promote by hand after checking.")
    return split_key_hashes(root, splits), f"{splits} of version {champ.dataset_fingerprint[:16]} (re-read)"


# ------------------------------------------------------------------ text: token artifacts

def token_key_hashes(sources: list[dict[str, Any]], splits: list[str]) -> np.ndarray:
    """The key hashes of every document in ``splits`` of each source's version, each key named
    by its source (``<name>/<key>``: two sources may both have a document ``0``)."""
    keys: list[str] = []
    for s in sources:
        for split in splits:
            if s["counts"].get(split, 0):
                keys += [f"{s['name']}/{k}" for k in open_token_split(s["root"], split).keys]
    return key_hashes(keys)


def token_lineage(data: dict[str, Any]) -> tuple[str, list[str], np.ndarray]:
    """(fingerprint, splits, key hashes) a language model trained on ``data``'s train splits learnt from."""
    return data["fingerprint"], ["train"], token_key_hashes(data["sources"], ["train"])


def grade_tokens(checkpoint: str | os.PathLike, name: str, trained: np.ndarray, trained_where: str,
                 data: dict[str, Any], split: str, graded: np.ndarray, *, seq_len: int,
                 batch_size: int) -> dict[str, Any]:
    """``checkpoint``'s loss per token on every document of ``split`` of the sources that hold
    one, after proving it trained on none of them (``graded``: their key hashes)."""
    checked = ensure_unseen(name, trained, "the text sources", split, trained_where, graded,
                            split_rule="text.shard.seed, val_fraction, holdout_fraction or test_fraction, "
                                       "or a source renamed onto another's documents")
    sources = [(s["name"], s["root"]) for s in data["sources"] if s["counts"].get(split, 0)]
    return {**token_checkpoint_pass(checkpoint, sources, split, seq_len=seq_len, batch_size=batch_size),
            "unseen_checked": checked}
