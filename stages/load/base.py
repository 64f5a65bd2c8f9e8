"""The one loader contract (``contracts.ResumableLoader``), implemented once for every loader: the
image ``Loader`` (one artifact or a mixture of several), the ``TokenLoader`` (packed rows of one
token artifact or a mixture) and the ``ArrayLoader`` (arrays in memory) differ only in how they
read a batch and where their position lives (``cursor``).

What they share, here:

* **Epochs.** ``set_epoch(e)`` always goes to epoch ``e``'s first batch, as PyTorch's
  ``DistributedSampler`` does (``for e in range(E): loader.set_epoch(e); for b in loader: ...``
  reads every epoch in order, and ``set_epoch`` of an epoch already read reads it again, which
  is what an evaluation does). Iterating again without it continues where the last iteration
  stopped: the rest of the epoch, or, after its end, the next epoch. So a resumed loader
  (``load_state_dict``) continues by iterating, without ``set_epoch``.
* ``len(loader)``: the current epoch's batches on this rank (the same on every rank).
* **Profiling**: the seconds per stage of reading (the loader's ``reads``), its own ``timings``,
  the samples it handed out and its wall time; ``profile()``, ``bottleneck()``,
  ``profile_report()`` and ``report()`` (what the run's summary shows).
* **Sources**: ``names`` (one per source) and, where batches carry ``source_counts``, what this
  rank served each source since the run began (``served``), kept on the batches' device (no
  sync per batch) and carried in the loader state.
* ``device``: anything ``torch.device`` accepts (``"cpu"``, ``"cuda:1"``, a ``torch.device``).
"""
from __future__ import annotations

import time
from typing import Any, Iterator, Protocol

import numpy as np
import torch

from sluice.stages.contracts import Batch, LoaderReport
from sluice.stages.load.profile import bottleneck, gather_profile, profile_report
from sluice.stages.load.timings import Timings

__all__ = ["LoaderBase", "Cursor", "as_device"]


def as_device(device: str | int | torch.device | None, default: str = "cpu") -> torch.device:
    """``device`` as a ``torch.device`` (``None``: ``default``): a string, an index or a device."""
    return torch.device(default if device is None else device)


class Cursor(Protocol):
    """Where a loader is in its epochs (``epochs.EpochCursor`` for samples, ``token_cursor.TokenCursor``
    for packed tokens): the same moves, whatever a position counts."""
    epoch: int

    def batches(self) -> int: ...
    def restart(self, epoch: int) -> None: ...
    def iteration_start(self) -> tuple[int, int]: ...


