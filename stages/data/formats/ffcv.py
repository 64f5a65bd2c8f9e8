"""The FFCV ``.beton`` of each split, written by FFCV's own ``DatasetWriter`` from the scanned
samples (the same pixels as the tar shards, in split-index order)."""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
from pathlib import Path

import numpy as np

from sluice.errors import ShardError, require
from sluice.stages.data.config import ShardConfig
from sluice.stages.data.encode import ShardJob
from sluice.stages.data.scan import PlannedSample
from sluice.stages.procs import fork_safe
from sluice.storage import atomic

FAILED = ".ffcv-failed"


class _FfcvView:
    """An indexable view for FFCV's DatasetWriter: (image, label, index, key bytes)."""

    def __init__(self, items: list[PlannedSample], job: ShardJob):
        self.items, self.job = items, job

    def __len__(self) -> int:
        return len(self.items)

    errors_path: str | None = None
    shape: tuple[int, int, int] | None = None

    def __getitem__(self, n: int):
        sp, i, key, label = self.items[n]
        try:
            pixels, _ = self.job.prepare(self.job.source.load(sp, i))
        except Exception as e:  # noqa: BLE001 - a raising FFCV worker would hang its parent
            with open(self.errors_path, "a") as f:
                f.write(f"{key}: {e}\n")
            pixels = np.zeros(self.shape or (8, 8, 3), np.uint8)
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


def _write_ffcv(path: Path, items: list[PlannedSample], job: ShardJob, shape, workers: int) -> None:
    fields = _ffcv_fields(job.config, shape)
    from ffcv.writer import MIN_PAGE_SIZE, DatasetWriter

    sample_bytes = int(np.prod(shape)) if shape else 0
    page = MIN_PAGE_SIZE if shape else 4 * MIN_PAGE_SIZE
    while page < 4 * sample_bytes:
        page *= 2
    # Each FFCV worker leaves up to one partly filled page: few workers for small splits.
    workers = max(1, min(workers, (len(items) * max(sample_bytes, 1)) // page))
    view = _FfcvView(items, job)
    view.errors_path, view.shape = str(path.with_name(".ffcv-errors")), shape
    Path(view.errors_path).unlink(missing_ok=True)

    def fill(tmp: Path) -> None:
        import io
        writer = DatasetWriter(str(tmp), fields, page_size=page, num_workers=workers)
        with contextlib.redirect_stderr(io.StringIO()), fork_safe():  # FFCV forks its workers here
            writer.from_indexed_dataset(view, chunksize=256)
        if os.path.exists(view.errors_path):
            errors = Path(view.errors_path).read_text()
            os.unlink(view.errors_path)
            raise ShardError(f"FFCV writer failed on samples that passed the scan:\n{errors[:2000]}")
    atomic.write_with(path, fill)


class FfcvWriter:
    """Writes every split's .beton, in a forked process beside the tar pool when there is one.

    FFCV's writer spends much of its time waiting (process start, 0.1 s progress polls), so
    running it beside the shard pool hides most of its cost. The fork happens from the main
    thread before the pool exists.
    """

    def __init__(self, work: Path, good: dict[str, list[PlannedSample]], job: ShardJob, shape,
                 workers: int):
        self.work, self.good, self.job, self.cfg = work, good, job, job.config
        self.shape, self.workers = shape, workers
        self.proc: mp.Process | None = None
        self.error_file = work / FAILED

    def todo(self) -> list[str]:
        if "ffcv" not in self.cfg.formats:
            return []
        return [s for s, items in self.good.items() if items and not (self.work / s / "data.beton").exists()]

    def run(self) -> None:
        for split in self.todo():
            (self.work / split).mkdir(parents=True, exist_ok=True)
            _write_ffcv(self.work / split / "data.beton", self.good[split], self.job, self.shape,
                        self.workers)

    def _child(self) -> None:
        try:
            self.run()
        except BaseException as e:  # noqa: BLE001 - reported to the parent through the file
            self.error_file.write_text(f"{type(e).__name__}: {e}")
            os._exit(1)
        os._exit(0)

    def start(self, background: bool) -> None:
        self.error_file.unlink(missing_ok=True)
        if not self.todo():
            return
        if background:
            self.proc = mp.get_context("fork").Process(target=self._child, name="sluice-ffcv-writer")
            with fork_safe():
                self.proc.start()
        else:
            self.run()

    def finish(self) -> None:
        if self.proc is None:
            return
        self.proc.join()
        if self.proc.exitcode != 0:
            detail = self.error_file.read_text() if self.error_file.exists() else f"exit code {self.proc.exitcode}"
            self.error_file.unlink(missing_ok=True)
            raise ShardError(f"writing the FFCV files failed: {detail}")
