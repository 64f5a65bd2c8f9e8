"""The sharding stage: a source becomes a versioned dataset artifact.

Every split is written as WebDataset tar shards (with a DALI index per shard) and one FFCV
``.beton``, plus ``labels.npy``, ``keys.txt`` and ``sums.npy`` (per-sample checksums of the bytes
each format stores, ``storage/sums.py``) aligned to the split index. The artifact lives in
``<out>/<fingerprint[:16]>/`` where the fingerprint hashes the source's content and the config,
so re-running with the same inputs is a no-op and new data gets a new version.

Two passes keep indices stable while writing in parallel: a scan (``scan``) finds which samples
are usable (quarantining the rest) and fixes every sample's split index; then shards are written
by a pool of processes (``formats.tar``; the .beton writer beside it, ``formats.ffcv``), each shard
published atomically. A killed run resumes: finished shards are kept, and the manifest (written
last) is what makes the artifact visible.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from sluice.errors import ShardError, SluiceError
from sluice.stages.data.config import IngestConfig, PrepareConfig, ShardConfig
from sluice.stages.data.encode import ShardJob
from sluice.stages.data.formats.ffcv import FAILED as FFCV_FAILED
from sluice.stages.data.formats.ffcv import SUMS as FFCV_SUMS
from sluice.stages.data.formats.ffcv import FfcvWriter, ffcv_field_kind
from sluice.stages.data.formats.tar import ShardTask, ShardWritten, mean_sample_bytes, write_tar_shard
from sluice.stages.data.ingest import open_source, source_record
from sluice.stages.data.scan import SCAN_FILE, PlannedSample, ScanResult, check_bad, scan
from sluice.stages.data.sources import Source
from sluice.stages.data.split import plan_splits
from sluice.stages.procs import WorkerDied, map_forked
from sluice.storage import atomic
from sluice.storage.artifact import LATEST
from sluice.storage.fingerprint import combine, hash_obj, sha256_file
from sluice.storage.locking import exclusive
from sluice.storage.manifest import (SCHEMA_VERSION, SPLITS, DamageRecord, FieldSpecs, FileRecord, ImageFieldSpec,
                                     LabelFieldSpec, Manifest, QuarantineRecord, ShardRecord,
                                     SplitRecord, read_manifest, write_manifest)
from sluice.storage.paths import filesystem, is_local, join, local_path
from sluice.storage.sums import KIND as SUMS_KIND
from sluice.storage.sums import SUMS_NAME, make_sums

__all__ = ["PrepareConfig", "ShardConfig", "IngestConfig", "ShardSummary", "shard_dataset",
           "dataset_fingerprint", "write_shard_from_spec"]


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
        for d in m.damaged_sources:
            lines.append(f"  DAMAGED SOURCE {d.where}: {d.reason}")
        state = "up to date (nothing rewritten)" if self.reused else \
            f"{self.shards_written} shards written, {self.shards_reused} reused from an earlier run"
        lines.append(f"  {state} in {self.seconds:.1f} s")
        return "\n".join(lines)


def _split_files(s: SplitRecord) -> list[FileRecord]:
    return [r for sh in s.shards for r in (sh.tar, sh.dali_index) if r] + \
           [r for r in (s.ffcv, s.labels, s.keys, s.sums) if r]


@contextlib.contextmanager
def _bar(total: int, desc: str, enabled: bool) -> Iterator[Callable[[int], Any]]:
    from tqdm import tqdm
    bar = tqdm(total=total, desc=desc, unit="sample", disable=not enabled, dynamic_ncols=True, leave=False)
    try:
        yield bar.update
    finally:
        bar.close()


def dataset_fingerprint(src: Source, ingest: IngestConfig, cfg: ShardConfig) -> str:
    # the checksum kind is part of what is written: artifacts from before sums.npy get a new version
    return combine(f"schema{SCHEMA_VERSION}", f"sums:{SUMS_KIND}", src.fingerprint(), ingest.split_fingerprint(),
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
    done = _finished(out, version, t0)
    if done is not None:
        return done
    work = local_path(root) if is_local(root) else Path(tempfile.gettempdir()) / "sluice-staging" / version
    # One writer per version: a second run on the same output waits, then finds the artifact.
    with exclusive(work.parent / f".{version}.lock", on_wait=lambda who: _tell(
            f"sluice shard: {root} is being written by {who}; waiting for it to finish")):
        done = _finished(out, version, t0)
        if done is not None:
            return done
        manifest, results = _write(src, ingest, cfg, fp, work, map_shards)
        if not is_local(root):
            _upload(work, root)
            shutil.rmtree(work, ignore_errors=True)
    _point_latest(out, version)
    written = sum(1 for r in results if not r.reused)
    return ShardSummary(root, manifest, False, time.perf_counter() - t0, written, len(results) - written)


def _finished(out: str | os.PathLike, version: str, t0: float) -> ShardSummary | None:
    """The summary of an artifact that is already complete (its manifest exists), else None."""
    root = join(out, version)
    fs, path = filesystem(root)
    if not fs.exists(join(path, "manifest.json")):
        return None
    manifest = read_manifest(root)
    _point_latest(out, version)
    return ShardSummary(root, manifest, True, time.perf_counter() - t0)


def _write(src: Source, ingest: IngestConfig, cfg: ShardConfig, fp: str, work: Path,
           map_shards: ShardMap | None) -> tuple[Manifest, list[ShardWritten]]:
    """Scan, then write every shard and .beton into ``work`` and the manifest last. Files are
    published one by one (atomically), so a killed run resumes from what it finished."""
    fresh = not work.exists()
    work.mkdir(parents=True, exist_ok=True)
    atomic.remove_stale_temps(work)
    workers = cfg.workers or os.cpu_count() or 1
    job = ShardJob(src, cfg, src.num_classes())
    try:
        plan = plan_splits(src, ingest)
        with _bar(sum(len(v) for v in plan.values()), "checking samples", cfg.progress) as advance:
            found = scan(job, plan, work, workers, advance)
        check_bad(found, cfg, work if fresh else None)
        tasks = _shard_tasks(job, found, work) if "webdataset" in cfg.formats else []
        ffcv = FfcvWriter(work, found.good, job, found.shape)
        ffcv.start(background=bool(tasks) and workers > 1)
        try:
            if map_shards is not None and tasks:
                spec = {"ingest": ingest.model_dump(mode="json"), "shard": cfg.model_dump(mode="json")}
                results = [ShardWritten(**r) for r in map_shards(spec, [asdict(t) for t in tasks])]
            else:
                results = []
                with _bar(sum(len(t.items) for t in tasks), "writing shards", cfg.progress) as advance:
                    for r in map_forked(write_tar_shard, job, tasks, workers):
                        results.append(r)
                        advance(r.count)
        except BaseException:
            ffcv.abort()  # nothing may go on writing once the stage has failed
            raise
        ffcv.finish()
        return _finish(work, src, ingest, cfg, fp, found, results), results
    except WorkerDied as e:
        raise ShardError(f"writing the artifact under {work} failed: {e}") from None
    except OSError as e:
        if isinstance(e, SluiceError):
            raise
        raise ShardError(f"writing the artifact under {work} failed: {e}") from e


def _tell(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


_OPENED: dict[str, ShardJob] = {}  # per process: the source a remote shard writer opened last


def write_shard_from_spec(spec: dict[str, Any], task: dict) -> dict:
    """Write one planned shard in any process: the source is opened once per process from the
    spec (so a remote worker needs the same paths), then the shard is written as usual."""
    ingest = IngestConfig.model_validate(spec["ingest"])
    cfg = ShardConfig.model_validate(spec["shard"])
    key = ingest.model_dump_json() + cfg.model_dump_json()
    if key not in _OPENED:
        _OPENED.clear()
        src = open_source(ingest)
        _OPENED[key] = ShardJob(src, cfg, src.num_classes())
    return asdict(write_tar_shard(_OPENED[key], ShardTask.from_dict(task)))


def _samples_per_shard(job: ShardJob, good: dict[str, list[PlannedSample]]) -> int:
    cfg = job.config
    sample = [g for items in good.values() for g in items][:64]
    if not cfg.shard_bytes or not sample:
        return cfg.shard_samples
    return max(1, int(cfg.shard_bytes // mean_sample_bytes(job, sample)))


def _shard_tasks(job: ShardJob, found: ScanResult, work: Path) -> list[ShardTask]:
    per = _samples_per_shard(job, found.good)
    tasks = []
    for split, items in found.good.items():
        (work / split).mkdir(parents=True, exist_ok=True)
        for k, start in enumerate(range(0, len(items), per)):
            tasks.append(ShardTask(split=split, shard=k, first_index=start,
                                   items=[tuple(g) for g in items[start:start + per]],  # pickles faster
                                   tar=str(work / split / f"shard-{k:06d}.tar"),
                                   idx=str(work / split / f"shard-{k:06d}.idx")))
    return tasks


def _record(work: Path, path: Path, sha: str | None = None, size: int | None = None) -> FileRecord:
    return FileRecord(path=path.relative_to(work).as_posix(), bytes=size if size is not None else path.stat().st_size,
                      sha256=sha or sha256_file(path))


def _finish(work: Path, src: Source, ingest: IngestConfig, cfg: ShardConfig, fp: str,
            found: ScanResult, results: list[ShardWritten]) -> Manifest:
    """Aligned label/key arrays, then the manifest: the artifact becomes visible."""
    splits: dict[str, SplitRecord] = {}
    by_split: dict[str, list[ShardWritten]] = {}
    for r in results:
        by_split.setdefault(r.split, []).append(r)
    ncls = src.num_classes()
    for split in SPLITS:
        items = found.good.get(split, [])
        d = work / split
        d.mkdir(parents=True, exist_ok=True)
        labels = np.array([g.label for g in items], dtype=np.int64)
        lab_path, key_path = d / "labels.npy", d / "keys.txt"
        with atomic.atomic_path(lab_path) as tmp:
            np.save(tmp, labels, allow_pickle=False)
            if not tmp.exists() and tmp.with_suffix(tmp.suffix + ".npy").exists():
                tmp.with_suffix(tmp.suffix + ".npy").rename(tmp)
        atomic.write_bytes(key_path, "".join(f"{g.key}\n" for g in items).encode())
        ffcv_rec = _record(work, d / "data.beton") if "ffcv" in cfg.formats and items else None
        shards = []
        written = sorted(by_split.get(split, []), key=lambda r: r.shard)
        for r in written:
            tar = _record(work, Path(r.tar), r.tar_sha, r.tar_bytes)
            idx = _record(work, Path(r.idx), r.idx_sha, r.idx_bytes) if r.idx_sha else None
            shards.append(ShardRecord(tar=tar, dali_index=idx, first_index=r.first_index, count=r.count))
        ffcv_sums = np.load(d / FFCV_SUMS, allow_pickle=False) if ffcv_rec is not None else None
        sums = make_sums(len(items), [c for r in written for c in r.sums] if written else None, ffcv_sums)
        sums_path = d / SUMS_NAME
        with atomic.atomic_path(sums_path) as tmp:
            with open(tmp, "wb") as f:
                np.save(f, sums, allow_pickle=False)
        counts = np.bincount(labels, minlength=ncls or 0).tolist() if len(labels) else [0] * (ncls or 0)
        splits[split] = SplitRecord(count=len(items), shards=shards, ffcv=ffcv_rec,
                                    labels=_record(work, lab_path), keys=_record(work, key_path),
                                    sums=_record(work, sums_path), class_counts=counts)
    num_classes = ncls or (max((g.label for items in found.good.values() for g in items), default=0) + 1)
    fields = FieldSpecs(
        image=ImageFieldSpec(encoding=cfg.encoding, shape=found.shape,
                             ffcv_field=ffcv_field_kind(cfg, found.shape)),
        label=LabelFieldSpec(num_classes=num_classes, class_names=src.class_names()))
    files = [f for s in splits.values() for f in _split_files(s)]
    manifest = Manifest(
        fingerprint=fp, content_sha256=hash_obj([f.sha256 for f in files]),
        source=source_record(src),
        config={"ingest": ingest.model_dump(mode="json"), "shard": cfg.model_dump(mode="json")},
        fields=fields, splits=splits,
        quarantine=[QuarantineRecord(**b) for b in found.bad], formats=cfg.formats,
        damaged_sources=[DamageRecord(where=w, reason=r) for w, r in src.damaged()])
    write_manifest(work, manifest)
    (work / SCAN_FILE).unlink(missing_ok=True)
    (work / FFCV_FAILED).unlink(missing_ok=True)
    for split in SPLITS:
        (work / split / FFCV_SUMS).unlink(missing_ok=True)
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
