"""The deterministic train / holdout / val / test split of a source's samples.

A sample's split is a function of its stable key (``Source.describe``: a file's class and name,
a tar member's key, an array's index) and the split config, never of how many samples exist:
the key and ``seed`` are hashed to a point in [0, 1), and the fractions cut that interval. A
source that grows, loses samples or is reordered leaves every remaining sample in its split,
so a model is never graded next night on a sample it trained on (the split fractions hold in
expectation, not exactly). Artifact schema 2; schema 1 permuted the sample count, so any growth
reshuffled membership.
"""
from __future__ import annotations

import hashlib

from sluice.stages.data.config import IngestConfig
from sluice.stages.data.sources.base import Source

SplitPlan = dict[str, list[tuple[str, int]]]  # our split -> [(source split, source index)]


def key_point(key: str, seed: int) -> float:
    """``key``'s point in [0, 1) for ``seed``: the same on every machine and Python run."""
    digest = hashlib.blake2b(f"{seed}/{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0 ** 64


def split_of(key: str, cfg: IngestConfig, has_test: bool) -> str:
    """The split a sample of the source's train split with ``key`` belongs to: val is
    [0, val_fraction), test (for a source without one) the next test_fraction, holdout the top
    holdout_fraction, train the rest. Changing holdout_fraction (RHO-LOSS on or off) only moves
    samples between train and holdout: val never gains a sample a model trained on."""
    u = key_point(key, cfg.seed)
    test = 0.0 if has_test else cfg.test_fraction
    if u < cfg.val_fraction:
        return "val"
    if u < cfg.val_fraction + test:
        return "test"
    return "holdout" if u >= 1.0 - cfg.holdout_fraction else "train"


def plan_splits(src: Source, cfg: IngestConfig) -> SplitPlan:
    """Assign source samples to train / holdout / val / test by their keys.

    The source's own test split stays test. Each sample of its train split goes where
    :func:`split_of` says; each split keeps source order so shards read the source sequentially.
    """
    sizes = src.split_sizes()
    if cfg.limit:
        sizes = {s: min(n, cfg.limit) for s, n in sizes.items()}
    has_test = "test" in sizes
    plan: SplitPlan = {"train": [], "holdout": [], "val": [], "test": []}
    for i in range(sizes.get("train", 0)):
        plan[split_of(src.describe("train", i)[0], cfg, has_test)].append(("train", i))
    if has_test:
        plan["test"] = [("test", i) for i in range(sizes["test"])]
    return plan
