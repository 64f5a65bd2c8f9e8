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
from sluice.stages.data.increment import CONTENT_NAME, Increment, Parent, find_parent
from sluice.stages.data.increment import plan as plan_increment
from sluice.stages.data.ingest import open_source, source_record
from sluice.stages.data.scan import SCAN_FILE, PlannedSample, ScanResult, check_bad, scan
from sluice.stages.data.sources import Source
from sluice.stages.data.split import plan_splits
from sluice.stages.procs import WorkerDied, map_forked
from sluice.storage import atomic
from sluice.storage.artifact import LATEST
from sluice.storage.gc import GC_LOCK
from sluice.storage.fingerprint import combine, hash_obj, sha256_file
from sluice.storage.locking import exclusive, shared
from sluice.storage.manifest import (MAX_ANCESTORS, SCHEMA_VERSION, SPLITS, DamageRecord, FfcvPart, FieldSpecs, FileRecord,
                                     ImageFieldSpec, LabelFieldSpec, Manifest, QuarantineRecord, Relabel,
                                     ShardRecord, SplitRecord, read_manifest, write_manifest)
from sluice.storage.paths import filesystem, is_local, join, local_path
from sluice.storage.sums import KIND as SUMS_KIND
from sluice.storage.sums import SUMS_NAME, make_sums
from sluice.stages.host import usable_cores

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

    def info(self) -> dict[str, Any]:
        """What the training stage needs to know of this dataset version: plain data, so a
        Prefect task can cache it and a torchrun job can carry it."""
        m = self.manifest
        return {"root": self.root, "fingerprint": m.fingerprint, "counts": m.counts(),
                "quarantined": m.quarantined, "damaged_sources": len(m.damaged_sources),
                "reused": self.reused, "seconds": self.seconds,
                "num_classes": m.fields.label.num_classes,
                "channels": (m.fields.image.shape or (0, 0, 3))[2]}

    def format(self) -> str:
        m = self.manifest
        lines = [f"dataset artifact {self.root}",
                 f"  fingerprint {m.fingerprint[:16]}  source {m.source.kind}:{m.source.uri}",
                 f"  {'split':<8} {'samples':>8} {'shards':>7} {'MB':>9}"]
        for name, s in m.splits.items():
            mb = sum(f.bytes for f in s.files()) / 1e6
            gone = f"  ({len(s.removed)} removed)" if s.removed else ""
            lines.append(f"  {name:<8} {s.live_count:>8} {len(s.shards):>7} {mb:>9.1f}{gone}")
        lines.append(f"  total {sum(s.live_count for s in m.splits.values())} samples, {m.total_bytes() / 1e6:.1f} MB, "
                     f"formats {', '.join(m.formats)}, encoding {m.fields.image.encoding}")
        if m.delta is not None:
            d = m.delta
            lines.append(f"  on top of {m.parent}: {sum(d.added.values())} added, {len(d.changed)} changed, "
                         f"{len(d.relabelled)} relabelled, {len(d.removed)} removed; "
                         f"{d.written_bytes / 1e6:.1f} MB written, {d.reused_bytes / 1e6:.1f} MB reused")
        if m.parent_refused:
            lines.append(f"  written whole: {m.parent_refused}")
        lines.append(f"  quarantined {m.quarantined}")
        for d in m.damaged_sources:
            lines.append(f"  DAMAGED SOURCE {d.where}: {d.reason}")
        state = "up to date (nothing rewritten)" if self.reused else \
            f"{self.shards_written} shards written, {self.shards_reused} reused from an earlier run"
        lines.append(f"  {state} in {self.seconds:.1f} s")
        return "\n".join(lines)


@contextlib.contextmanager
def _bar(total: int, desc: str, enabled: bool) -> Iterator[Callable[[int], Any]]:
    from tqdm import tqdm
    bar = tqdm(total=total, desc=desc, unit="sample", disable=not enabled, dynamic_ncols=True, leave=False)
    try:
        yield bar.update
    finally:
        bar.close()


def dataset_fingerprint(src: Source, ingest: IngestConfig, cfg: ShardConfig) -> str:
    # the checksum kinds are part of what is written: artifacts from before sums.npy (or
    # content.npy) get a new version
    return combine(f"schema{SCHEMA_VERSION}", f"sums:{SUMS_KIND}", "content:crc32", src.fingerprint(),
                   ingest.split_fingerprint(), cfg.content_fingerprint())


ShardMap = Callable[[dict[str, Any], list[dict]], Iterable[dict]]


