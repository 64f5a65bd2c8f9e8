"""A new dataset version on top of the newest one: only what changed is written.

A growing source is re-sharded every night. Its version's split index space is the parent's,
unchanged, with the new samples appended; the parent's tar shards, DALI indexes and ``.beton``
are listed in the new manifest as they are (``FileRecord.version`` names the directory that holds
them), and only new and changed samples are encoded into new files. So every backend, exact
order, resume at any world size and per-sample state aligned to the index keep working, and a
night writes bytes in proportion to what it brought.

Sizes (``sizes.npy``) and the train split's statistics need no parent data: the scan decodes
every sample of the source, so it sizes every live one and sums the pixels of exactly the live
train samples (a parent written before sizes gets its live samples' sizes from this scan).

By key, against the parent's live samples (``content.npy``: a CRC-32 of each sample's pixels):

* a new key is appended (``Delta.added``);
* a key the source no longer has is removed: its index goes into ``SplitRecord.removed`` and no
  backend yields it again (a deletion request; its bytes stay in the parent's files until
  ``sluice gc`` drops the last version that reads them);
* a key whose pixels changed is removed at its old index and appended anew (``Delta.changed``);
* a key whose label changed keeps its bytes: ``labels.npy`` takes the new label, and
  ``SplitRecord.relabelled`` the label its files still carry (``Delta.relabelled``).

A parent is used only when it is readable and was written the same way (the same source, split
membership, encoding and formats, with per-sample checksums and content sums): otherwise the
version is written whole and the manifest says why (``Manifest.parent_refused``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from sluice.errors import ArtifactError
from sluice.stages.data.config import IngestConfig, ShardConfig
from sluice.stages.data.scan import PlannedSample, ScanResult
from sluice.stages.data.sources import Source
from sluice.storage.artifact import LATEST, DatasetArtifact
from sluice.storage.manifest import (SCHEMA_VERSION, SPLITS, Delta, FfcvPart, FileRecord, Manifest,
                                     ShardRecord, read_manifest)
from sluice.storage.paths import exists, join, read_bytes
from sluice.storage.sums import SUMS_DTYPE

CONTENT_NAME = "content.npy"
SIZES_NAME = "sizes.npy"


@dataclass
class SplitBase:
    """What a split of the new version starts from: the parent's samples, indices kept."""
    count: int = 0
    shards: list[ShardRecord] = field(default_factory=list)
    ffcv: list[FfcvPart] = field(default_factory=list)
    labels: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    keys: list[str] = field(default_factory=list)
    sums: np.ndarray = field(default_factory=lambda: np.zeros(0, SUMS_DTYPE))
    content: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint32))
    # (height, width) by index: the parent's, with every sample still live re-taken from this scan
    # (so a parent written before sizes.npy gets them); (0, 0) for a removed sample never sized
    sizes: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.uint32))
    removed: set[int] = field(default_factory=set)
    relabelled: dict[int, int] = field(default_factory=dict)  # index -> label its files carry


@dataclass
class Parent:
    version: str
    artifact: DatasetArtifact

    @property
    def manifest(self) -> Manifest:
        return self.artifact.manifest


@dataclass
class Increment:
    """The new version's plan: per split its base and the samples to write after it."""
    bases: dict[str, SplitBase]
    new: dict[str, list[PlannedSample]]
    new_content: dict[str, list[int]]
    delta: Delta | None
    new_sizes: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # aligned to ``new``


def find_parent(out: str | os.PathLike, src: Source, ingest: IngestConfig,
                cfg: ShardConfig) -> tuple[Parent | None, str | None]:
    """The version LATEST names under ``out`` if a new version may be written on top of it, else
    (None, why not); (None, None) when there is no earlier version at all."""
    if not exists(join(out, LATEST)):
        return None, None
    version = read_bytes(join(out, LATEST)).decode().strip()
    root = join(out, version)
    try:
        manifest = read_manifest(root)
    except (ArtifactError, OSError, ValueError) as e:
        return None, f"the newest version {version} is unreadable ({e}); this version was written whole"
    why = _incompatible(manifest, src, ingest, cfg)
    if why:
        return None, f"the newest version {version} {why}; this version was written whole"
    try:
        art = DatasetArtifact(root)
        art.verify(deep=False)  # present, sizes right, the small per-sample files re-hashed
    except (ArtifactError, OSError) as e:
        return None, f"the newest version {version} is damaged ({e}); this version was written whole"
    return Parent(version, art), None


