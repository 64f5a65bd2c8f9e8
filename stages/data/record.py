"""A written dataset version's record: the per-sample arrays aligned to each split's index
(labels, keys, checksums, content sums, sizes: the base version's, then the new samples'), the
train split's image statistics, and the manifest, written last, which makes the version visible. The shard stage calls it once every
shard and .beton of the run is published (``stages/data/shard.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sluice.stages.data.config import IngestConfig
from sluice.stages.data.encode import SampleEncoder
from sluice.stages.data.formats.ffcv import FAILED as FFCV_FAILED
from sluice.stages.data.formats.ffcv import SUMS as FFCV_SUMS
from sluice.stages.data.formats.ffcv import FfcvWriter, ffcv_field_kind
from sluice.stages.data.formats.tar import ShardWritten
from sluice.stages.data.increment import CONTENT_NAME, SIZES_NAME, Increment
from sluice.stages.data.ingest import source_record
from sluice.stages.data.scan import SCAN_FILE, ScanResult
from sluice.stages.data.stats import image_stats_of
from sluice.storage import atomic, part_records
from sluice.storage.fingerprint import hash_obj, sha256_file
from sluice.storage.manifest import (MAX_ANCESTORS, SPLITS, DamageRecord, FfcvPart, FieldSpecs, FileRecord,
                                     ImageFieldSpec, LabelFieldSpec, Manifest, QuarantineRecord, Relabel,
                                     ShardRecord, SplitRecord, write_manifest)
from sluice.storage.sums import SUMS_NAME, make_sums


@dataclass
class ShardRun:
    """What one run wrote into ``work`` before the version is recorded: how it encoded the
    source, the scan, the increment on its base, the tar shards and the (finished) .beton writer."""
    work: Path
    encoder: SampleEncoder
    ingest: IngestConfig
    found: ScanResult
    inc: Increment
    shards: list[ShardWritten]
    ffcv: FfcvWriter


@dataclass
class VersionIdentity:
    """Who the new version is: its fingerprint, that of its inputs alone (the source and config),
    the source's own, and the version it was written on top of, or why none could be
    (``refused``)."""
    fingerprint: str
    inputs: str
    source: str
    parent: str | None = None
    ancestors: list[str] = field(default_factory=list)
    refused: str | None = None


def _record(work: Path, path: Path, sha: str | None = None, size: int | None = None) -> FileRecord:
    return FileRecord(path=path.relative_to(work).as_posix(), bytes=size if size is not None else path.stat().st_size,
                      sha256=sha or sha256_file(path))


def _save_npy(path: Path, arr: np.ndarray) -> None:
    with atomic.atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, arr, allow_pickle=False)


def record_version(run: ShardRun, identity: VersionIdentity) -> Manifest:
    """Aligned label/key/checksum arrays (the base's, then the new samples'), then the
    manifest: the artifact becomes visible."""
    by_split: dict[str, list[ShardWritten]] = {}
    for r in run.shards:
        by_split.setdefault(r.split, []).append(r)
    splits = {split: _record_split(run, split, sorted(by_split.get(split, []), key=lambda r: r.shard))
              for split in SPLITS}
    manifest = _manifest(run, identity, splits)
    write_manifest(run.work, manifest)
    _drop_scratch(run.work)
    return manifest


def _record_split(run: ShardRun, split: str, written: list[ShardWritten]) -> SplitRecord:
    """One split's arrays written (labels, keys, checksums, content sums: the base's, then the new
    samples'), and its record listing the base's files and the new ones."""
    work, cfg, ncls = run.work, run.encoder.config, run.encoder.num_classes
    base, items = run.inc.bases[split], run.inc.new.get(split, [])
    count = base.count + len(items)
    d = work / split
    d.mkdir(parents=True, exist_ok=True)
    labels = np.concatenate([base.labels, np.array([g.label for g in items], dtype=np.int64)])
    lab_path, key_path, sums_path, content_path = d / "labels.npy", d / "keys.txt", d / SUMS_NAME, d / CONTENT_NAME
    _save_npy(lab_path, labels)
    atomic.write_bytes(key_path, "".join(f"{k}\n" for k in [*base.keys, *(g.key for g in items)]).encode())
    ffcv_parts = list(base.ffcv)
    if "ffcv" in cfg.formats and items:
        ffcv_parts.append(FfcvPart(file=_record(work, run.ffcv.path(split)), first_index=base.count, count=len(items)))
    shards = list(base.shards)
    for r in written:
        tar = _record(work, Path(r.tar), r.tar_sha, r.tar_bytes)
        idx = _record(work, Path(r.idx), r.idx_sha, r.idx_bytes) if r.idx_sha else None
        shards.append(ShardRecord(tar=tar, dali_index=idx, first_index=r.first_index, count=r.count))
    ffcv_sums = np.load(d / FFCV_SUMS, allow_pickle=False) if "ffcv" in cfg.formats and items else None
    new_sums = make_sums(len(items), [c for r in written for c in r.sums] if written else None, ffcv_sums)
    _save_npy(sums_path, np.concatenate([base.sums, new_sums]))
    _save_npy(content_path, np.concatenate([base.content, np.array(run.inc.new_content.get(split, []), np.uint32)]))
    sizes_path = d / SIZES_NAME
    new_sizes = np.array(run.inc.new_sizes.get(split, []), np.uint32).reshape(-1, 2)
    _save_npy(sizes_path, np.concatenate([base.sizes, new_sizes]))
    live = np.ones(count, bool)
    live[sorted(base.removed)] = False
    counts = np.bincount(labels[live], minlength=ncls or 0).tolist() if live.any() else [0] * (ncls or 0)
    return SplitRecord(count=count, shards=shards, ffcv=ffcv_parts[0].file if ffcv_parts else None,
                       ffcv_parts=ffcv_parts[1:], labels=_record(work, lab_path),
                       keys=_record(work, key_path), sums=_record(work, sums_path),
                       content=_record(work, content_path), sizes=_record(work, sizes_path), class_counts=counts,
                       removed=sorted(base.removed),
                       relabelled=[Relabel(index=i, stored=v) for i, v in sorted(base.relabelled.items())])


def _manifest(run: ShardRun, identity: VersionIdentity, splits: dict[str, SplitRecord]) -> Manifest:
    """The version's manifest: its identity, fields, splits, quarantine and, on top of a parent,
    what it wrote and what it reused."""
    src, cfg, found = run.encoder.source, run.encoder.config, run.found
    num_classes = run.encoder.num_classes or \
        max((g.label for items in found.good.values() for g in items), default=0) + 1
    fields = FieldSpecs(
        image=ImageFieldSpec(encoding=cfg.encoding, shape=found.shape,
                             ffcv_field=ffcv_field_kind(cfg, found.shape),
                             stats=image_stats_of(found.sizes.get("train", []), found.totals.get("train", []))),
        label=LabelFieldSpec(num_classes=num_classes, class_names=src.class_names()))
    files = [f for s in splits.values() for f in s.files()]
    delta = run.inc.delta
    if delta is not None:
        delta.written_bytes = sum(f.bytes for f in files if f.version is None)
        delta.reused_bytes = sum(f.bytes for f in files if f.version is not None)
    return Manifest(
        fingerprint=identity.fingerprint, content_sha256=hash_obj([f.sha256 for f in files]),
        source=source_record(src, identity.source),
        config={"ingest": run.ingest.model_dump(mode="json"), "shard": cfg.model_dump(mode="json")},
        fields=fields, splits=splits,
        quarantine=[QuarantineRecord(**b) for b in found.bad], formats=cfg.formats,
        damaged_sources=[DamageRecord(where=w, reason=r) for w, r in src.damaged()],
        parent=identity.parent, ancestors=identity.ancestors[:MAX_ANCESTORS], delta=delta,
        parent_refused=identity.refused, inputs=identity.inputs)


def _drop_scratch(work: Path) -> None:
    """The scan's, the .beton writer's and the shard parts' working files, once the manifest is written."""
    (work / SCAN_FILE).unlink(missing_ok=True)
    (work / FFCV_FAILED).unlink(missing_ok=True)
    for split in SPLITS:
        (work / split / FFCV_SUMS).unlink(missing_ok=True)
        for done in (work / split).glob("*" + part_records.SUFFIX):  # the shard parts' completion records
            done.unlink(missing_ok=True)
