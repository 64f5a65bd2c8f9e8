"""Per-rank sizes under a batch scale: a run resumed at another world size with
``train.resize=keep_global_batch`` multiplies every per-rank size (a loader's batch, a selector's
candidates and picks) by old world / new world, so each step trains the same global batch
(``train/elastic.py``). Shared by the data specs, the selection spec and the trainer."""
from __future__ import annotations

from fractions import Fraction

from sluice.errors import TrainError


def scaled(size: int, scale: Fraction | int, what: str) -> int:
    """``size × scale`` as a whole number per rank, or a ``TrainError`` saying why not."""
    v = size * Fraction(scale)
    if v.denominator != 1 or v < 1:
        raise TrainError(f"resuming with train.resize=keep_global_batch needs {what} of {float(v):g} per rank "
                         f"({size} x {scale}), not a whole number: use a world size that divides the global "
                         "batch, or train.resize=scale_global_batch")
    return int(v)