def shard_dataset(ingest: IngestConfig | str, out: str | os.PathLike,
                  config: ShardConfig | None = None, map_shards: ShardMap | None = None) -> ShardSummary:
    """Write (or find) the dataset artifact for ``ingest`` under ``out``; see module docstring.

    With ``config.incremental`` (the default) a changed source gets a version written on top of
    the newest one under ``out`` (``stages/data/increment.py``): only new and changed samples are
    written. ``map_shards(spec, tasks)`` replaces the local process pool for the shard writes: it
    must return ``write_shard_from_spec(spec, task)`` for every task, in order, run wherever it
    likes (a Prefect task runner, a Dask cluster whose workers see the same filesystem paths).
    """
    t0 = time.perf_counter()
    cfg = config or ShardConfig()
    ingest = IngestConfig(source=ingest) if isinstance(ingest, str) else ingest
    src = open_source(ingest)
    whole = dataset_fingerprint(src, ingest, cfg)
    with _no_gc(out):  # gc waits: a version found here, or a parent written on, must stay
        done = _finished(out, whole[:16], t0)  # this very source, written whole before
        if done is not None:
            return done
        parent, refused = find_parent(out, src, ingest, cfg) if cfg.incremental else (None, None)
        if parent is not None and (parent.manifest.inputs or parent.manifest.fingerprint) == whole:
            done = _finished(out, parent.version, t0)  # nothing changed since the newest version
            if done is not None:
                return done
        fp = combine(whole, f"parent:{parent.manifest.fingerprint}") if parent is not None else whole
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
            manifest, results = _write(src, ingest, cfg, fp, work, map_shards, parent, refused, whole)
            if not is_local(root):
                _upload(work, root)
                shutil.rmtree(work, ignore_errors=True)
        _point_latest(out, version)
    written = sum(1 for r in results if not r.reused)
    return ShardSummary(root, manifest, False, time.perf_counter() - t0, written, len(results) - written)


@contextlib.contextmanager
def _no_gc(out: str | os.PathLike) -> Iterator[None]:
    """Hold off ``sluice gc`` on a local output while a version is planned and written."""
    if not is_local(out):
        yield
        return
    with shared(local_path(out) / GC_LOCK):
        yield


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
           map_shards: ShardMap | None, parent: Parent | None = None,
           refused: str | None = None, inputs: str | None = None) -> tuple[Manifest, list[ShardWritten]]:
    """Scan, then write every shard and .beton of what is new into ``work`` and the manifest
    last. Files are published one by one (atomically), so a killed run resumes from what it
    finished."""
    fresh = not work.exists()
    work.mkdir(parents=True, exist_ok=True)
    atomic.remove_stale_temps(work)
    workers = cfg.workers or usable_cores()
    job = ShardJob(src, cfg, src.num_classes())
    try:
        splits = plan_splits(src, ingest)
        with _bar(sum(len(v) for v in splits.values()), "checking samples", cfg.progress) as advance:
            found = scan(job, splits, work, workers, advance)
        check_bad(found, cfg, work if fresh else None)
        if parent is not None and parent.manifest.fields.image.shape != found.shape:
            refused = (f"the newest version {parent.version} holds images of shape "
                       f"{parent.manifest.fields.image.shape}, the source now {found.shape}; this version was "
                       "written whole")
            parent = None
        inc = plan_increment(parent, found)
        tasks = _shard_tasks(job, inc, work) if "webdataset" in cfg.formats else []
        ffcv = FfcvWriter(work, inc.new, job, found.shape, {s: b.count for s, b in inc.bases.items()})
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
        ancestry = [parent.manifest.fingerprint, *parent.manifest.ancestors] if parent else []
        return _finish(work, src, ingest, cfg, fp, found, results, inc, ffcv,
                       parent.version if parent else None, refused, inputs, ancestry), results
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


def _shard_tasks(job: ShardJob, inc: Increment, work: Path) -> list[ShardTask]:
    """The tar shards of the new samples: after the base's shards, numbered and indexed on."""
    per = _samples_per_shard(job, inc.new)
    tasks = []
    for split, items in inc.new.items():
        (work / split).mkdir(parents=True, exist_ok=True)
        base = inc.bases[split]
        for n, start in enumerate(range(0, len(items), per)):
            k = len(base.shards) + n
            tasks.append(ShardTask(split=split, shard=k, first_index=base.count + start,
                                   items=[tuple(g) for g in items[start:start + per]],  # pickles faster
                                   tar=str(work / split / f"shard-{k:06d}.tar"),
                                   idx=str(work / split / f"shard-{k:06d}.idx")))
    return tasks


