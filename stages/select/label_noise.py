"""Label noise: injected for experiments (a seeded fraction of labels flipped, and which), and
the rate a scoring pass assumes when ``label_noise`` is ``auto``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from sluice.errors import SelectionError
from sluice.storage.scores import Scores

if TYPE_CHECKING:  # the config module imports the method registry, whose methods import this
    from sluice.stages.select.config import SelectionConfig


@dataclass(frozen=True)
class LabelNoise:
    """Labels after injection, and exactly which indices were flipped (sorted)."""
    labels: np.ndarray
    flipped: np.ndarray
    fraction: float
    seed: int
    num_classes: int

    @property
    def mask(self) -> np.ndarray:
        m = np.zeros(len(self.labels), dtype=bool)
        m[self.flipped] = True
        return m

    def record(self) -> dict:
        """JSON-ready record of the injection (to store beside an experiment's results)."""
        return {"fraction": self.fraction, "seed": self.seed, "num_classes": self.num_classes,
                "flipped": self.flipped.tolist()}


def inject_label_noise(labels: np.ndarray, fraction: float, num_classes: int,
                       seed: int = 0) -> LabelNoise:
    """Flip ``round(fraction * N)`` labels, chosen by ``seed``, each to a different class drawn
    uniformly; the same (labels, fraction, seed) always flips the same indices the same way."""
    y = np.asarray(labels).astype(np.int64)
    if not 0.0 <= fraction < 1.0:
        raise SelectionError(f"noise fraction must be in [0, 1), got {fraction}")
    if num_classes < 2:
        raise SelectionError("label noise needs at least 2 classes")
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise SelectionError(f"labels must lie in [0, {num_classes})")
    rng = np.random.default_rng(seed)
    k = int(round(fraction * y.size))
    flipped = np.sort(rng.choice(y.size, size=k, replace=False))
    shift = rng.integers(1, num_classes, size=k)  # never 0: the new class always differs
    out = y.copy()
    out[flipped] = (y[flipped] + shift) % num_classes
    return LabelNoise(out, flipped, fraction, seed, num_classes)


def resolve_label_noise(config: "SelectionConfig", il_scores: np.ndarray | Scores | None) -> "SelectionConfig":
    """``config`` with ``label_noise: auto`` set to 1 - the IL model's accuracy on its holdout,
    read off the IL scores record: the rate of noise the IL model's own labels showed."""
    if config.params.get("label_noise") != "auto":
        return config
    acc = il_scores.extra.get("holdout_accuracy") if isinstance(il_scores, Scores) else None
    if acc is None:
        raise SelectionError("label_noise='auto' reads the noise rate off the IL model's "
                             "holdout accuracy: pass the IL Scores record (not a bare array) "
                             "or give label_noise a number")
    return config.model_copy(update={"params": {**config.params, "label_noise": round(max(0.0, 1.0 - acc), 4)}})
