"""The deterministic train / holdout / val / test split of a source's samples."""
from __future__ import annotations

import numpy as np

from sluice.stages.data.config import IngestConfig
from sluice.stages.data.sources.base import Source

SplitPlan = dict[str, list[tuple[str, int]]]  # our split -> [(source split, source index)]


def plan_splits(src: Source, cfg: IngestConfig) -> SplitPlan:
    """Deterministically assign source samples to train / holdout / val / test.

    The source's own test split stays test. Its train split is permuted with ``seed`` and cut
    into holdout, val (and test, if the source has none) and train; each split keeps source
    order so shards read the source sequentially.
    """
    sizes = src.split_sizes()
    if cfg.limit:
        sizes = {s: min(n, cfg.limit) for s, n in sizes.items()}
    n = sizes.get("train", 0)
    perm = np.random.default_rng(cfg.seed).permutation(n)
    n_hold = int(round(n * cfg.holdout_fraction))
    n_val = int(round(n * cfg.val_fraction))
    n_test = 0 if "test" in sizes else int(round(n * cfg.test_fraction))
    cuts = np.cumsum([n_hold, n_val, n_test])
    parts = np.split(perm, cuts)
    plan: SplitPlan = {
        "train": [("train", int(i)) for i in np.sort(parts[3])],
        "holdout": [("train", int(i)) for i in np.sort(parts[0])],
        "val": [("train", int(i)) for i in np.sort(parts[1])],
        "test": ([("test", i) for i in range(sizes["test"])] if "test" in sizes
                 else [("train", int(i)) for i in np.sort(parts[2])]),
    }
    return plan
