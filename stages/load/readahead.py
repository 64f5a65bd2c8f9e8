"""Storage reads a few batches ahead of a reader that cannot time its own (FFCV maps its file).

FFCV reads its ``.beton`` through mmap page faults inside its compiled decoder, so its storage
time hides in its decode time, and on a cold file each fault pulls in a whole read-around
window for one small sample. This thread reads exactly the byte ranges of the next ``ahead``
batches' samples into the page cache (through its own map of the file, advised random access),
timed as ``read``: the decoder then finds them cached, and the profile can tell storage time
from decode time.

With ``checked`` (a batch's indices -> the offsets and sizes of the ranges to check, one per
sample), the thread reads those ranges instead and takes the CRC-32 of each (no second read, and
off the loader's thread); ``crcs(b)`` hands batch ``b``'s checksums to the reader, which compares
them before it yields the batch. A reader that can checksum a batch itself (an FFCV ndarray
field: its decoded pixels are its stored bytes) asks with ``poll(b)`` instead, which does not
wait: when the thread is behind (small samples, its per-sample reads short of the GIL on a busy
host), the reader checks that batch itself, and the thread skips the batches already taken
rather than read them for nothing.
"""
from __future__ import annotations

import mmap
import os
import threading
import time
import zlib
from typing import Callable

import numpy as np

from sluice.stages.load.timings import Timings

Ranges = Callable[[np.ndarray], list[tuple[int, int]]]
Checked = Callable[[np.ndarray], tuple[list[int], list[int]]]


class Readahead:
    def __init__(self, path: str, ranges: Ranges, timings: Timings, ahead: int = 4, checked: Checked | None = None,
                 keep: bool = False, crc: bool = True):
        """``keep``: the ``checked`` ranges' bytes are handed over too (``kept``), for a reader
        that decodes them itself; ``crc=False`` then skips their checksums (an unchecked split)."""
        self.path, self.ranges, self.timings, self.ahead = path, ranges, timings, ahead
        self.checked, self.keep, self.crc = checked, keep, crc
        self._cond = threading.Condition()
        self._next = 0  # the first batch the reader has not taken yet
        self._stop = False
        self._thread: threading.Thread | None = None
        self._crcs: dict[int, np.ndarray] = {}
        self._error: BaseException | None = None
        self._done = False

    def start(self, batches: list[np.ndarray]) -> None:
        self._batches, self._next, self._stop = batches, 0, False
        self._crcs, self._error, self._done = {}, None, False
        self._thread = threading.Thread(target=self._run, name="sluice-readahead", daemon=True)
        self._thread.start()

    def taken(self, n: int) -> None:
        """The reader has taken ``n`` batches (the thread skips any of them it has not read yet)."""
        with self._cond:
            self._next = n
            for b in [b for b in self._crcs if b < n]:  # checked by the reader itself (``poll``)
                del self._crcs[b]
            self._cond.notify_all()

    def poll(self, b: int) -> np.ndarray | None:
        """``crcs(b)`` if the thread has read batch ``b`` already, else None (without waiting:
        a reader that can check the batch itself does so rather than wait)."""
        with self._cond:
            if b in self._crcs:
                return self._crcs.pop(b)
            if self._error is not None:
                raise self._error
            return None

    def kept(self, b: int) -> tuple[np.ndarray | None, list[bytes]]:
        """``keep``: batch ``b``'s checksums (None without ``crc``) and each range's bytes."""
        return self.crcs(b)

    def crcs(self, b: int) -> np.ndarray:
        """The CRC-32 of each checked range of batch ``b`` (waits for the thread to read it)."""
        with self._cond:
            while b not in self._crcs and not self._done:
                self._cond.wait()
            if b in self._crcs:
                return self._crcs.pop(b)
            if self._error is not None:
                raise self._error
            raise RuntimeError(f"the readahead of {self.path} stopped before batch {b}")

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        crc, touch = zlib.crc32, zlib.adler32
        fd, mm, view = -1, None, None
        try:
            fd = os.open(self.path, os.O_RDONLY)
            if os.fstat(fd).st_size:
                # reads through a map: one C call on a slice per sample instead of a pread syscall
                # and a bytes object (small samples: the per-sample cost is the loop's); random
                # access, so a page fault reads its page and no read-around window
                mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
                mm.madvise(mmap.MADV_RANDOM)
                view = memoryview(mm)
            for b, idx in enumerate(self._batches):
                with self._cond:
                    while not self._stop and b >= self._next + self.ahead:
                        self._cond.wait()
                    if self._stop:
                        return
                    if b < self._next:  # taken already (checked by the reader): too late to help
                        continue
                t = time.perf_counter()
                if self.keep:
                    offs, sizes = self.checked(idx)
                    datas = [bytes(view[o:o + n]) for o, n in zip(offs, sizes)] if view is not None else \
                        [b""] * len(offs)
                    got = np.fromiter(map(crc, datas), np.uint32, len(datas)) if self.crc else None
                    with self._cond:
                        self._crcs[b] = (got, datas)
                        self._cond.notify_all()
                elif self.checked is not None:
                    offs, sizes = self.checked(idx)
                    got = np.fromiter((crc(view[o:o + n]) for o, n in zip(offs, sizes)), np.uint32, len(offs)) \
                        if view is not None else np.full(len(offs), crc(b""), np.uint32)  # an empty file
                    with self._cond:
                        self._crcs[b] = got
                        self._cond.notify_all()
                if view is not None:
                    for off, size in self.ranges(idx):
                        touch(view[off:off + size])  # every page of the range, into the page cache
                self.timings.add("read", time.perf_counter() - t)
        except BaseException as e:  # noqa: BLE001 - the reader waiting on crcs() raises it
            self._error = e
        finally:
            if view is not None:
                view.release()
            if mm is not None:
                mm.close()
            if fd >= 0:
                os.close(fd)
            with self._cond:
                self._done = True
                self._cond.notify_all()
