"""Process helpers shared by the stages that fork workers (shard pools, FFCV's writer,
DataLoader workers)."""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def fork_safe() -> Iterator[None]:
    """Collect garbage, then freeze the heap around a fork: a child must never run finalizers of
    its parent's garbage (a leftover DALI pipeline's ``__del__`` blocks forever in a child)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def default_sigterm() -> None:
    """Pool initializer: a forked worker dies quietly on SIGTERM (``Pool.terminate``) instead of
    running a handler it inherited from its parent (Prefect's prints a TerminationSignal
    traceback into the flow log)."""
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


# The context a forked pool worker received from its initializer (see ``map_forked``); set only
# inside pool workers, never in the parent.
_WORKER_CONTEXT: list = []


def _init_worker(context) -> None:
    default_sigterm()
    _WORKER_CONTEXT[:] = [context]


def _call_in_worker(fn, task):
    return fn(_WORKER_CONTEXT[0], task)


def map_forked(fn, context, tasks: list, workers: int) -> Iterator:
    """``fn(context, task)`` for each task, in order: inline for one worker, else in a pool of
    forked processes that inherit ``context`` (an open source, say) instead of pickling it per
    task. ``fn`` must be importable by name (a module-level function)."""
    import functools
    import multiprocessing as mp
    if workers <= 1 or len(tasks) <= 1:
        for t in tasks:
            yield fn(context, t)
        return
    with fork_safe():
        pool = mp.get_context("fork").Pool(workers, initializer=_init_worker, initargs=(context,))
    with pool:
        yield from pool.imap(functools.partial(_call_in_worker, fn), tasks)
