"""Reading ahead from object storage: which tar shards an epoch needs, in the order it first
needs them, and at which batch; the artifact's cache fetches them in that order, a few shards
ahead of the batch the caller has reached (``storage/cache.py``)."""
from __future__ import annotations

from typing import Callable

import numpy as np

from sluice.stages.load.backends import Backend
from sluice.storage.artifact import DatasetArtifact


def shard_plan(order: np.ndarray, start: int, batch_size: int,
               first_indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For the batches of ``order`` from batch ``start`` on, over shards whose first split
    indices are ``first_indices`` (ascending): the shards needed, in the order they are first
    needed, and the batch that first needs each."""
    of = np.searchsorted(first_indices, order[start * batch_size:], side="right") - 1
    plan, first_at = np.unique(of, return_index=True)
    by_need = np.argsort(first_at, kind="stable")
    return plan[by_need], first_at[by_need] // batch_size + start


def prefetch_shards(artifact: DatasetArtifact, split: str, backend: Backend, order: np.ndarray,
                    start: int, batch_size: int) -> Callable[[int], None]:
    """For an artifact on object storage read by a backend that reads the tar shards, start
    fetching this epoch's shards into the cache ahead of need; returns ``advance(batch)``, to be
    called as each batch is handed out (a no-op for a local artifact)."""
    cache = artifact.cache
    if cache is None or not backend.reads_shards:
        return lambda b: None
    shards = artifact.manifest.split(split).shards
    plan, need_batch = shard_plan(order, start, batch_size, np.array([sh.first_index for sh in shards]))
    cache.prefetch([shards[int(s)].tar for s in plan])
    return lambda b: cache.advance(int(np.searchsorted(need_batch, b, side="right")) - 1)
