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
import math

from sluice.errors import SourceError
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


def split_fractions(cfg: IngestConfig, has_test: bool) -> dict[str, float]:
    """The share of the source's train split each of our splits but train draws, by setting
    name (the source's own test split, when it has one, stays test: no fraction)."""
    out = {"val_fraction": cfg.val_fraction, "holdout_fraction": cfg.holdout_fraction}
    if not has_test:
        out["test_fraction"] = cfg.test_fraction
    return out


def min_class_size(cfg: IngestConfig, has_test: bool) -> int:
    """The fewest images a class needs so that each split with a nonzero fraction f expects at
    least one of them: ``max(2, ceil(1 / smallest f))``; 1 when no split draws from train."""
    fractions = [f for f in split_fractions(cfg, has_test).values() if f > 0]
    return max(2, math.ceil(1 / min(fractions) - 1e-9)) if fractions else 1


def check_class_sizes(src: Source, cfg: IngestConfig) -> None:
    """Refuse a source (one that knows its classes' sizes from its listing: an image folder)
    with a class too small for the split fractions, naming the class, its count, the
    fractions and the settings to change.

    A sample's split is drawn from a hash of its key (``split_of``), independently of every
    other sample, so a class of n images puts on average n * f of them in a split of fraction f,
    and none at all with probability (1 - f)^n: with n < 1 / f that split most likely never
    sees the class (validation then cannot tell whether the model learnt it). Counted over the
    source's train split before ``limit`` (a quick run's cut says nothing about the data)."""
    counts = src.class_counts()
    if not cfg.check_classes or counts is None:
        return
    has_test = "test" in src.split_sizes()
    need = min_class_size(cfg, has_test)
    small = {c: n for c, n in counts.items() if n < need}
    if not small:
        return
    fractions = {k: f for k, f in split_fractions(cfg, has_test).items() if f > 0}
    f = min(fractions.values())
    worst = min(small, key=lambda c: small[c])
    listed = ", ".join(f"{c!r} ({n})" for c, n in sorted(small.items(), key=lambda kv: (kv[1], kv[0]))[:10])
    more = f" and {len(small) - 10} more" if len(small) > 10 else ""
    settings = ", ".join(f"{k}={v:g}" for k, v in fractions.items())
    raise SourceError(
        f"{src.uri}: {len(small)} class(es) have fewer than {need} images in the train split: {listed}{more}. "
        f"Each sample's split is drawn from a hash of its key, so with {settings} a split of fraction {f:g} "
        f"expects {small[worst] * f:.2g} of class {worst!r}'s {small[worst]} images and gets none with "
        f"probability {(1 - f) ** small[worst]:.0%}. Add images (at least {need} per class), merge or remove "
        f"the class, set ingest.{min(fractions, key=fractions.get)} to 0 (or raise it: a class needs "
        "ceil(1 / fraction) images), or set ingest.check_classes=false to shard it anyway")
