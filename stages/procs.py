"""Process helpers shared by the stages that start other processes (shard pools, the .beton writer,
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


class _RemoteTraceback(Exception):
    """A worker's traceback, chained under the exception it raised (as concurrent.futures does)."""

    def __str__(self) -> str:
        return str(self.args[0])


def _serve(parent_pid: int, fn, context, conn) -> None:
    """A forked worker: run ``fn(context, task)`` for each ``(index, task)`` its pipe brings
    until it brings None; answer ``(index, ok, result or (exception, traceback))``."""
    import pickle
    import traceback
    forget_parent_threads()
    default_sigterm()
    die_with_parent(parent_pid)
    while (msg := conn.recv()) is not None:
        index, task = msg
        try:
            answer = (index, True, fn(context, task))
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
            tb = "".join(traceback.format_exception(e))
            try:
                pickle.loads(pickle.dumps(e))
            except Exception:  # noqa: BLE001 - an exception that cannot travel goes as text
                e = RuntimeError(f"{type(e).__name__}: {e}")
            answer = (index, False, (e, tb))
        conn.send(answer)


def map_forked(fn, context, tasks: list, workers: int) -> Iterator:
    """``fn(context, task)`` for each task, results in task order: inline for one worker, else
    in forked processes that inherit ``fn`` and ``context`` (an open source, say) instead of
    pickling them per task; a worker's exception is raised here with its traceback chained.

    Each worker has a pipe of its own, so a worker killed mid-answer leaves a pipe that reads as
    closed, never a half-message in a shared queue that blocks its reader forever (CPython's
    ProcessPoolExecutor can hang that way). A worker that dies raises ``WorkerDied``; workers die
    with this process (``die_with_parent``); on any exception (Ctrl-C included) or an abandoned
    generator the workers are killed before it propagates.
    """
    import multiprocessing as mp
    from multiprocessing.connection import wait
    if workers <= 1 or len(tasks) <= 1:
        for t in tasks:
            yield fn(context, t)
        return
    ctx = mp.get_context("fork")
    procs: list = []
    conns: list = []

    def died(conn) -> WorkerDied:
        return WorkerDied(f"a worker process died before finishing its task "
                          f"({_death(procs[conns.index(conn)])}); "
                          "killed by the out-of-memory killer or a signal?")

    todo = iter(enumerate(tasks))
    busy: set = set()  # connections whose worker has a task

    def hand_out(conn) -> None:
        item = next(todo, None)
        if item is not None:
            try:
                conn.send(item)
            except OSError:
                raise died(conn) from None
            busy.add(conn)

    try:
        with fork_safe():
            for _ in range(min(workers, len(tasks))):
                mine, theirs = ctx.Pipe()
                p = ctx.Process(target=_serve, args=(os.getpid(), fn, context, theirs), daemon=True)
                p.start()
                theirs.close()
                procs.append(p)
                conns.append(mine)
        for c in conns:
            hand_out(c)
        done: dict[int, object] = {}
        nxt = 0
        while nxt < len(tasks):
            for c in wait(list(busy)):
                try:
                    index, ok, value = c.recv()
                except (EOFError, OSError):
                    raise died(c) from None
                busy.discard(c)
                if not ok:
                    exc, tb = value
                    exc.__cause__ = _RemoteTraceback(f'\n"""\n{tb}"""')
                    raise exc
                done[index] = value
                hand_out(c)
            while nxt in done:
                yield done.pop(nxt)
                nxt += 1
        for c in conns:
            with contextlib.suppress(OSError):
                c.send(None)
        for p in procs:
            p.join()
        procs = []
    finally:  # an error, Ctrl-C or an abandoned generator: stop the rest at once
        for p in procs:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                p.kill()
        for p in procs:
            p.join(5)
        for c in conns:
            c.close()


def _death(proc, timeout: float = 5.0) -> str:
    """How a worker ended: its pipe closes a moment before the kernel reports its status."""
    proc.join(timeout)
    code = proc.exitcode
    return describe_exit(code) if code is not None else "no exit code"


def describe_exit(code: int) -> str:
    """How a child process ended, from its exit code (negative: the signal that killed it)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
