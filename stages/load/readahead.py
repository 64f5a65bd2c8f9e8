"""Storage reads a few batches ahead of a reader that cannot time its own (FFCV maps its file).

FFCV reads its ``.beton`` through mmap page faults inside its compiled decoder, so its storage
time hides in its decode time, and on a cold file each fault pulls in a whole read-around
window for one small sample. This thread ``pread``s exactly the byte ranges of the next
``ahead`` batches' samples into the page cache, timed as ``read``: the decoder then finds them
cached, and the profile can tell storage time from decode time.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Callable

import numpy as np

from sluice.stages.load.timings import Timings

Ranges = Callable[[np.ndarray], list[tuple[int, int]]]


class Readahead:
    def __init__(self, path: str, ranges: Ranges, timings: Timings, ahead: int = 4):
        self.path, self.ranges, self.timings, self.ahead = path, ranges, timings, ahead
        self._cond = threading.Condition()
        self._next = 0  # the first batch the reader has not taken yet
        self._stop = False
        self._thread: threading.Thread | None = None

    def start(self, batches: list[np.ndarray]) -> None:
        self._batches, self._next, self._stop = batches, 0, False
        self._thread = threading.Thread(target=self._run, name="sluice-readahead", daemon=True)
        self._thread.start()

    def taken(self, n: int) -> None:
        """The reader has taken ``n`` batches."""
        with self._cond:
            self._next = n
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for b, idx in enumerate(self._batches):
                with self._cond:
                    while not self._stop and b >= self._next + self.ahead:
                        self._cond.wait()
                    if self._stop:
                        return
                t = time.perf_counter()
                for off, size in self.ranges(idx):
                    os.pread(fd, size, off)
                self.timings.add("read", time.perf_counter() - t)
        finally:
            os.close(fd)
