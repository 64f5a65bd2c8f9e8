"""The loader's order part for one source: the sampler's order over a split's live samples, as
the draw a mixture plan takes from that source (``SamplerOrder``), and the checks a saved
position passes before the loader resumes from it."""
from __future__ import annotations

from typing import Any

import numpy as np

from sluice.errors import LoaderError
from sluice.stages.contracts import Sampler
from sluice.stages.load.samplers import LiveSampler, SamplerConfig, build_sampler


class SamplerOrder:
    """One source's sampler (``config``: shuffle, sequential, curriculum, weighted, ...) as its
    draw in a mixture plan: every epoch one pass in the sampler's order. ``live`` (a version
    that removed samples keeps their indices) holds the indices any order may hold;
    ``custom_sampler`` replaces the configured one and is kept to ``live`` as well."""
    fixed = False  # a sampler's order is recomputed each time (importance sampling reweights it)

    def __init__(self, sampler: SamplerConfig, batch_size: int, n: int, shard_sizes: list[int],
                 live: np.ndarray | None, *, world_size: int, scores: np.ndarray | None,
                 custom_sampler: Sampler | None):
        self.config, self.batch_size, self.n, self.world_size = sampler, batch_size, n, world_size
        self._shard_sizes, self._live, self._scores = shard_sizes, live, scores
        self._custom = custom_sampler is not None
        if custom_sampler is not None and live is not None:
            custom_sampler = LiveSampler(custom_sampler, live, n)
        self.sampler = custom_sampler or build_sampler(sampler, n, batch_size * world_size, scores, shard_sizes, live)
        if len(self.sampler) == 0:
            raise LoaderError("the sampler yields no samples")

    def __len__(self) -> int:
        return len(self.sampler)

    def __call__(self, epoch: int, count: int, global_batch: int) -> np.ndarray:
        """The sampler's order of ``epoch`` as ordered for ``global_batch`` (only a curriculum's
        pacing depends on it: an epoch begun at another world size keeps its order)."""
        if count != len(self.sampler):
            raise LoaderError(f"a source ordered by its sampler gives one pass of its {len(self.sampler)} "
                              f"samples an epoch, not {count}: weights, repeat and choose need several "
                              "sources (the plan's own draws)")
        if global_batch in (0, self.batch_size * self.world_size) or self._custom or self.config.kind != "curriculum":
            return self.sampler.epoch_order(epoch)
        return build_sampler(self.config, self.n, global_batch, self._scores,
                             self._shard_sizes, self._live).epoch_order(epoch)


def check_state(state: dict[str, Any], *, split: str, world_size: int, batch_size: int,
                batches: int) -> tuple[int, int]:
    """The ``(world_size, batch_size)`` a saved loader state was made at, once it is shown to
    belong to this split and to hold a position this loader can resume (``batches``: an epoch's
    batches at this world size and batch); else a ``LoaderError``."""
    if state.get("split") != split:
        raise LoaderError(f"loader state has split={state.get('split')!r}, this loader {split!r}")
    epoch, nxt, world, batch = (state.get(k) for k in ("epoch", "next_batch", "world_size", "batch_size"))
    if not _is_int(epoch) or epoch < 0:
        raise LoaderError(f"loader state has epoch={epoch!r}; it must be an integer >= 0")
    if not _is_int(world) or world < 1 or not _is_int(batch) or batch < 1:
        raise LoaderError(f"loader state has world_size={world!r}, batch_size={batch!r}; both must be integers >= 1")
    if not _is_int(nxt) or nxt < 0 or (world == world_size and batch == batch_size and nxt > batches):
        raise LoaderError(f"loader state has next_batch={nxt!r}; it must be an integer from 0 to "
                          f"the batches in an epoch ({batches} at this world size and batch)")
    return int(world), int(batch)


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))
