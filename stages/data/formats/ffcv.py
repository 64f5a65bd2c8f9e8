"""The FFCV ``.beton`` of each split, written by FFCV's own ``DatasetWriter`` from the scanned
samples (the same pixels as the tar shards, in split-index order).

FFCV's writer waits forever when one of its worker processes dies (a full disk, a sample that
fails to decode): it polls a counter that will never reach the sample count. So it always runs
in a forked child that leads its own process group, with a watchdog thread that notices a dead
FFCV worker, reports its error through a pipe (no file: the disk may be full) and kills the
group. The child dies with the shard stage (``procs.die_with_parent``), and the stage kills it
on any error or Ctrl-C, so nothing is left writing after the stage has ended.

One FFCV worker per file: with several, the page each sample lands on depends on which worker
won a race, so two runs would write different bytes for the same fingerprint.
"""
from __future__ import annotations

import contextlib
import fcntl
import multiprocessing as mp
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

from sluice.errors import SampleError, ShardError, require
from sluice.stages.data.config import ShardConfig
from sluice.stages.data.encode import ShardJob
from sluice.stages.data.scan import PlannedSample
from sluice.stages.procs import describe_exit, die_with_parent, fork_safe, forget_parent_threads
from sluice.storage import atomic

FAILED = ".ffcv-failed"  # written by earlier versions; removed when an artifact is finished
EXIT_GRACE_S = 5.0  # how long FFCV may go on after its worker exited with an error before it counts as stuck
_PROGRESS = re.compile(r"\d+%\|.*\| \d+/\d+ \[")  # a line of FFCV's tqdm progress bar


class _FfcvView:
    """An indexable view for FFCV's DatasetWriter: (image, label, index, key bytes)."""

    def __init__(self, items: list[PlannedSample], job: ShardJob):
        self.items, self.job = items, job

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, n: int):
        sp, i, key, label = self.items[n]
        try:
            pixels, _ = self.job.prepare(self.job.source.load(sp, i))
        except Exception as e:  # noqa: BLE001 - the watchdog reports the dying worker's last line
            raise SampleError(f"sample {key} passed the scan but failed now: {e}") from None
        return pixels, label, n, np.frombuffer(key.encode(), dtype=np.uint8)


def _ffcv_fields(cfg: ShardConfig, shape: tuple[int, int, int] | None):
    require("ffcv", "ffcv", "ffcv", "writing the FFCV .beton")
    from ffcv.fields import BytesField, IntField, NDArrayField, RGBImageField
    if ffcv_field_kind(cfg, shape) == "rgb_image":
        mode = "jpg" if cfg.encoding == "jpg" else "raw"
        image = RGBImageField(write_mode=mode, jpeg_quality=cfg.jpeg_quality)
    else:
        image = NDArrayField(np.dtype("uint8"), tuple(shape))
    return {"image": image, "label": IntField(), "index": IntField(), "key": BytesField()}


def ffcv_field_kind(cfg: ShardConfig, shape: tuple[int, int, int] | None) -> str:
    """FFCV stores RGB jpg as JPEG; everything lossless (and gray) as a raw uint8 array."""
    rgb = shape is None or shape[2] == 3
    return "rgb_image" if rgb and (cfg.encoding == "jpg" or shape is None) else "ndarray"


def _page_size(shape) -> int:
    from ffcv.writer import MIN_PAGE_SIZE
    sample_bytes = int(np.prod(shape)) if shape else 0
    page = MIN_PAGE_SIZE if shape else 4 * MIN_PAGE_SIZE
    while page < 4 * sample_bytes:
        page *= 2
    return page


def _write_ffcv(path: Path, items: list[PlannedSample], job: ShardJob, shape, report) -> None:
    """One split's .beton, published atomically; ``report(text)`` is how a dying FFCV worker's
    error reaches the stage."""
    fields = _ffcv_fields(job.config, shape)
    from ffcv.writer import DatasetWriter

    def fill(tmp: Path) -> None:
        writer = DatasetWriter(str(tmp), fields, page_size=_page_size(shape), num_workers=1)
        with _WorkerWatch(writer, path, report), fork_safe():  # FFCV forks its worker here
            writer.from_indexed_dataset(_FfcvView(items, job), chunksize=256)
        mp.active_children()  # reap the finished worker, so the next split's watch sees only its own
    atomic.write_with(path, fill)