class LoaderBase:
    """The loader contract over a ``cursor`` and a ``_produce`` of batches (see the module
    docstring). A subclass sets ``names``, ``device``, ``cursor`` and ``timings`` and implements
    ``_produce(epoch, start)`` (a generator that moves the cursor past each batch before yielding
    it), ``state_dict``/``load_state_dict`` and, where it reads through backends, ``_reads()``."""
    names: list[str]
    device: torch.device
    cursor: Cursor
    timings: Timings
    backend_name: str | None = None
    backend_reason: str | None = None
    served_unit = "samples"
    samples_seen: int = 0
    wall_s: float = 0.0  # time inside iteration, the caller's own work included
    _iter_t0: float | None = None  # start of the iteration in progress (a caller may stop mid-epoch)
    _served: torch.Tensor | None = None  # this rank's per-source counts since the last restore (device)
    _served_before: np.ndarray | None = None  # restored from a state

    # ------------------------------------------------------------------ epochs
    @property
    def epoch(self) -> int:
        return self.cursor.epoch

    def __len__(self) -> int:
        return self.cursor.batches()

    def set_epoch(self, epoch: int) -> None:
        """Go to epoch ``epoch``'s first batch (an epoch already read is read again)."""
        self.cursor.restart(int(epoch))

    def __iter__(self) -> Iterator[Batch]:
        """This rank's batches from the cursor's position to the epoch's end (a finished epoch:
        the next one)."""
        epoch, start = self.cursor.iteration_start()
        t0 = self._iter_t0 = time.perf_counter()
        produced = self._produce(epoch, start)
        try:
            for batch in produced:
                self.samples_seen += len(batch)
                if batch.source_counts is not None:
                    self._serve(batch.source_counts)
                yield batch
        finally:
            produced.close()
            self.wall_s += time.perf_counter() - t0
            self._iter_t0 = None

    def _produce(self, epoch: int, start: int) -> Iterator[Batch]:
        raise NotImplementedError

    # ------------------------------------------------------------------ sources
    def _serve(self, counts: torch.Tensor) -> None:
        self._served = counts.clone() if self._served is None else self._served + counts.to(self._served.device)

    @property
    def served(self) -> np.ndarray:
        """Samples (or input tokens) this rank served per source since the run began."""
        now = self._served.cpu().numpy().astype(np.int64) if self._served is not None else 0
        before = self._served_before if self._served_before is not None else np.zeros(len(self.names), np.int64)
        return before + now

    def _served_state(self) -> dict[str, Any]:
        return {"served": self.served.tolist()}

    def _restore_served(self, state: dict[str, Any], *legacy: str) -> None:
        """This rank's served counts from ``state`` (written by this rank at this world size)."""
        for key in ("served", *legacy):
            if key in state:
                self._served_before = np.asarray(state[key], np.int64)
                self._served = None
                return

    @property
    def mixture_changes(self) -> list[dict[str, Any]]:
        """Each change of the mixture's counts: ``{"epoch", "old", "new"}`` (for the run report)."""
        return []

    def served_by_source(self) -> dict[str, Any]:
        """What this rank served each source over the run, and the mixture's recorded changes."""
        return {"unit": self.served_unit, "served": dict(zip(self.names, self.served.tolist())),
                "changes": self.mixture_changes}

    # ------------------------------------------------------------------ profiling
    def _reads(self) -> Any:
        """What reads the batches (a backend, or several as one): its timings join the profile."""
        return None

    def profile(self) -> dict[str, float]:
        """Seconds spent per stage so far (storage ``read``, ``decode``, ``augment``,
        ``transfer``, ``gather``, ``pack``, and the caller's ``wait`` for data), with ``samples``
        seen and ``wall`` (seconds inside iteration): where the loading time goes."""
        wall = self.wall_s + (time.perf_counter() - self._iter_t0 if self._iter_t0 else 0.0)
        return gather_profile(self._reads(), self.timings, self.samples_seen, wall)

    def bottleneck(self) -> dict[str, Any]:
        """Which resource bounds the loader (``verdict``: storage-, decode- or compute-bound) and
        how long the caller waited for data; see ``profile.bottleneck``."""
        return bottleneck(self.profile())

    def _cache(self) -> Any:
        return None

    def profile_report(self) -> str:
        return profile_report(self.profile(), self.bottleneck(), self.backend_name or type(self).__name__,
                              self.backend_reason or "", self._cache())

    def report(self) -> LoaderReport:
        """What the run's summary shows of this loader (this rank's numbers)."""
        b = self.bottleneck()
        by_source = self.served_by_source() if self._counts_sources() else None
        return LoaderReport(backend=self.backend_name, choice=self.backend_reason, verdict=b["verdict"],
                            summary=b["summary"], corrupt_skipped=int(self.profile().get("corrupt_skipped", 0)),
                            served_unit=self.served_unit, served=by_source["served"] if by_source else None,
                            changes=by_source["changes"] if by_source else [])

    def _counts_sources(self) -> bool:
        """Whether batches carry per-source counts (a breakdown worth reporting)."""
        return False

    def close(self) -> None:
        """Release what reading holds (files, threads, worker processes)."""

    def __enter__(self) -> "LoaderBase":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