def _incompatible(m: Manifest, src: Source, ingest: IngestConfig, cfg: ShardConfig) -> str | None:
    if m.schema_version != SCHEMA_VERSION:
        return f"has artifact schema {m.schema_version}, not {SCHEMA_VERSION}"
    if (m.source.kind, m.source.uri) != (src.kind, src.uri):
        return f"came from another source ({m.source.kind}:{m.source.uri})"
    try:
        theirs_ingest = IngestConfig.model_validate(m.config.get("ingest", {}))
        theirs_shard = ShardConfig.model_validate(m.config.get("shard", {}))
    except ValueError:
        return "was written with settings this Sluice cannot read"
    if theirs_ingest.membership_fingerprint() != ingest.membership_fingerprint():
        return "splits its samples differently (seed or split fractions)"
    if theirs_shard.content_fingerprint() != cfg.content_fingerprint():
        return "was encoded differently (shard settings)"
    if list(m.formats) != list(cfg.formats):
        return f"has other formats ({', '.join(m.formats)})"
    if any(s.sums is None or s.content is None for s in m.splits.values()):
        return "has no per-sample checksums or content sums (written by an older Sluice)"
    return None


def _reused(rec: FileRecord, version: str) -> FileRecord:
    return rec if rec.version is not None else rec.model_copy(update={"version": version})


def _load(parent: Parent, split: str) -> SplitBase:
    art, v = parent.artifact, parent.version
    s = art.manifest.splits.get(split)
    if s is None or s.count == 0:
        return SplitBase()
    content, sums = art.content(split), art.sums(split)
    assert content is not None and sums is not None  # checked by _incompatible
    sizes = art.sizes(split)
    return SplitBase(
        sizes=sizes.astype(np.uint32) if sizes is not None else np.zeros((s.count, 2), np.uint32),
        count=s.count,
        shards=[sh.model_copy(update={"tar": _reused(sh.tar, v),
                                      "dali_index": _reused(sh.dali_index, v) if sh.dali_index else None})
                for sh in s.shards],
        ffcv=[p.model_copy(update={"file": _reused(p.file, v)}) for p in s.ffcv_files()],
        labels=art.labels(split).astype(np.int64), keys=art.keys(split), sums=sums,
        content=content, removed=set(s.removed),
        relabelled={r.index: r.stored for r in s.relabelled})


def plan(parent: Parent | None, found: ScanResult) -> Increment:
    """What to write: everything (no parent), or the delta against the parent's live samples."""
    if parent is None:
        return Increment({s: SplitBase() for s in SPLITS}, {s: found.good.get(s, []) for s in SPLITS},
                         {s: found.content.get(s, []) for s in SPLITS}, None,
                         {s: found.sizes.get(s, []) for s in SPLITS})
    delta = Delta()
    bases, new, new_content, new_sizes = {}, {}, {}, {}
    for split in SPLITS:
        base = _load(parent, split)
        live = {k: i for i, k in enumerate(base.keys) if i not in base.removed}
        items, crcs, hws = found.good.get(split, []), found.content.get(split, []), found.sizes.get(split, [])
        add, add_crc, add_hw, seen = [], [], [], set()
        for g, crc, hw in zip(items, crcs, hws):
            i = live.get(g.key)
            if i is None:
                add.append(g)
                add_crc.append(crc)
                add_hw.append(hw)
                continue
            seen.add(i)
            if int(base.content[i]) != crc:  # same key, new pixels: the old sample is gone
                base.removed.add(i)
                delta.changed.append(g.key)
                add.append(g)
                add_crc.append(crc)
                add_hw.append(hw)
                continue
            base.sizes[i] = hw  # unchanged pixels: the same size, now known even to an older parent
            if g.label != int(base.labels[i]):
                stored = base.relabelled.get(i, int(base.labels[i]))
                base.labels[i] = g.label
                if g.label == stored:
                    base.relabelled.pop(i, None)
                else:
                    base.relabelled[i] = stored
                delta.relabelled.append(g.key)
        for k, i in live.items():
            if i not in seen:
                base.removed.add(i)
                delta.removed.append(k)
        added = len(add) - sum(1 for g in add if g.key in live)
        if added:
            delta.added[split] = added
        bases[split], new[split], new_content[split], new_sizes[split] = base, add, add_crc, add_hw
    return Increment(bases, new, new_content, delta, new_sizes)
