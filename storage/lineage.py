"""What a model trained on, kept so that it is never graded on those samples.

A sample is named by its stable key (the artifact's ``keys.txt``, the same key the split rule
hashes), so "trained on" is a set of keys and holds across dataset versions: a champion trained
on last night's version can be checked against tonight's ``val`` exactly, sample by sample. The
set is stored as sorted 64-bit hashes of the keys (8 bytes a sample, a plain ``.npy`` read with
``allow_pickle=False``) next to the model's record in the registry, so the check still works
after the version it trained on has been deleted. Two keys colliding in 64 bits would make the
check refuse a fair comparison (never allow an unfair one); at a million samples each side the
chance is about 1 in 10^7.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from sluice.errors import GradedOnTrainingData
from sluice.storage import atomic
from sluice.storage.artifact import open_artifact


class TrainedOn(BaseModel):
    """Which dataset version and splits a model learnt from (an IL model's holdout included)."""
    model_config = ConfigDict(extra="forbid")
    dataset_fingerprint: str
    splits: list[str]
    count: int = Field(ge=0, description="distinct sample keys in those splits")
    keys_file: str = Field(description="sorted uint64 key hashes, relative to the registry root")


def hash_keys(keys: Iterable[str]) -> np.ndarray:
    """Each key's 64-bit hash, in the keys' order (aligned to a split index)."""
    return np.fromiter((int.from_bytes(hashlib.blake2b(k.encode(), digest_size=8).digest(), "big")
                        for k in keys), dtype=np.uint64)


def key_hashes(keys: Iterable[str]) -> np.ndarray:
    """Sorted, distinct 64-bit hashes of sample keys."""
    return np.unique(hash_keys(keys))


def split_key_hashes(artifact_root: str | os.PathLike, splits: Iterable[str]) -> np.ndarray:
    """The key hashes of every sample in ``splits`` of one dataset version."""
    art = open_artifact(artifact_root)
    counts = art.manifest.counts()
    keys: list[str] = []
    for s in splits:
        if counts.get(s, 0):
            keys += art.keys(s)
    return key_hashes(keys)


def save_hashes(path: Path, hashes: np.ndarray) -> None:
    def fill(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # a file object: np.save would append ".npy" to a bare path
            np.save(f, hashes.astype(np.uint64), allow_pickle=False)
    atomic.write_with(path, fill)


def load_hashes(path: Path) -> np.ndarray:
    return np.load(path, allow_pickle=False)


def overlap(trained: np.ndarray, graded: np.ndarray) -> int:
    """How many of the graded samples the model trained on."""
    return int(np.intersect1d(trained, graded, assume_unique=True).size)


IMAGE_SPLIT_RULE = ("ingest.seed, val_fraction or test_fraction) or the model trained on a schema-1 version, "
                    "whose splits were a permutation of the sample count")


def ensure_unseen(model: str, trained: np.ndarray, artifact_root: str | os.PathLike, split: str,
                  trained_where: str, graded: np.ndarray | None = None, *,
                  split_rule: str = IMAGE_SPLIT_RULE) -> int:
    """Refuse (``GradedOnTrainingData``) to grade ``model`` on ``split`` of ``artifact_root`` when
    it trained on any of that split's samples; returns the number of samples checked. ``graded``:
    that split's key hashes, when the caller has them already; ``split_rule``: the settings whose
    change moves samples between splits (the error names them)."""
    graded = split_key_hashes(artifact_root, [split]) if graded is None else graded
    n = overlap(trained, graded)
    if n:
        raise GradedOnTrainingData(
            f"refusing to grade model {model} on {split!r} of {artifact_root}: it trained on {n} of "
            f"that split's {graded.size} samples ({trained_where}), so its score there would be "
            f"inflated. This happens when the split rule changed ({split_rule}). Grade on a split it did not train on "
            "(promotion.eval_split), or keep the old split rule.")
    return int(graded.size)
