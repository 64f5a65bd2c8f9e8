"""The forked worker pool of the stages that fan work out (shard pools, the scan's checks):
``map_forked``. How and where processes may fork, and why, is ``sluice.process_rules`` (one module for
every such rule, below ``storage`` too)."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

from sluice.process_rules import child_start, describe_exit, fork_safe


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
    child_start(parent_pid)
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
    with this process (``sluice.process_rules``, rule 3); on any exception (Ctrl-C included) or an abandoned
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