def _record(work: Path, path: Path, sha: str | None = None, size: int | None = None) -> FileRecord:
    return FileRecord(path=path.relative_to(work).as_posix(), bytes=size if size is not None else path.stat().st_size,
                      sha256=sha or sha256_file(path))


def _save_npy(path: Path, arr: np.ndarray) -> None:
    with atomic.atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, arr, allow_pickle=False)


def _finish(work: Path, src: Source, ingest: IngestConfig, cfg: ShardConfig, fp: str,
            found: ScanResult, results: list[ShardWritten], inc: Increment, ffcv: FfcvWriter,
            parent: str | None, refused: str | None, inputs: str | None = None,
            ancestors: list[str] | None = None) -> Manifest:
    """Aligned label/key/checksum arrays (the base's, then the new samples'), then the
    manifest: the artifact becomes visible."""
    splits: dict[str, SplitRecord] = {}
    by_split: dict[str, list[ShardWritten]] = {}
    for r in results:
        by_split.setdefault(r.split, []).append(r)
    ncls = src.num_classes()
    for split in SPLITS:
        base, items = inc.bases[split], inc.new.get(split, [])
        count = base.count + len(items)
        d = work / split
        d.mkdir(parents=True, exist_ok=True)
        labels = np.concatenate([base.labels, np.array([g.label for g in items], dtype=np.int64)])
        lab_path, key_path, sums_path, content_path = d / "labels.npy", d / "keys.txt", d / SUMS_NAME, d / CONTENT_NAME
        _save_npy(lab_path, labels)
        atomic.write_bytes(key_path, "".join(f"{k}\n" for k in [*base.keys, *(g.key for g in items)]).encode())
        ffcv_parts = list(base.ffcv)
        if "ffcv" in cfg.formats and items:
            ffcv_parts.append(FfcvPart(file=_record(work, ffcv.path(split)), first_index=base.count, count=len(items)))
        shards = list(base.shards)
        written = sorted(by_split.get(split, []), key=lambda r: r.shard)
        for r in written:
            tar = _record(work, Path(r.tar), r.tar_sha, r.tar_bytes)
            idx = _record(work, Path(r.idx), r.idx_sha, r.idx_bytes) if r.idx_sha else None
            shards.append(ShardRecord(tar=tar, dali_index=idx, first_index=r.first_index, count=r.count))
        ffcv_sums = np.load(d / FFCV_SUMS, allow_pickle=False) if "ffcv" in cfg.formats and items else None
        new_sums = make_sums(len(items), [c for r in written for c in r.sums] if written else None, ffcv_sums)
        _save_npy(sums_path, np.concatenate([base.sums, new_sums]))
        _save_npy(content_path, np.concatenate([base.content, np.array(inc.new_content.get(split, []), np.uint32)]))
        live = np.ones(count, bool)
        live[sorted(base.removed)] = False
        counts = np.bincount(labels[live], minlength=ncls or 0).tolist() if live.any() else [0] * (ncls or 0)
        splits[split] = SplitRecord(count=count, shards=shards, ffcv=ffcv_parts[0].file if ffcv_parts else None,
                                    ffcv_parts=ffcv_parts[1:], labels=_record(work, lab_path),
                                    keys=_record(work, key_path), sums=_record(work, sums_path),
                                    content=_record(work, content_path), class_counts=counts,
                                    removed=sorted(base.removed),
                                    relabelled=[Relabel(index=i, stored=v) for i, v in sorted(base.relabelled.items())])
    num_classes = ncls or (max((g.label for items in found.good.values() for g in items), default=0) + 1)
    fields = FieldSpecs(
        image=ImageFieldSpec(encoding=cfg.encoding, shape=found.shape,
                             ffcv_field=ffcv_field_kind(cfg, found.shape)),
        label=LabelFieldSpec(num_classes=num_classes, class_names=src.class_names()))
    files = [f for s in splits.values() for f in s.files()]
    delta = inc.delta
    if delta is not None:
        delta.written_bytes = sum(f.bytes for f in files if f.version is None)
        delta.reused_bytes = sum(f.bytes for f in files if f.version is not None)
    manifest = Manifest(
        fingerprint=fp, content_sha256=hash_obj([f.sha256 for f in files]),
        source=source_record(src),
        config={"ingest": ingest.model_dump(mode="json"), "shard": cfg.model_dump(mode="json")},
        fields=fields, splits=splits,
        quarantine=[QuarantineRecord(**b) for b in found.bad], formats=cfg.formats,
        damaged_sources=[DamageRecord(where=w, reason=r) for w, r in src.damaged()],
        parent=parent, ancestors=(ancestors or [])[:MAX_ANCESTORS], delta=delta, parent_refused=refused,
        inputs=inputs or fp)
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
