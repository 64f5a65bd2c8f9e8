"""The loader's prefetch part: batches made ``depth`` ahead of the caller in a helper thread,
so reading, decoding and augmenting overlap the caller's own work; and the caller's ``wait``
for each batch timed either way.

A backend that forks worker processes each epoch is driven from the caller's thread instead:
forking from a helper thread can deadlock the child (``sluice.process_rules``, rule 2); such backends
(DataLoader workers) prefetch in their workers anyway.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Iterator, TypeVar

from sluice.process_rules import helper_thread
from sluice.stages.load.timings import Timings

T = TypeVar("T")


def prefetched(make: Callable[[], Iterator[T]], depth: int, forks: bool, timings: Timings) -> Iterator[T]:
    """The items of ``make()``, up to ``depth`` made ahead in a helper thread; in the caller's
    thread when ``depth`` is 0 or ``forks`` (the work forks processes). Seconds the caller waits
    for each item go to ``timings["wait"]``. The thread starts at the first item; closing this
    generator (an abandoned epoch) stops it; an exception in it is raised here."""
    if depth == 0 or forks:
        yield from timed(make(), timings)
        return
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def work() -> None:
        try:
            for item in make():
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        pass
                if stop.is_set():
                    return
            q.put(done)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            q.put(e)

    th = helper_thread(work, name="sluice-loader")
    try:
        while True:
            t = time.perf_counter()
            item = q.get()
            timings.add("wait", time.perf_counter() - t)
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while th.is_alive():  # drain, so a thread blocked on a full queue sees the stop
            try:
                q.get_nowait()
            except queue.Empty:
                th.join(0.05)


def timed(it: Iterator[T], timings: Timings) -> Iterator[T]:
    """The items of ``it``, the seconds spent waiting for each added to ``timings["wait"]``."""
    while True:
        t = time.perf_counter()
        try:
            item = next(it)
        except StopIteration:
            return
        timings.add("wait", time.perf_counter() - t)
        yield item
