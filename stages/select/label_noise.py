"""Known label noise for experiments: flip a seeded fraction of labels and remember which."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sluice.errors import SelectionError


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
