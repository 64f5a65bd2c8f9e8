"""The sharding stage: a source becomes a versioned dataset artifact.

Every split is written as WebDataset tar shards (with a DALI index per shard) and one FFCV
``.beton``, plus ``labels.npy``, ``keys.txt``, ``sums.npy`` (per-sample checksums of the bytes
each format stores, ``storage/sums.py``) and ``sizes.npy`` aligned to the split index; the
manifest holds the train split's image statistics (``stages/data/stats.py``). The artifact lives
in ``<out>/<fingerprint[:16]>/`` where the fingerprint hashes the source's content and the
config (``encoding: auto`` made concrete for the source first, ``ShardConfig.for_source``), so
re-running with the same inputs is a no-op and new data gets a new version.

Two passes keep indices stable while writing in parallel: a scan (``scan``) finds which samples
are usable (quarantining the rest) and fixes every sample's split index; then shards are written
by a pool of processes or the engine's parts (``formats.tar``; the .beton writer beside it,
``formats.ffcv``), each shard published atomically and then its completion record; a strict merge
reads every planned shard's record back (``storage/part_records.py``) before the manifest is
written. A killed run resumes: recorded shards are kept (the summary says how many), and the
manifest (written last) is what makes the artifact visible.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from sluice.errors import ShardError, SluiceError
from sluice.stages.data.config import IngestConfig, PrepareConfig, ShardConfig
from sluice.stages.data.encode import SampleEncoder
from sluice.stages.data.engine import RayParts, kept
from sluice.stages.data.formats import beton
from sluice.stages.data.formats.ffcv import FfcvWriter
from sluice.stages.data.formats.tar import ShardTask, ShardWritten, mean_sample_bytes, shard_plan, write_tar_shard
from sluice.stages.data.increment import Increment, Parent, find_parent
from sluice.stages.data.increment import plan as plan_increment
from sluice.stages.data.ingest import open_source
from sluice.stages.data.record import ShardRun, VersionIdentity, record_version
from sluice.stages.data.scan import PlannedSample, check_bad, check_chunk, scan
from sluice.stages.data.sources import Source
from sluice.stages.data.split import plan_splits
from sluice.stages.host import workers_or_cores
from sluice.stages.worker_pool import WorkerDied, map_forked
from sluice.storage import atomic, part_records
from sluice.storage.artifact import LATEST
from sluice.storage.fingerprint import combine
from sluice.storage.gc import GC_LOCK
from sluice.storage.locking import exclusive, shared
from sluice.storage.manifest import SCHEMA_VERSION, Manifest, read_manifest
from sluice.storage.paths import filesystem, is_local, join, local_path
from sluice.storage.sums import KIND as SUMS_KIND

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


def dataset_fingerprint(source_fp: str, ingest: IngestConfig, cfg: ShardConfig) -> str:
    """The version's inputs: the source's content fingerprint (``Source.fingerprint``, which
    hashes every source byte: taken once per run) with the config that shapes what is written."""
    # the checksum kinds are part of what is written: artifacts from before sums.npy (or
    # content.npy) get a new version
    return combine(f"schema{SCHEMA_VERSION}", f"sums:{SUMS_KIND}", "content:crc32", source_fp,
                   ingest.split_fingerprint(), cfg.content_fingerprint())


ShardMap = Callable[[dict[str, Any], list[dict]], Iterable[dict]]


def shard_dataset(ingest: IngestConfig | str, out: str | os.PathLike,
                  config: ShardConfig | None = None, map_shards: ShardMap | None = None) -> ShardSummary:
    """Write (or find) the dataset artifact for ``ingest`` under ``out``; see module docstring.

    With ``config.incremental`` (the default) a changed source gets a version written on top of
    the newest one under ``out`` (``stages/data/increment.py``): only new and changed samples are
    written. ``map_shards`` is where the parts run instead of the local pool: the engine's Ray
    parts (``stages/data/engine.py``: the scan's chunks and the shard writes), or a callable
    ``map_shards(spec, tasks)`` for the shard writes alone: it
    must return ``write_shard_from_spec(spec, task)`` for every task, in order, run wherever it
    likes (a Prefect task runner, a Dask cluster whose workers see the same filesystem paths).
    """
    t0 = time.perf_counter()
    ingest = IngestConfig(source=ingest) if isinstance(ingest, str) else ingest
    src = open_source(ingest)
    cfg = (config or ShardConfig()).for_source(src)  # encoding: auto made concrete before any hash
    source_fp = src.fingerprint()
    whole = dataset_fingerprint(source_fp, ingest, cfg)
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
            identity = VersionIdentity(
                fp, whole, source_fp, parent.version if parent else None,
                [parent.manifest.fingerprint, *parent.manifest.ancestors] if parent else [], refused)
            manifest, results = _write(src, ingest, cfg, work, map_shards, parent, identity)
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


def _write(src: Source, ingest: IngestConfig, cfg: ShardConfig, work: Path, map_shards: ShardMap | None,
           parent: Parent | None, identity: VersionIdentity) -> tuple[Manifest, list[ShardWritten]]:
    """Scan, then write every shard and .beton of what is new on top of ``parent`` into ``work``
    and the manifest last. Files are published one by one (atomically), so a killed run resumes
    from what it finished."""
    fresh = not work.exists()
    work.mkdir(parents=True, exist_ok=True)
    atomic.remove_stale_temps(work)
    workers = workers_or_cores(cfg.workers)
    encoder = SampleEncoder(src, cfg, src.num_classes())
    try:
        splits = plan_splits(src, ingest)
        spec = {"ingest": ingest.model_dump(mode="json"), "shard": cfg.model_dump(mode="json"), "channels": None}
        on = (lambda chunks: map_shards.ordered(scan_part, ((spec, c) for c in chunks))) \
            if isinstance(map_shards, RayParts) else None  # the scan's chunks where the shard map runs
        with _bar(sum(len(v) for v in splits.values()), "checking samples", cfg.progress) as advance:
            found = scan(encoder, splits, work, workers, advance, on)
        check_bad(found, cfg, work if fresh else None)
        encoder.channels = found.channels  # gray turned RGB by every writer, where the scan said so
        if parent is not None and parent.manifest.fields.image.shape != found.shape:
            refused = (f"the newest version {parent.version} holds images of shape "
                       f"{parent.manifest.fields.image.shape}, the source now {found.shape}; this version was "
                       "written whole")
            parent, identity = None, replace(identity, parent=None, ancestors=[], refused=refused)
        inc = plan_increment(parent, found)
        tasks = _shard_tasks(encoder, inc, work) if "webdataset" in cfg.formats else []
        plans = {t.tar: shard_plan(encoder, t) for t in tasks}  # what each part's record must say
        ffcv = FfcvWriter(work, inc.new, encoder, found.shape, {s: b.count for s, b in inc.bases.items()},
                          page_bytes=_largest_samples(inc, cfg, found.shape), shards=tasks,
                          wait=_recorded(plans))
        ffcv.start(background=bool(tasks) and (workers > 1 or map_shards is not None))  # parts run elsewhere
        try:
            if map_shards is not None and tasks:
                spec = {"ingest": ingest.model_dump(mode="json"), "shard": cfg.model_dump(mode="json"),
                        "channels": encoder.channels}
                done = map_shards.all(write_part, [(spec, asdict(t)) for t in tasks], "shard parts") \
                    if isinstance(map_shards, RayParts) else map_shards(spec, [asdict(t) for t in tasks])
                said = [ShardWritten(**r) for r in done]
            else:
                said = []
                with _bar(sum(len(t.items) for t in tasks), "writing shards", cfg.progress) as advance:
                    for r in map_forked(write_tar_shard, encoder, tasks, workers):
                        said.append(r)
                        advance(r.count)
            results = _merge(tasks, plans, said, work, cfg.merge_wait_s)
        except BaseException:
            ffcv.abort()  # nothing may go on writing once the stage has failed
            raise
        ffcv.finish()
        return record_version(ShardRun(work, encoder, ingest, found, inc, results, ffcv), identity), results
    except WorkerDied as e:
        raise ShardError(f"writing the artifact under {work} failed: {e}") from None
    except OSError as e:
        if isinstance(e, SluiceError):
            raise
        raise ShardError(f"writing the artifact under {work} failed: {e}") from e


def _merge(tasks: list[ShardTask], plans: dict[str, str], said: list[ShardWritten], work: Path,
           wait_s: float) -> list[ShardWritten]:
    """The strict merge: every planned shard's completion record read back from storage
    (``storage/part_records.py``), not what the engine handed back, so a part that is missing,
    partial or written for another plan is refused by name (a missing one after
    ``wait_s``), wherever the parts ran. What the engine said is only whether a part was
    reused; a part that says other bytes than its record is foreign too."""
    if len(said) != len(tasks):
        raise ShardError(f"the shard map returned {len(said)} results for {len(tasks)} planned shards")
    records = part_records.merge([(t.tar, plans[t.tar]) for t in tasks], wait_s,
                                 name=lambda p: p.relative_to(work).as_posix())
    out = []
    for t, rec, r in zip(tasks, records, said):
        w = ShardWritten(**{**rec, "reused": r.reused})
        if (w.tar_sha, w.idx_sha) != (r.tar_sha, r.idx_sha):
            raise part_records.PartRefused(
                f"the merge refused {Path(t.tar).relative_to(work).as_posix()}: foreign, its completion record "
                f"says sha256 {w.tar_sha[:12]}, the part that ran said {r.tar_sha[:12]} (another writer?)")
        out.append(w)
    return out


def _recorded(plans: dict[str, str]) -> Callable[[ShardTask], None]:
    """Wait until a shard part's completion record is there for its plan (the .beton writer takes
    its images from the shard; the stage kills the writer if the parts fail)."""
    def wait(task: ShardTask) -> None:
        while part_records.reusable(task.tar, plans[task.tar]) is None:
            time.sleep(0.05)
    return wait


def _tell(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def encoder_from_spec(spec: dict[str, Any]) -> SampleEncoder:
    """The source opened and its encoder made once per process from a spec (so a remote worker
    needs the same paths as the stage)."""
    ingest = IngestConfig.model_validate(spec["ingest"])
    cfg = ShardConfig.model_validate(spec["shard"])  # resolved: never ``auto`` here
    key = ingest.model_dump_json() + cfg.model_dump_json() + repr(spec.get("channels"))

    def make() -> SampleEncoder:
        src = open_source(ingest)
        return SampleEncoder(src, cfg, src.num_classes(), spec.get("channels"))
    return kept("encoder", key, make)


def write_shard_from_spec(spec: dict[str, Any], task: dict) -> dict:
    """Write one planned shard in any process (``encoder_from_spec``), as the pool writes it."""
    return asdict(write_tar_shard(encoder_from_spec(spec), ShardTask.from_dict(task)))


def write_part(part: tuple[dict[str, Any], dict]) -> dict:
    """(spec, a planned shard) -> ``write_shard_from_spec``: a part of the engine's shard map."""
    return write_shard_from_spec(*part)


