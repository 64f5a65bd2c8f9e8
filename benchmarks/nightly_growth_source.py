"""The growing source of ``benchmarks.nightly_growth``: the night schedule per mode, each seed's
plan of the nights (the images revealed, their labels as the source has them that night, the
corrections and the deletions) and each night's ``.npz``, the source every arm reads.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

# the night schedule: first night's images, images a night after, nights, mislabelled on night 0
# and the night that corrects them, deleted and the night that deletes them
# and the test images every arm is graded on (the first of the 10,000)
FULL = {"first": 30_000, "per_night": 6_000, "nights": 6, "mislabelled": 300, "corrected_on": 3,
        "deleted": 300, "deleted_on": 4, "test_images": 10_000}
QUICK = {"first": 3_000, "per_night": 600, "nights": 3, "mislabelled": 30, "corrected_on": 1,
         "deleted": 30, "deleted_on": 2, "test_images": 2_000}


def fashion_mnist() -> dict[str, np.ndarray]:
    from benchmarks.baselines.plain_bn_cnn import DATA, read_idx
    return {k: read_idx(DATA / f"{p}-{what}-idx{d}-ubyte.gz")
            for k, (p, what, d) in {"x": ("train", "images", 3), "y": ("train", "labels", 1),
                                    "tx": ("t10k", "images", 3), "ty": ("t10k", "labels", 1)}.items()}


def plan_nights(seed: int, sch: dict[str, int], labels: np.ndarray) -> list[dict[str, Any]]:
    """Each night's revealed images (original indices, in reveal order), their labels as the
    source has them that night, and the delta from the night before. The draws do not depend on
    the number of nights, so a shorter run sees the same first nights."""
    rng = np.random.default_rng([seed, 28])
    order = rng.permutation(len(labels))
    bad = np.sort(rng.choice(order[:sch["first"]], sch["mislabelled"], replace=False))
    noisy = labels.astype(np.int64)
    noisy[bad] = (noisy[bad] + rng.integers(1, 10, bad.size)) % 10
    shown_before_delete = order[:sch["first"] + sch["per_night"] * max(sch["deleted_on"] - 1, 0)]
    gone = np.sort(rng.choice(np.setdiff1d(shown_before_delete, bad), sch["deleted"], replace=False))
    nights, prev = [], np.empty(0, np.int64)
    for n in range(sch["nights"]):
        shown = order[:sch["first"] + sch["per_night"] * n]
        if n >= sch["deleted_on"]:
            shown = shown[~np.isin(shown, gone)]
        lab = (noisy if n < sch["corrected_on"] else labels.astype(np.int64))[shown]
        relabelled = bad if n == sch["corrected_on"] and n > 0 else np.empty(0, np.int64)
        nights.append({"night": n, "shown": shown, "labels": lab,
                       "added": int(np.setdiff1d(shown, prev).size), "removed": int(np.setdiff1d(prev, shown).size),
                       "relabelled": int(relabelled.size),
                       "mislabelled": int(np.isin(shown, bad).sum()) if n < sch["corrected_on"] else 0})
        prev = shown
    return nights


def write_night(path: Path, night: dict[str, Any], fm: dict[str, np.ndarray], test_images: int) -> None:
    """The night's source: an ``.npz`` with stable keys and the test split (atomic); every arm
    trains on its images and labels and is graded on its test split."""
    tmp = path.with_name(f".{path.stem}.tmp.npz")
    np.savez(tmp, images=fm["x"][night["shown"]], labels=night["labels"],
             keys=np.asarray([f"fm-{i}" for i in night["shown"]]), test_images=fm["tx"][:test_images],
             test_labels=fm["ty"][:test_images].astype(np.int64))
    os.replace(tmp, path)
