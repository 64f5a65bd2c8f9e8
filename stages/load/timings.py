"""Where the loading time goes: seconds per stage, shared by the loader, its backends and the
readers they use (a module of its own, so readers need not import the backend registry)."""
from __future__ import annotations

import threading


class Timings(dict):
    """Cumulative seconds per loading stage: ``read`` (storage), ``decode``, ``augment``,
    ``transfer``, ``gather``, and the caller's ``wait``. Stages that run in parallel workers add
    up their worker-seconds. Thread-safe; pickles as a plain dict of floats."""

    _lock = threading.Lock()

    def add(self, key: str, seconds: float) -> None:
        with self._lock:
            self[key] = self.get(key, 0.0) + seconds

    def merge(self, other: dict[str, float]) -> None:
        for k, v in other.items():
            self.add(k, v)
