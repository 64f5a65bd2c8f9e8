"""Process helpers shared by the stages that start other processes (shard pools, FFCV's writer,
DataLoader workers, torchrun): fork safely, never outlive the process that started you, and
never wait forever on a worker that died."""
from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
from typing import Callable, Iterator


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


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies (``PR_SET_PDEATHSIG``).

    Called first thing in a child (a forked worker, or torchrun through ``preexec_fn``): after a
    ``kill -9`` of the parent, nothing it started goes on writing files or training as an orphan.
    If the parent died before the call took effect, the signal is sent at once. Linux only; a
    no-op elsewhere. Linux sends the signal when the parent *thread* that forked exits, so fork
    from a thread that lives as long as the child (the main thread, or the thread that waits).
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, int(sig))  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)


def die_with_parent_preexec() -> Callable[[], None] | None:
    """A ``subprocess.Popen(preexec_fn=...)`` that ties the child to this process (see
    ``die_with_parent``); None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()
    return lambda: die_with_parent(parent)


def forget_parent_threads() -> None:
    """First thing in a forked child: drop the thread-exit callbacks inherited from the parent.

    Libraries register them for their own background threads (Prefect's log and event workers),
    which do not exist in a fork; run at the child's exit they fail (Prefect's raise an
    AssertionError in ``threading._shutdown``) and turn the child's clean exit into exit code 1.
    """
    import threading
    with contextlib.suppress(AttributeError):  # CPython's list of them (3.9+)
        threading._threading_atexits.clear()  # type: ignore[attr-defined]


def default_sigterm() -> None:
    """Pool initializer: a forked worker dies quietly on SIGTERM (``Pool.terminate``) instead of
    running a handler it inherited from its parent (Prefect's prints a TerminationSignal
    traceback into the flow log)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


class WorkerDied(RuntimeError):
    """A forked pool worker ended without returning its task's result (killed by a signal, by
    the out-of-memory killer, or ``os._exit``): its task can never complete."""


# The context a forked pool worker received from its initializer (see ``map_forked``); set only
# inside pool workers, never in the parent.
_WORKER_CONTEXT: list = []


def _init_worker(parent_pid: int, context) -> None:
    forget_parent_threads()
    default_sigterm()
    die_with_parent(parent_pid)
    _WORKER_CONTEXT[:] = [context]


def _call_in_worker(fn, task):
    return fn(_WORKER_CONTEXT[0], task)


def map_forked(fn, context, tasks: list, workers: int) -> Iterator:
    """``fn(context, task)`` for each task, in order: inline for one worker, else in a pool of
    forked processes that inherit ``context`` (an open source, say) instead of pickling it per
    task. ``fn`` must be importable by name (a module-level function).

    Workers die with this process (``die_with_parent``). A worker that dies mid-task raises
    ``WorkerDied`` here instead of leaving the caller waiting for a result that cannot come; on
    any exception (Ctrl-C included) the remaining workers are killed before it propagates.
    """
    import functools
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool
    if workers <= 1 or len(tasks) <= 1:
        for t in tasks:
            yield fn(context, t)
        return
    before = set(mp.active_children())
    with fork_safe():
        ex = ProcessPoolExecutor(min(workers, len(tasks)), mp_context=mp.get_context("fork"),
                                 initializer=_init_worker, initargs=(os.getpid(), context))
        # With fork, every worker starts at the first submit, here in the caller's thread.
        results = ex.map(functools.partial(_call_in_worker, fn), tasks)
    pool = [p for p in mp.active_children() if p not in before]
    done = False
    try:
        for r in results:
            yield r
        done = True
    except BrokenProcessPool:
        codes = ", ".join(describe_exit(p.exitcode) for p in pool if p.exitcode not in (None, 0))
        raise WorkerDied(f"a worker process died before finishing its task ({codes or 'no exit code'}); "
                         "killed by the out-of-memory killer or a signal?") from None
    finally:
        if done:
            ex.shutdown(wait=True)
        else:  # an error, Ctrl-C or an abandoned generator: stop the rest at once
            ex.shutdown(wait=False, cancel_futures=True)
            for p in pool:
                with contextlib.suppress(OSError, ValueError):
                    p.kill()
            for p in pool:
                p.join(5)


def describe_exit(code: int) -> str:
    """How a child process ended, from its exit code (negative: the signal that killed it)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
