"""What the loader does with a sample whose stored bytes fail their checksum (``storage/sums.py``).

Every backend checks each sample's bytes as it reads them and hands the damaged ones to its
``Guard`` (in the loader's process) before the batch that would have held them is yielded:

* ``on_corrupt: fail`` (the default): raise ``CorruptSample`` naming the file, the key, the split
  index and how to re-shard. Nothing damaged is ever yielded.
* ``on_corrupt: skip``: drop them from the batch, count them (``Loader.profile()["corrupt_skipped"]``,
  the training summary, the nightly report) and fail with ``TooManyCorruptSamples`` once more than
  ``max_corrupt_fraction`` of the split is known damaged. The batch is still yielded, smaller (or
  empty, where every sample of it was damaged: DALI, which cannot run an empty batch, yields one
  without running it): every rank takes the same number of steps (DDP stays in step; a rank's loss
  is the mean over the samples it has, zero over none).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from sluice.errors import CorruptSample, TooManyCorruptSamples
from sluice.storage.artifact import DatasetArtifact


@dataclass(frozen=True)
class Damage:
    """One sample whose bytes failed their check: its split index, the file, and what was wrong."""
    index: int
    file: str
    reason: str


class Guard:
    """The damage policy of one split: ``fail`` or ``skip`` (up to ``max_fraction`` of it)."""

    def __init__(self, artifact: DatasetArtifact, split: str, policy: str = "fail", max_fraction: float = 0.01,
                 check: bool = True):
        self.artifact, self.split = artifact, split
        self.policy, self.max_fraction = policy, max_fraction
        self.count = artifact.manifest.split(split).count
        sums = artifact.sums(split) if check else None
        self.sums = sums  # None: nothing to check against (checks off, or an artifact without sums)
        self.bad: dict[int, Damage] = {}  # every damaged sample met so far, by split index
        self.skipped = 0  # samples dropped from yielded batches (a sample counts once per epoch)
        self._keys: list[str] | None = None
        self._lock = threading.Lock()

    @classmethod
    def for_config(cls, artifact: DatasetArtifact, split: str, config) -> "Guard":
        return cls(artifact, split, config.on_corrupt, config.max_corrupt_fraction, config.check_samples)

    def column(self, name: str) -> np.ndarray | None:
        """The checksums of one format (``tar`` or ``ffcv``), or None when unchecked."""
        return None if self.sums is None else np.ascontiguousarray(self.sums[name])

    def key(self, index: int) -> str:
        if self._keys is None:
            self._keys = self.artifact.keys(self.split)
        return self._keys[index] if 0 <= index < len(self._keys) else "?"

    def error(self, d: Damage, more: int = 0) -> CorruptSample:
        key = self.key(d.index)
        others = f" ({more} more damaged sample{'s' if more > 1 else ''} in this batch)" if more else ""
        root = self.artifact.root
        return CorruptSample(
            f"{d.file}: sample {key!r} (split {self.split!r}, index {d.index}) is damaged: {d.reason}{others}. "
            f"The artifact at {root} changed on disk after it was written. Re-shard: remove {root} and run "
            f"`sluice shard` on its source again (same fingerprint, same indices); `sluice verify {root}` "
            "lists every damaged sample; loader.on_corrupt=skip trains without them",
            file=d.file, key=key, index=d.index, split=self.split)

    def found(self, damage: Iterable[Damage]) -> None:
        """Damaged samples met (before any batch holding them is yielded): raise under ``fail``;
        under ``skip`` remember them, and raise past the threshold."""
        damage = list(damage)
        if not damage:
            return
        if self.policy == "fail":
            raise self.error(damage[0], len(damage) - 1)
        with self._lock:
            for d in damage:
                self.bad.setdefault(d.index, d)
            n = len(self.bad)
        if n > self.max_fraction * self.count:
            first = next(iter(self.bad.values()))
            raise TooManyCorruptSamples(
                f"{n} of the {self.count} samples of split {self.split!r} are damaged, more than "
                f"loader.max_corrupt_fraction={self.max_fraction:g} allows; the first: "
                f"{self.error(first)}")

    def dropped(self, n: int) -> None:
        with self._lock:
            self.skipped += n

    def take(self, damage: list[Damage]) -> None:
        """``found`` and ``dropped`` at once: these samples were left out of the next batch."""
        self.found(damage)
        self.dropped(len(damage))


def mismatch(index: int, file: str, got: int, want: int, what: str = "image member") -> Damage:
    """The damage of a sample whose checksum ``got`` is not the ``want`` written for it."""
    return Damage(int(index), file, f"{what} checksum {int(got):08x}, written as {int(want):08x}")


def check_rows(guard: Guard, column: np.ndarray | None, actual: np.ndarray, idx: np.ndarray, file: str,
               what: str) -> list[Damage]:
    """Damage for each position where ``actual`` (checksums of what was read) differs from the
    stored column at ``idx``."""
    if column is None:
        return []
    wrong = np.flatnonzero(column[idx] != actual)
    return [mismatch(idx[k], file, actual[k], column[idx[k]], what) for k in wrong]
