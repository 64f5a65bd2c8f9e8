"""The sharding stage: a source becomes a versioned dataset artifact.

Every split is written as WebDataset tar shards (with a DALI index per shard) and one FFCV
``.beton``, plus ``labels.npy`` and ``keys.txt`` aligned to the split index. The artifact lives in
``<out>/<fingerprint[:16]>/`` where the fingerprint hashes the source's content and the config,
so re-running with the same inputs is a no-op and new data gets a new version.

Two passes keep indices stable while writing in parallel: a scan finds which samples are usable
(quarantining the rest) and fixes every sample's split index; then shards are written by a pool
of processes, each shard published atomically. A killed run resumes: finished shards are kept,
and the manifest (written last) is what makes the artifact visible.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from sluice.stages.data.encode import decode_pixels, encode_image, to_label
from sluice.errors import SampleError, ShardError, SluiceError, TooManyBadSamples
from sluice.stages.procs import default_sigterm, fork_safe
from sluice.stages.data.ingest import IngestConfig, RawSample, Source, open_source, plan_splits, source_record
from sluice.stages.data.tarwrite import TarShardWriter
from sluice.storage import atomic
from sluice.storage.artifact import LATEST
from sluice.storage.fingerprint import combine, hash_obj, sha256_file
from sluice.storage.manifest import (SCHEMA_VERSION, SPLITS, FieldSpecs, FileRecord, ImageFieldSpec,
                              LabelFieldSpec, Manifest, QuarantineRecord, ShardRecord, SplitRecord,
                              read_manifest, write_manifest)
from sluice.storage.paths import filesystem, is_local, join, local_path

Format = Literal["webdataset", "dali", "ffcv"]
ALL_FORMATS: list[Format] = ["webdataset", "dali", "ffcv"]
TAR_OVERHEAD = 512 + 256  # header plus mean padding per member


class ShardConfig(BaseModel):
    """How samples are encoded and cut into shards."""
    model_config = ConfigDict(extra="forbid")

    encoding: Literal["npy", "png", "jpg"] = "npy"
    jpeg_quality: int = Field(90, ge=1, le=100)
    png_level: int = Field(1, ge=0, le=9)
    shard_samples: int = Field(5000, ge=1, description="samples per shard")
    shard_bytes: int | None = Field(None, ge=4096, description="target shard size; overrides shard_samples")
    formats: list[Format] = Field(default_factory=lambda: list(ALL_FORMATS))
    image_size: tuple[int, int] | None = Field(None, description="resize every image to (H, W)")
    channels: Literal[1, 3] | None = Field(None, description="convert to 1 (gray) or 3 (RGB)")
    max_bad_fraction: float = Field(0.01, ge=0.0, le=1.0)
    workers: int | None = Field(None, ge=1, description="processes; default: all cores")
    progress: bool = True

    @model_validator(mode="after")
    def _formats(self) -> "ShardConfig":
        if not self.formats:
            raise ValueError("formats must name at least one of webdataset, dali, ffcv")
        if "dali" in self.formats and "webdataset" not in self.formats:
            raise ValueError("the dali format indexes the WebDataset shards: add webdataset to formats")
        self.formats = [f for f in ALL_FORMATS if f in self.formats]
        return self

    def content_fingerprint(self) -> str:
        """Only what changes the bytes written: not workers or progress bars."""
        return hash_obj(self.model_dump(exclude={"workers", "progress", "max_bad_fraction"}))


class PrepareConfig(BaseModel):
    """Ingest + shard: the input of ``sluice shard`` and of the ``prepare`` flow."""
    model_config = ConfigDict(extra="forbid")
    ingest: IngestConfig = Field(default_factory=IngestConfig)
    shard: ShardConfig = Field(default_factory=ShardConfig)


@dataclass
class ShardSummary:
    root: str
    manifest: Manifest
    reused: bool
    seconds: float
    shards_written: int = 0
    shards_reused: int = 0

    def format(self) -> str:
        m = self.manifest
        lines = [f"dataset artifact {self.root}",
                 f"  fingerprint {m.fingerprint[:16]}  source {m.source.kind}:{m.source.uri}",
                 f"  {'split':<8} {'samples':>8} {'shards':>7} {'MB':>9}"]
        for name, s in m.splits.items():
            mb = sum(f.bytes for f in _split_files(s)) / 1e6
            lines.append(f"  {name:<8} {s.count:>8} {len(s.shards):>7} {mb:>9.1f}")
        lines.append(f"  total {sum(m.counts().values())} samples, {m.total_bytes() / 1e6:.1f} MB, "
                     f"formats {', '.join(m.formats)}, encoding {m.fields.image.encoding}")
        lines.append(f"  quarantined {m.quarantined}")
        state = "up to date (nothing rewritten)" if self.reused else \
            f"{self.shards_written} shards written, {self.shards_reused} reused from an earlier run"
        lines.append(f"  {state} in {self.seconds:.1f} s")
        return "\n".join(lines)


def _split_files(s: SplitRecord) -> list[FileRecord]:
    return [r for sh in s.shards for r in (sh.tar, sh.dali_index) if r] + \
           [r for r in (s.ffcv, s.labels, s.keys) if r]


# ------------------------------------------------------------------ worker plumbing

# Pool workers are forked, so they inherit the open source instead of re-reading it.
_JOB: dict[str, Any] = {}


def _prepare(s: RawSample, cfg: ShardConfig, num_classes: int | None) -> tuple[np.ndarray, int]:
    label = to_label(s.label, num_classes)
    pixels = decode_pixels(s, cfg.channels, cfg.image_size)
    return pixels, label


def _scan_chunk(args: tuple[str, list[tuple[str, int]]]) -> list[tuple]:
    """(key, label, shape, None) for a usable sample, (key, None, where, reason) for a bad one."""
    split, items = args
    src, cfg, ncls = _JOB["src"], _JOB["cfg"], _JOB["num_classes"]
    out = []
    for sp, i in items:
        key, where = f"{sp}-{i:06d}", f"{sp}[{i}]"
        try:
            s = src.load(sp, i)
            key, where = s.key, s.where
            pixels, label = _prepare(s, cfg, ncls)
            out.append((key, label, list(pixels.shape), None))
        except SampleError as e:
            out.append((key, None, where, str(e)))
    return out


def _sample_members(s: RawSample, pixels: np.ndarray, label: int, index: int,
                    cfg: ShardConfig) -> list[tuple[str, bytes]]:
    passthrough = (s.encoded is not None and s.encoded_ext == cfg.encoding and cfg.encoding != "npy"
                   and cfg.image_size is None and cfg.channels is None)
    img = s.encoded if passthrough else encode_image(pixels, cfg.encoding, cfg.jpeg_quality, cfg.png_level)
    return [(cfg.encoding, img), ("cls", str(label).encode()),
            ("idx", int(index).to_bytes(8, "little", signed=True))]


def _write_shard(task: dict) -> dict:
    """Write one tar shard (and its DALI index) atomically; reuse it if a past run finished it."""
    src, cfg, ncls = _JOB["src"], _JOB["cfg"], _JOB["num_classes"]
    tar_path, idx_path = Path(task["tar"]), Path(task["idx"])
    want_idx = "dali" in cfg.formats
    if tar_path.exists() and (idx_path.exists() or not want_idx):
        return {**task, "reused": True, "tar_sha": sha256_file(tar_path), "tar_bytes": tar_path.stat().st_size,
                "idx_sha": sha256_file(idx_path) if want_idx else None,
                "idx_bytes": idx_path.stat().st_size if want_idx else None}
    with atomic.atomic_path(tar_path) as tmp:
        with open(tmp, "wb", buffering=1 << 20) as f:
            w = TarShardWriter(f)
            for n, (sp, i, key, label) in enumerate(task["items"]):
                s = src.load(sp, i)
                pixels, _ = _prepare(s, cfg, ncls)
                w.add_sample(key, _sample_members(s, pixels, label, task["first_index"] + n, cfg))
            w.close()
            f.flush()
        out = {**task, "reused": False, "tar_sha": w.sha.hexdigest(), "tar_bytes": w.offset,
               "idx_sha": None, "idx_bytes": None}
        if want_idx:  # the index lands before its tar, so a finished tar always has one
            data = w.dali_index()
            atomic.write_bytes(idx_path, data)
            out["idx_sha"], out["idx_bytes"] = hashlib.sha256(data).hexdigest(), len(data)
    return out


def _run_pool(fn, tasks: list, workers: int, weight, progress: bool, desc: str) -> Iterator:
    """Map ``fn`` over tasks in forked workers (inline for one worker), with a progress bar."""
    from tqdm import tqdm
    bar = tqdm(total=sum(weight(t) for t in tasks), desc=desc, unit="sample",
               disable=not progress, dynamic_ncols=True, leave=False)
    try:
        if workers <= 1 or len(tasks) <= 1:
            for t in tasks:
                r = fn(t)
                bar.update(weight(t))
                yield r
        else:
            with fork_safe():
                pool = mp.get_context("fork").Pool(workers, initializer=default_sigterm)
            with pool:
                for t, r in zip(tasks, pool.imap(fn, tasks)):
                    bar.update(weight(t))
                    yield r
    finally:
        bar.close()


# ------------------------------------------------------------------ FFCV

class _FfcvView:
    """An indexable view for FFCV's DatasetWriter: (image, label, index, key bytes)."""

    def __init__(self, items: list[tuple[str, int, str, int]], src: Source, cfg: ShardConfig,
                 ncls: int | None):
        self.items, self.src, self.cfg, self.ncls = items, src, cfg, ncls

    def __len__(self) -> int:
        return len(self.items)

    errors_path: str | None = None
    shape: tuple[int, int, int] | None = None

    def __getitem__(self, n: int):
        sp, i, key, label = self.items[n]
        try:
            pixels, _ = _prepare(self.src.load(sp, i), self.cfg, self.ncls)
        except Exception as e:  # noqa: BLE001 - a raising FFCV worker would hang its parent
            with open(self.errors_path, "a") as f:
                f.write(f"{key}: {e}\n")
            pixels = np.zeros(self.shape or (8, 8, 3), np.uint8)
        return pixels, label, n, np.frombuffer(key.encode(), dtype=np.uint8)


