"""The FFCV ``.beton`` of each split (the same pixels as the tar shards, in split-index order),
written by ``formats.beton`` in a forked child beside the tar pool (or the engine's parts): from
the tar shards' own image bytes as each shard is recorded whole, where those give the .beton's
bytes exactly (a kept JPEG, .npy pixels), else by decoding every sample again from the source.

``formats.beton`` writes the bytes FFCV's own ``DatasetWriter`` would, without importing FFCV
(~5 s of numba compilation in a fresh process) and without FFCV's worker processes (which it
polls forever when one dies). The child dies with the shard stage (``process_rules.die_with_parent``),
and the stage kills it on any error or Ctrl-C, so nothing is left writing after the stage has
ended. A failure (a full disk, a sample that no longer decodes) reaches the stage through a
pipe (no file: the disk may be full).
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import tarfile
from pathlib import Path
from typing import Callable

import numpy as np

from sluice.errors import SampleError, ShardError
from sluice.stages.data.config import ShardConfig
from sluice.stages.data.encode import SampleEncoder
from sluice.stages.data.formats import beton
from sluice.stages.data.formats.tar import ShardTask
from sluice.stages.data.scan import PlannedSample
from sluice.process_rules import die_with_parent, fork_safe, forget_parent_threads
from sluice.storage import atomic

FAILED = ".ffcv-failed"  # written by earlier versions; removed when an artifact is finished
SUMS = ".ffcv-sums.npy"  # the .beton's image checksums, until the manifest's sums.npy takes them in


def beton_name(first_index: int) -> str:
    """A split's .beton: ``data.beton`` from index 0; a later version's part of new samples,
    ``data-<first index>.beton``."""
    return "data.beton" if first_index == 0 else f"data-{first_index:010d}.beton"


def _samples(items: list[PlannedSample], encoder: SampleEncoder, first_index: int = 0, jpeg: bool = False):
    """Each sample's (image, label, index, key bytes), decoded again from the source; ``jpeg``:
    the image as (pixels, the JPEG bytes the tar shards hold: the photo's own where kept)."""
    for n, (sp, i, key, label) in enumerate(items, first_index):
        try:
            s = encoder.source.load(sp, i)
            pixels, _ = encoder.prepare(s)
            image = (pixels, encoder.members(s, pixels, label, n)[0][1]) if jpeg else pixels
        except Exception as e:  # noqa: BLE001 - named and reported to the stage
            raise SampleError(f"sample {key} passed the scan but failed now: {e}") from None
        yield image, label, n, np.frombuffer(key.encode(), dtype=np.uint8)


def _from_tars(shards: list[ShardTask], encoder: SampleEncoder, first_index: int, jpeg: bool,
               wait: Callable[[ShardTask], None]):
    """The same records as ``_samples``, with each image taken from the split's tar shards (in
    order, each once its completion record says it is whole: ``wait``) instead of decoded again
    from the source: the .beton costs the machine running the stage a read of what the parts
    wrote, not a second decode of every image. Only where the tar's member gives the .beton's
    bytes exactly (``from_tars_exact``): a JPEG kept as it is, or the .npy of the pixels."""
    from io import BytesIO

    from PIL import Image
    ext = encoder.config.encoding
    n = first_index
    for task in shards:
        wait(task)
        with tarfile.open(task.tar, "r:") as t:
            images = [m for m in t if m.isfile() and m.name.endswith("." + ext)]
            if len(images) != len(task.items):
                raise ShardError(f"{task.tar} holds {len(images)} images, its plan {len(task.items)}")
            for m, (sp, i, key, label) in zip(images, task.items):
                if m.name != f"{key}.{ext}":
                    raise ShardError(f"{task.tar} holds {m.name} where its plan has {key}.{ext}")
                data = t.extractfile(m).read()
                if jpeg:
                    w, h = Image.open(BytesIO(data)).size  # the header only
                    if len(data) > beton.jpeg_bound(h, w):  # encoded afresh from the pixels, as _samples does
                        image = next(_samples([(sp, i, key, label)], encoder, n, jpeg=True))[0]
                    else:  # pixels of the right shape, never read: the JPEG's own bytes are stored
                        image = (np.broadcast_to(np.zeros((), np.uint8), (h, w, 3)), data)
                else:
                    image = np.lib.format.read_array(BytesIO(data), allow_pickle=False)
                yield image, label, n, np.frombuffer(key.encode(), dtype=np.uint8)
                n += 1


def from_tars_exact(cfg: ShardConfig, shape: tuple[int, int, int] | None) -> bool:
    """Whether a .beton record's bytes follow from the tar shard's image member alone: a JPEG the
    .beton stores as it is (RGB), or raw pixels stored losslessly as .npy; not raw pixels behind a
    lossy JPEG, nor PNG (a decode as costly as the source's)."""
    kind = ffcv_field_kind(cfg, shape)
    return "webdataset" in cfg.formats and ((cfg.encoding == "jpg" and kind == "rgb_image")
                                            or cfg.encoding == "npy")


def _ffcv_fields(cfg: ShardConfig, shape: tuple[int, int, int] | None) -> dict[str, beton.Field]:
    if ffcv_field_kind(cfg, shape) == "rgb_image":
        image: beton.Field = beton.RGBImageField(mode="jpg" if cfg.encoding == "jpg" else "raw",
                                                 jpeg_quality=cfg.jpeg_quality)
    else:
        image = beton.NDArrayField(np.dtype("uint8"), tuple(shape))
    return {"image": image, "label": beton.IntField(), "index": beton.IntField(), "key": beton.BytesField()}


def ffcv_field_kind(cfg: ShardConfig, shape: tuple[int, int, int] | None) -> str:
    """FFCV stores RGB jpg as JPEG; everything lossless (and gray) as a raw uint8 array."""
    rgb = shape is None or shape[2] == 3
    return "rgb_image" if rgb and (cfg.encoding == "jpg" or shape is None) else "ndarray"


def _write_ffcv(path: Path, items: list[PlannedSample], encoder: SampleEncoder, shape, first_index: int = 0,
                largest: int | None = None, shards: list[ShardTask] | None = None,
                wait: Callable[[ShardTask], None] | None = None) -> None:
    """One split's .beton (its records' ``index`` from ``first_index``), published atomically.
    ``largest``: for variable-size images, a bound of the bytes the largest sample stores (image
    and key), which sizes the pages; without it they get FFCV's default 8 MiB. ``shards``: the
    split's tar shards to take the images from (``_from_tars``), else they are decoded again."""
    fields = _ffcv_fields(encoder.config, shape)
    if shape is None and largest:
        page = beton.page_size_for_largest(largest, exact=encoder.config.encoding != "jpg")
    else:
        page = beton.page_size_for(int(np.prod(shape)) if shape else None, small=first_index > 0)

    with atomic.atomic_path(path) as tmp:
        with open(tmp, "w+b") as fp:
            jpeg = isinstance(fields["image"], beton.RGBImageField) and fields["image"].mode == "jpg"
            samples = _from_tars(shards, encoder, first_index, jpeg, wait) if shards is not None and wait is not None \
                else _samples(items, encoder, first_index, jpeg)
            sums = beton.write_beton(fp, fields, samples, len(items), page, checksum="image")
        # the checksums land just before the .beton, so a finished .beton always has them
        atomic.write_with(path.parent / SUMS, lambda t: t.write_bytes(_npy_bytes(sums)))


def _npy_bytes(arr: np.ndarray) -> bytes:
    import io
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


class FfcvWriter:
    """Writes every split's .beton in a forked child: beside the tar pool (``background``), or
    after it. ``finish`` waits for the child and raises its error; ``abort`` kills it."""

    def __init__(self, work: Path, good: dict[str, list[PlannedSample]], encoder: SampleEncoder, shape,
                 first_index: dict[str, int] | None = None, page_bytes: dict[str, int] | None = None,
                 shards: list[ShardTask] | None = None, wait: Callable[[ShardTask], None] | None = None):
        self.work, self.good, self.encoder, self.cfg = work, good, encoder, encoder.config
        self.shape = shape
        # the tar shards to take images from (``from_tars_exact``), and how to wait until one is whole
        self.shards: dict[str, list[ShardTask]] | None = None
        self.wait = wait
        if shards is not None and wait is not None and from_tars_exact(self.cfg, shape):
            self.shards = {}
            for t in shards:
                self.shards.setdefault(t.split, []).append(t)
        self.page_bytes = page_bytes or {}  # per split: the largest sample's bytes (a bound), for the pages
        self.first = first_index or {}  # per split: the split index of good[split][0] (a later version's part)
        self.proc: mp.Process | None = None
        self.conn = None

    def path(self, split: str) -> Path:
        return self.work / split / beton_name(self.first.get(split, 0))

    def todo(self) -> list[str]:
        if "ffcv" not in self.cfg.formats:
            return []
        return [s for s, items in self.good.items()
                if items and not (self.path(s).exists() and (self.work / s / SUMS).exists())]

    def _shards_of(self, split: str) -> list[ShardTask] | None:
        """The split's tar shards in order, to take its images from; None: decode them again."""
        if self.shards is None:
            return None
        return sorted(self.shards.get(split, []), key=lambda t: t.shard)

    def _child(self, parent: int, conn) -> None:
        die_with_parent(parent)
        forget_parent_threads()  # a clean exit stays exit code 0
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
        try:
            for split in self.todo():
                (self.work / split).mkdir(parents=True, exist_ok=True)
                _write_ffcv(self.path(split), self.good[split], self.encoder, self.shape, self.first.get(split, 0),
                            self.page_bytes.get(split), self._shards_of(split), self.wait)
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
        recv, send = mp.get_context("fork").Pipe(duplex=False)
        self.proc = mp.get_context("fork").Process(target=self._child, args=(os.getpid(), send),
                                                   name="sluice-ffcv-writer")
        with fork_safe():
            self.proc.start()
        send.close()
        self.conn = recv

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
        """Kill the writer and wait for it."""
        if self.proc is None:
            return
        with contextlib.suppress(OSError, ValueError):
            self.proc.kill()
        self.proc.join(10)
        self.proc = None