class _WorkerWatch:
    """While FFCV writes, capture its workers' stderr (in memory) and watch them: when one
    exits with an error, report its last line and kill this process group (FFCV would poll
    for the dead worker's samples forever)."""

    def __init__(self, writer, target: Path, report):
        self.writer, self.target, self.report = writer, target, report
        self.stop = threading.Event()

    def __enter__(self) -> "_WorkerWatch":
        import tempfile
        try:
            fd = os.memfd_create("sluice-ffcv-stderr")
            self.log = os.fdopen(fd, "w+")
            # Append-only: FFCV's progress bar here and a worker's traceback never overwrite each other
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
        except (AttributeError, OSError):
            self.log = tempfile.TemporaryFile("w+")
        self.saved, sys.stderr = sys.stderr, self.log  # FFCV's workers inherit it when forked
        self.thread = threading.Thread(target=self._watch, name="sluice-ffcv-watch", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.stop.set()
        self.thread.join()
        sys.stderr = self.saved
        self.log.close()
        if exc_type is not None:
            self._release()

    def _release(self) -> None:
        """Give back FFCV's shared metadata segment, which it frees only when it succeeds."""
        with contextlib.suppress(Exception):
            self.writer.metadata_sm.close()
            self.writer.metadata_sm.unlink()

    def _watch(self) -> None:
        exited_at = None
        while not self.stop.wait(0.2):
            try:  # a child that ended, left waitable (WNOWAIT) for multiprocessing to reap
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                continue
            if info is None or (info.si_code == os.CLD_EXITED and info.si_status == 0):
                continue
            if info.si_code != os.CLD_EXITED:  # killed by a signal (the OOM killer, kill -9)
                self._fail(-info.si_status)
            # An error exit is fatal only if FFCV is left waiting: an exit hook that fails after
            # the worker's work was done would otherwise fail a complete file.
            exited_at = exited_at or time.monotonic()
            if time.monotonic() - exited_at > EXIT_GRACE_S:
                self._fail(info.si_status)

    def _fail(self, exitcode: int) -> None:
        self.log.flush()
        self.log.seek(0)
        text = self.log.read()
        tail = text.rsplit("Traceback (most recent call last):", 1)[-1]  # the dying worker's own error
        lines = [ln for ln in tail.splitlines() if ln.strip() and not _PROGRESS.search(ln)]
        last = lines[-1].strip() if lines and exitcode > 0 else describe_exit(exitcode)
        if "No space left" in last or "Errno 28" in last:
            self.report(f"disk full while writing {self.target}: no space left on device")
        else:
            self.report(f"FFCV's writer process died while writing {self.target}: {last}")
        self._release()
        os.killpg(os.getpgrp(), signal.SIGKILL)


class FfcvWriter:
    """Writes every split's .beton in a forked child: beside the tar pool (``background``), since
    FFCV's writer spends much of its time waiting (process start, 0.1 s progress polls), or after
    it. ``finish`` waits for the child and raises its error; ``abort`` kills it and its workers.
    """

    def __init__(self, work: Path, good: dict[str, list[PlannedSample]], job: ShardJob, shape):
        self.work, self.good, self.job, self.cfg = work, good, job, job.config
        self.shape = shape
        self.proc: mp.Process | None = None
        self.conn = None

    def todo(self) -> list[str]:
        if "ffcv" not in self.cfg.formats:
            return []
        return [s for s, items in self.good.items() if items and not (self.work / s / "data.beton").exists()]

    def _child(self, parent: int, conn) -> None:
        os.setpgid(0, 0)  # FFCV's worker joins this group; abort() and the watchdog kill it all
        die_with_parent(parent)
        forget_parent_threads()  # FFCV's worker inherits this: a clean exit stays exit code 0
        signal.signal(signal.SIGTERM, lambda *_: os.killpg(os.getpgrp(), signal.SIGKILL))
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
        try:
            for split in self.todo():
                (self.work / split).mkdir(parents=True, exist_ok=True)
                _write_ffcv(self.work / split / "data.beton", self.good[split], self.job, self.shape,
                            conn.send)
        except BaseException as e:  # noqa: BLE001 - reported to the parent through the pipe
            with contextlib.suppress(Exception):
                conn.send(str(e) if isinstance(e, OSError) else f"{type(e).__name__}: {e}")
            os._exit(1)
        os._exit(0)

    def start(self, background: bool = True) -> None:
        """Fork the writer now (``background``), or leave it to ``finish``."""
        if background and self.todo():
            self._fork()

    def _fork(self) -> None:
        # FFCV's import takes seconds: done here, the next shard run of this process (a notebook,
        # a retried flow task, the tests) finds it instead of paying again in every child.
        _ffcv_fields(self.cfg, self.shape)
        import ffcv.writer  # noqa: F401
        recv, send = mp.get_context("fork").Pipe(duplex=False)
        self.proc = mp.get_context("fork").Process(target=self._child, args=(os.getpid(), send),
                                                   name="sluice-ffcv-writer")
        with fork_safe():
            self.proc.start()
        send.close()
        self.conn = recv
        with contextlib.suppress(OSError):
            os.setpgid(self.proc.pid, self.proc.pid)  # also here: abort() may come first

    def finish(self) -> None:
        """Wait for every .beton; a failure is a ShardError with the writer's own message."""
        if self.proc is None:
            if not self.todo():
                return
            self._fork()
        assert self.proc is not None and self.conn is not None
        messages: list[str] = []
        while True:
            if self.conn.poll(0.2):
                try:
                    messages.append(self.conn.recv())
                except (EOFError, OSError):  # every writer of the pipe has exited
                    break
            elif not self.proc.is_alive():
                break
        self.proc.join()
        code, self.proc = self.proc.exitcode, None
        if code != 0:
            detail = messages[0] if messages else f"the writer process ended with exit code {code}"
            raise ShardError(f"writing the FFCV files failed: {detail}")

    def abort(self) -> None:
        """Kill the writer and its FFCV worker (their own process group) and wait for them."""
        if self.proc is None:
            return
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(OSError, ValueError):
            self.proc.kill()
        self.proc.join(10)
        self.proc = None