def _ffcv_fields(cfg: ShardConfig, shape: tuple[int, int, int] | None):
    from sluice.errors import require
    require("ffcv", "ffcv", "ffcv", "writing the FFCV .beton")
    from ffcv.fields import BytesField, IntField, NDArrayField, RGBImageField
    if _ffcv_kind(cfg, shape) == "rgb_image":
        mode = "jpg" if cfg.encoding == "jpg" else "raw"
        image = RGBImageField(write_mode=mode, jpeg_quality=cfg.jpeg_quality)
    else:
        image = NDArrayField(np.dtype("uint8"), tuple(shape))
    return {"image": image, "label": IntField(), "index": IntField(), "key": BytesField()}


def _ffcv_kind(cfg: ShardConfig, shape: tuple[int, int, int] | None) -> str:
    """FFCV stores RGB jpg as JPEG; everything lossless (and gray) as a raw uint8 array."""
    rgb = shape is None or shape[2] == 3
    return "rgb_image" if rgb and (cfg.encoding == "jpg" or shape is None) else "ndarray"


def _write_ffcv(path: Path, items, src, cfg: ShardConfig, ncls, shape, workers: int) -> None:
    fields = _ffcv_fields(cfg, shape)
    from ffcv.writer import DatasetWriter

    from ffcv.writer import MIN_PAGE_SIZE
    sample_bytes = int(np.prod(shape)) if shape else 0
    page = MIN_PAGE_SIZE if shape else 4 * MIN_PAGE_SIZE
    while page < 4 * sample_bytes:
        page *= 2
    # Each FFCV worker leaves up to one partly filled page: few workers for small splits.
    workers = max(1, min(workers, (len(items) * max(sample_bytes, 1)) // page))
    view = _FfcvView(items, src, cfg, ncls)
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


class _FfcvJob:
    """Writes every split's .beton, in a forked process beside the tar pool when there is one.

    FFCV's writer spends much of its time waiting (process start, 0.1 s progress polls), so
    running it beside the shard pool hides most of its cost. The fork happens from the main
    thread before the pool exists.
    """

    def __init__(self, work: Path, good, src, cfg: ShardConfig, ncls, shape, workers: int):
        self.work, self.good, self.src, self.cfg = work, good, src, cfg
        self.ncls, self.shape, self.workers = ncls, shape, workers
        self.proc: mp.Process | None = None
        self.error_file = work / ".ffcv-failed"

    def todo(self) -> list[str]:
        if "ffcv" not in self.cfg.formats:
            return []
        return [s for s, items in self.good.items() if items and not (self.work / s / "data.beton").exists()]

    def run(self) -> None:
        for split in self.todo():
            (self.work / split).mkdir(parents=True, exist_ok=True)
            _write_ffcv(self.work / split / "data.beton", self.good[split], self.src, self.cfg, self.ncls,
                        self.shape, self.workers)

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


# ------------------------------------------------------------------ the stage

def dataset_fingerprint(src: Source, ingest: IngestConfig, cfg: ShardConfig) -> str:
    return combine(f"schema{SCHEMA_VERSION}", src.fingerprint(), ingest.split_fingerprint(),
                   cfg.content_fingerprint())


ShardMap = Callable[[dict[str, Any], list[dict]], Iterable[dict]]


def shard_dataset(ingest: IngestConfig | str, out: str | os.PathLike,
                  config: ShardConfig | None = None, map_shards: ShardMap | None = None) -> ShardSummary:
    """Write (or find) the dataset artifact for ``ingest`` under ``out``; see module docstring.

    ``map_shards(spec, tasks)`` replaces the local process pool for the shard writes: it must
    return ``write_shard_from_spec(spec, task)`` for every task, in order, run wherever it likes
    (a Prefect task runner, a Dask cluster whose workers see the same filesystem paths).
    """
    t0 = time.perf_counter()
    cfg = config or ShardConfig()
    ingest = IngestConfig(source=ingest) if isinstance(ingest, str) else ingest
    src = open_source(ingest)
    fp = dataset_fingerprint(src, ingest, cfg)
    version = fp[:16]
    root = join(out, version)
    fs, _ = filesystem(root)
    if fs.exists(join(filesystem(root)[1], "manifest.json")):
        manifest = read_manifest(root)
        _point_latest(out, version)
        return ShardSummary(root, manifest, True, time.perf_counter() - t0)

    work = local_path(root) if is_local(root) else Path(tempfile.gettempdir()) / "sluice-staging" / version
    fresh = not work.exists()
    work.mkdir(parents=True, exist_ok=True)
    atomic.remove_stale_temps(work)
    workers = cfg.workers or os.cpu_count() or 1
    ncls = src.num_classes()
    _JOB.update(src=src, cfg=cfg, num_classes=ncls)
    try:
        plan = plan_splits(src, ingest)
        good, bad, shape = _scan(plan, work, cfg, workers)
        total = sum(len(v) for v in plan.values())
        _check_bad(bad, total, cfg, work if fresh else None)
        tasks = _shard_tasks(good, work, cfg, shape) if "webdataset" in cfg.formats else []
        ffcv = _FfcvJob(work, good, src, cfg, ncls, shape, workers)
        ffcv.start(background=bool(tasks) and workers > 1)
        try:
            if map_shards is not None and tasks:
                spec = {"ingest": ingest.model_dump(mode="json"), "shard": cfg.model_dump(mode="json")}
                results = list(map_shards(spec, tasks))
            else:
                results = list(_run_pool(_write_shard, tasks, workers, lambda t: len(t["items"]),
                                         cfg.progress, "writing shards"))
        finally:
            ffcv.finish()
        manifest = _finish(root, work, src, ingest, cfg, fp, good, bad, shape, results, ncls, workers)
    except KeyboardInterrupt:
        raise
    except SluiceError:
        raise
    except OSError as e:
        raise ShardError(f"writing the artifact under {work} failed: {e}") from e
    finally:
        _JOB.clear()
    if not is_local(root):
        _upload(work, root)
        shutil.rmtree(work, ignore_errors=True)
    _point_latest(out, version)
    written = sum(1 for r in results if not r["reused"])
    return ShardSummary(root, manifest, False, time.perf_counter() - t0, written, len(results) - written)


_OPENED: dict[str, Source] = {}


def write_shard_from_spec(spec: dict[str, Any], task: dict) -> dict:
    """Write one planned shard in any process: the source is opened once per process from the
    spec (so a remote worker needs the same paths), then the shard is written as usual."""
    ingest = IngestConfig.model_validate(spec["ingest"])
    cfg = ShardConfig.model_validate(spec["shard"])
    key = ingest.model_dump_json()
    if key not in _OPENED:
        _OPENED.clear()
        _OPENED[key] = open_source(ingest)
    src = _OPENED[key]
    saved = dict(_JOB)
    _JOB.update(src=src, cfg=cfg, num_classes=src.num_classes())
    try:
        return _write_shard(task)
    finally:
        _JOB.clear()
        _JOB.update(saved)


def _scan(plan, work: Path, cfg: ShardConfig, workers: int):
    """Validate every planned sample once; the result is saved so a resumed run skips it."""
    scan_path = work / ".scan.json"
    if scan_path.exists():
        saved = json.loads(scan_path.read_text())
        if saved.get("plan_sizes") == {k: len(v) for k, v in plan.items()}:
            return saved["good"], saved["bad"], tuple(saved["shape"]) if saved["shape"] else None
    chunk = max(64, min(2000, sum(len(v) for v in plan.values()) // (workers * 8) or 64))
    tasks = [(split, items[k:k + chunk]) for split, items in plan.items() for k in range(0, len(items), chunk)]
    results = list(_run_pool(_scan_chunk, tasks, workers, lambda t: len(t[1]), cfg.progress, "checking samples"))
    good: dict[str, list] = {s: [] for s in plan}
    bad: list[dict] = []
    for (split, items), res in zip(tasks, results):
        for (sp, i), (key, label, info, reason) in zip(items, res):
            if reason is None:
                good[split].append([sp, i, key, label, info])
            else:
                bad.append({"split": split, "key": key, "where": info, "reason": reason})
    shape = _fixed_shape(good, bad, cfg)
    for split in good:
        _dedupe_keys(good[split])
        for g in good[split]:
            del g[4]
    atomic.write_bytes(scan_path, json.dumps({"plan_sizes": {k: len(v) for k, v in plan.items()}, "good": good,
                                              "bad": bad, "shape": list(shape) if shape else None},
                                             separators=(",", ":")).encode())
    return good, bad, shape


def _fixed_shape(good: dict[str, list], bad: list[dict], cfg: ShardConfig):
    """The dataset's (H, W, C); samples of another shape are quarantined where a fixed shape is
    required (raw arrays and FFCV's ndarray field). None when RGB images may vary in size."""
    shapes = Counter(tuple(g[4]) for items in good.values() for g in items)
    if not shapes:
        return None
    common = shapes.most_common(1)[0][0]
    if len(shapes) == 1:
        return common
    variable_ok = cfg.encoding in ("jpg", "png") and all(s[2] == 3 for s in shapes)
    if variable_ok:
        return None
    for split, items in good.items():
        keep = []
        for g in items:
            if tuple(g[4]) == common:
                keep.append(g)
            else:
                bad.append({"split": split, "key": g[2], "where": f"{g[0]}[{g[1]}]",
                            "reason": f"shape {tuple(g[4])} differs from the dataset's {common}; "
                                      "a fixed shape is required here (set shard.image_size to resize)"})
        good[split] = keep
    return common


def _dedupe_keys(items: list[list]) -> None:
    seen: Counter = Counter()
    for g in items:
        n = seen[g[2]]
        seen[g[2]] += 1
        if n:
            g[2] = f"{g[2]}-dup{n}"


def _check_bad(bad: list[dict], total: int, cfg: ShardConfig, remove: Path | None) -> None:
    if total == 0:
        raise ShardError("the source has no samples to shard")
    frac = len(bad) / total
    if frac > cfg.max_bad_fraction or len(bad) == total:
        if remove is not None:
            shutil.rmtree(remove, ignore_errors=True)
        examples = "\n".join(f"  {b['where']} ({b['key']}): {b['reason']}" for b in bad[:5])
        raise TooManyBadSamples(
            f"{len(bad)} of {total} samples ({frac:.1%}) are unusable, more than "
            f"max_bad_fraction={cfg.max_bad_fraction:.1%}; no artifact was written. First problems:\n"
            f"{examples}")


def _samples_per_shard(good: dict[str, list], cfg: ShardConfig) -> int:
    if not cfg.shard_bytes:
        return cfg.shard_samples
    src, ncls = _JOB["src"], _JOB["num_classes"]
    sample = [g for items in good.values() for g in items][:64]
    if not sample:
        return cfg.shard_samples
    sizes = []
    for sp, i, key, label in sample:
        s = src.load(sp, i)
        pixels, _ = _prepare(s, cfg, ncls)
        sizes.append(sum(len(b) + TAR_OVERHEAD for _, b in _sample_members(s, pixels, label, 0, cfg)))
    return max(1, int(cfg.shard_bytes // float(np.mean(sizes))))


def _shard_tasks(good: dict[str, list], work: Path, cfg: ShardConfig, shape) -> list[dict]:
    per = _samples_per_shard(good, cfg)
    tasks = []
    for split, items in good.items():
        (work / split).mkdir(parents=True, exist_ok=True)
        for k, start in enumerate(range(0, len(items), per)):
            tasks.append({"split": split, "shard": k, "first_index": start, "items": items[start:start + per],
                          "tar": str(work / split / f"shard-{k:06d}.tar"),
                          "idx": str(work / split / f"shard-{k:06d}.idx")})
    return tasks


def _record(work: Path, path: Path, sha: str | None = None, size: int | None = None) -> FileRecord:
    return FileRecord(path=path.relative_to(work).as_posix(), bytes=size if size is not None else path.stat().st_size,
                      sha256=sha or sha256_file(path))


def _finish(root, work: Path, src, ingest, cfg, fp, good, bad, shape, results, ncls, workers) -> Manifest:
    """FFCV files, aligned label/key arrays, then the manifest: the artifact becomes visible."""
    splits: dict[str, SplitRecord] = {}
    by_split: dict[str, list[dict]] = {}
    for r in results:
        by_split.setdefault(r["split"], []).append(r)
    for split in SPLITS:
        items = good.get(split, [])
        d = work / split
        d.mkdir(parents=True, exist_ok=True)
        labels = np.array([g[3] for g in items], dtype=np.int64)
        lab_path, key_path = d / "labels.npy", d / "keys.txt"
        with atomic.atomic_path(lab_path) as tmp:
            np.save(tmp, labels, allow_pickle=False)
            if not tmp.exists() and tmp.with_suffix(tmp.suffix + ".npy").exists():
                tmp.with_suffix(tmp.suffix + ".npy").rename(tmp)
        atomic.write_bytes(key_path, "".join(f"{g[2]}\n" for g in items).encode())
        ffcv_rec = _record(work, d / "data.beton") if "ffcv" in cfg.formats and items else None
        shards = []
        for r in sorted(by_split.get(split, []), key=lambda r: r["shard"]):
            tar = _record(work, Path(r["tar"]), r["tar_sha"], r["tar_bytes"])
            idx = _record(work, Path(r["idx"]), r["idx_sha"], r["idx_bytes"]) if r["idx_sha"] else None
            shards.append(ShardRecord(tar=tar, dali_index=idx, first_index=r["first_index"], count=len(r["items"])))
        counts = np.bincount(labels, minlength=ncls or 0).tolist() if len(labels) else [0] * (ncls or 0)
        splits[split] = SplitRecord(count=len(items), shards=shards, ffcv=ffcv_rec,
                                    labels=_record(work, lab_path), keys=_record(work, key_path),
                                    class_counts=counts)
    num_classes = ncls or (max((g[3] for items in good.values() for g in items), default=0) + 1)
    fields = FieldSpecs(
        image=ImageFieldSpec(encoding=cfg.encoding, shape=shape, ffcv_field=_ffcv_kind(cfg, shape)),
        label=LabelFieldSpec(num_classes=num_classes, class_names=src.class_names()))
    files = [f for s in splits.values() for f in _split_files(s)]
    manifest = Manifest(
        fingerprint=fp, content_sha256=hash_obj([f.sha256 for f in files]),
        source=source_record(src),
        config={"ingest": ingest.model_dump(mode="json"), "shard": cfg.model_dump(mode="json")},
        fields=fields, splits=splits,
        quarantine=[QuarantineRecord(**b) for b in bad], formats=cfg.formats)
    write_manifest(work, manifest)
    (work / ".scan.json").unlink(missing_ok=True)
    (work / ".ffcv-failed").unlink(missing_ok=True)
    return manifest


def _upload(work: Path, root: str) -> None:
    """Copy a locally staged artifact to a remote URL, the manifest last."""
    fs, base = filesystem(root)
    files = sorted(p for p in work.rglob("*") if p.is_file() and p.name != "manifest.json")
    for p in files + [work / "manifest.json"]:
        dest = join(base, *p.relative_to(work).parts)
        fs.makedirs(os.path.dirname(dest), exist_ok=True)
        fs.put_file(str(p), dest)


def _point_latest(out: str | os.PathLike, version: str) -> None:
    atomic.write_bytes(join(out, LATEST), (version + "\n").encode())
