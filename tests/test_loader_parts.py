"""The loader's parts on their own: the prefetch thread (and where it must not be used), the
remote shard plan, and which thread drives each backend."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from sluice.process_rules import fork_safe, in_helper_thread
from sluice.stages.load import Loader
from sluice.stages.load.backends.webdataset import WebDatasetBackend
from sluice.stages.load.prefetch import prefetched
from sluice.stages.load.remote import shard_plan
from sluice.stages.load.timings import Timings


def _spy(n: int, seen: list, fail_at: int | None = None, fork: bool = False):
    def make():
        seen.append(threading.current_thread())
        for k in range(n):
            if k == fail_at:
                raise ValueError(f"item {k} is bad")
            if fork:
                with fork_safe():
                    pass
            yield k
    return make


def test_prefetch_runs_ahead_in_a_helper_thread_and_in_order():
    seen: list = []
    timings = Timings()
    assert list(prefetched(_spy(20, seen), depth=3, forks=False, timings=timings)) == list(range(20))
    assert seen[0] is not threading.current_thread() and seen[0].name == "sluice-loader"
    assert "wait" in timings
    # depth 0, or work that forks: the caller's own thread
    for depth, forks in ((0, False), (3, True)):
        seen.clear()
        assert list(prefetched(_spy(2, seen, fork=forks), depth, forks, Timings())) == [0, 1]
        assert seen == [threading.current_thread()]


def test_prefetch_raises_the_threads_error_and_stops_when_abandoned():
    seen: list = []
    with pytest.raises(ValueError, match="item 4 is bad"):
        list(prefetched(_spy(10, seen, fail_at=4), 2, False, Timings()))
    seen.clear()
    it = prefetched(_spy(10_000, seen), 2, False, Timings())
    assert next(it) == 0
    it.close()  # an abandoned epoch: the thread, blocked on a full queue, ends
    assert not seen[0].is_alive()


def test_work_that_forks_is_refused_in_the_prefetch_thread():
    """A backend that forks but did not say so (``forks_per_epoch``) fails at its fork, in the
    caller, instead of risking a deadlocked child (``sluice.process_rules``, rule 2)."""
    with pytest.raises(RuntimeError, match="helper thread 'sluice-loader'"):
        list(prefetched(_spy(3, [], fork=True), 2, False, Timings()))


@pytest.mark.parametrize("workers,inline", [(0, False), (1, True)])
def test_the_loader_drives_a_backend_that_forks_from_the_callers_thread(fmnist_artifact, monkeypatch,
                                                                         workers, inline):
    """WebDataset with DataLoader workers forks each epoch: no prefetch thread; without workers
    it forks nothing and runs ahead in the helper thread. Either way, the same batches."""
    where: list = []
    epoch = WebDatasetBackend.epoch

    def spy(self, *a, **k):
        where.append((threading.current_thread(), in_helper_thread()))
        yield from epoch(self, *a, **k)
    monkeypatch.setattr(WebDatasetBackend, "epoch", spy)
    L = Loader(fmnist_artifact.root, backend="webdataset", workers=workers, batch_size=100, prefetch=2,
               sampler={"kind": "shuffle", "seed": 3})
    got = np.concatenate([i.numpy() for _, _, i in L])
    assert np.array_equal(got, L.epoch_indices(0))
    assert L.backend().forks_per_epoch is inline
    assert (where[0][0] is threading.current_thread()) is inline and where[0][1] is not inline


def test_the_remote_plan_lists_shards_in_order_of_first_need():
    firsts = np.array([0, 10, 20, 30])  # four shards of ten samples
    order = np.array([25, 26, 3, 4, 12, 27, 1, 2, 35, 36, 14, 15, 16, 17, 18])
    plan, need = shard_plan(order, 0, 5, firsts)
    assert plan.tolist() == [2, 0, 1, 3] and need.tolist() == [0, 0, 0, 1]
    plan, need = shard_plan(order, 1, 5, firsts)  # resumed at batch 1: what is still to come
    assert plan.tolist() == [2, 0, 3, 1] and need.tolist() == [1, 1, 1, 2]