def scan_part(part: tuple[dict[str, Any], list[tuple[str, int]]]) -> list[tuple]:
    """(spec, a chunk of planned samples) -> ``scan.check_chunk``'s verdicts, in any process."""
    spec, chunk = part
    return check_chunk(encoder_from_spec(spec), chunk)


def _largest_samples(inc: Increment, cfg: ShardConfig, shape) -> dict[str, int]:
    """Per split, an upper bound of the bytes the .beton stores for its largest new sample
    (image and key), so variable-size photos get pages sized to them rather than FFCV's 8 MiB
    default (``beton.page_size_for``): from each sample's stored size (the scan's), as raw RGB
    or as the largest JPEG libjpeg-turbo can make of it (``beton.jpeg_bound``)."""
    if shape is not None:
        return {}
    out = {}
    for split, hws in inc.new_sizes.items():
        if not hws:
            continue
        key = max(len(g.key.encode()) for g in inc.new[split])
        image = max(beton.jpeg_bound(h, w) if cfg.encoding == "jpg" else 3 * h * w for h, w in hws)
        out[split] = image + key
    return out


def _samples_per_shard(encoder: SampleEncoder, good: dict[str, list[PlannedSample]]) -> int:
    cfg = encoder.config
    sample = [g for items in good.values() for g in items][:64]
    if not cfg.shard_bytes or not sample:
        return cfg.shard_samples
    return max(1, int(cfg.shard_bytes // mean_sample_bytes(encoder, sample)))


def _shard_tasks(encoder: SampleEncoder, inc: Increment, work: Path) -> list[ShardTask]:
    """The tar shards of the new samples: after the base's shards, numbered and indexed on."""
    per = _samples_per_shard(encoder, inc.new)
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
