"""The dataset artifact's manifest: what is in it, where, and how to check it.

An artifact directory is complete exactly when its ``manifest.json`` exists: the manifest is
written last and atomically, so readers never act on a half-written artifact.

Layout of one artifact (``<root>/<fingerprint[:16]>/``)::

    manifest.json
    <split>/shard-000000.tar     WebDataset shard: <key>.<npy|png|jpg>, <key>.cls, <key>.idx
    <split>/shard-000000.idx     DALI index (wds2idx format v1.2)
    <split>/data.beton           FFCV file: fields image, label, index
    <split>/labels.npy           int64 labels aligned to the split index
    <split>/keys.txt             sample keys aligned to the split index, one per line
    <split>/sums.npy             per-sample CRC-32s aligned to the split index (storage/sums.py)
    <split>/content.npy          CRC-32 of each sample's decoded pixels: what tells a changed sample
                                 from an unchanged one when the next version is written
    <split>/sizes.npy            uint32 (count, 2): each sample's stored (height, width), by split index

**Image statistics.** ``fields.image.stats`` (``ImageStats``) describes the train split's images
as stored: per-channel pixel mean and std (0..1) and a size summary, taken by the shard stage's
scan where each sample's pixels are decoded anyway; what a recipe sets its normalisation,
channels and resolution from (``sluice.stages.data.stats.image_stats``).

**Incremental versions.** A version written on top of a parent (``parent``) lists the parent's
files it reuses with ``FileRecord.version`` = the parent directory that holds them (a sibling of
this one under the dataset root); a split's index space is the parent's, unchanged, with the new
samples appended (new tar shards and a new ``.beton`` part, ``SplitRecord.ffcv_parts``). A sample
the source no longer has, or whose content changed, stays in the files but is listed in
``SplitRecord.removed``: no backend yields it (the loader orders live indices only). A relabelled
sample keeps its stored bytes; ``labels.npy`` holds its new label and ``SplitRecord.relabelled``
the label its files still carry. ``delta`` says what this version changed against its parent.

``sums`` is an optional field of the split record, not a new schema version: an artifact written
before it (no sums) stays readable, its samples unchecked (the loader warns once). A Sluice
older than it refuses a manifest that has it (unknown field), rather than reading unchecked.
``sizes`` and ``stats`` are optional the same way: None in an artifact written before them.
"""
from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from sluice.errors import ArtifactError
from sluice.storage import atomic
from sluice.storage.paths import join, read_bytes

# 2: a sample's split follows its key (stages/data/split.py); 1: a permutation of the sample
# count. The files are laid out alike, so both are read; a new shard run writes 2.
SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)
MANIFEST_NAME = "manifest.json"
SPLITS = ("train", "holdout", "val", "test")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FileRecord(_Model):
    """One file of the artifact, with what a reader needs to verify it."""
    path: str  # relative to the root of the version that holds it, '/'-separated
    bytes: int
    sha256: str
    # The sibling version directory holding the file (an ancestor's, reused); None: this one.
    version: str | None = None


class FfcvPart(_Model):
    """A ``.beton`` holding the split indices ``first_index .. first_index + count - 1`` (its
    records' ``index`` field says the split index; FFCV's own sample ids start at 0 per file)."""
    file: FileRecord
    first_index: int
    count: int


class Relabel(_Model):
    """A sample whose label changed after its files were written: ``labels.npy`` has the new
    label, the tar's ``.cls`` and the ``.beton`` still hold ``stored``."""
    index: int
    stored: int


class ShardRecord(_Model):
    """A WebDataset shard, its DALI index, and the split indices it holds."""
    tar: FileRecord
    dali_index: FileRecord | None = None
    first_index: int
    count: int


class SplitRecord(_Model):
    count: int
    shards: list[ShardRecord] = Field(default_factory=list)
    ffcv: FileRecord | None = None
    labels: FileRecord
    keys: FileRecord
    sums: FileRecord | None = None  # per-sample checksums (storage/sums.py); None: written before them
    content: FileRecord | None = None  # per-sample CRC-32 of the decoded pixels; None: written before it
    sizes: FileRecord | None = None  # per-sample stored (height, width), uint32; None: written before it
    class_counts: list[int] = Field(default_factory=list)  # over live samples
    # Incremental versions: .beton files after ``ffcv`` (which then holds indices 0..), the indices
    # no backend may yield (removed from the source, or content changed), sorted, and relabels.
    ffcv_parts: list[FfcvPart] = Field(default_factory=list)
    removed: list[int] = Field(default_factory=list)
    relabelled: list[Relabel] = Field(default_factory=list)

    @property
    def live_count(self) -> int:
        return self.count - len(self.removed)

    def ffcv_files(self) -> list[FfcvPart]:
        """Every ``.beton`` of the split with the indices it holds, in index order."""
        if self.ffcv is None:
            return []
        first = self.count - sum(p.count for p in self.ffcv_parts)
        return [FfcvPart(file=self.ffcv, first_index=0, count=first), *self.ffcv_parts]

    def files(self) -> list[FileRecord]:
        out: list[FileRecord] = []
        for sh in self.shards:
            out.append(sh.tar)
            if sh.dali_index:
                out.append(sh.dali_index)
        out += [p.file for p in self.ffcv_files()]
        return out + [r for r in self.per_sample_files() if r]

    def per_sample_files(self) -> list[FileRecord | None]:
        """The small files aligned to the split index (labels, keys, checksums, content sums,
        sizes), None where this split has no such file."""
        return [self.labels, self.keys, self.sums, self.content, self.sizes]


class Delta(_Model):
    """What a version changed against its parent, by key."""
    added: dict[str, int] = Field(default_factory=dict)  # split -> samples appended (new keys)
    removed: list[str] = Field(default_factory=list)  # keys the source no longer has
    changed: list[str] = Field(default_factory=list)  # keys whose pixels changed (old index removed, re-added)
    relabelled: list[str] = Field(default_factory=list)  # keys whose label changed (bytes reused)
    reused_bytes: int = 0  # bytes of the parent's files this version uses as they are
    written_bytes: int = 0  # bytes this version wrote (its own files, manifest excluded)


class Spread(_Model):
    """The smallest, median and largest of a per-sample quantity."""
    min: int
    median: float
    max: int


class SizeSummary(_Model):
    """How big a split's stored images are: height, width, short side, and how many distinct
    (height, width) pairs there are (1: a fixed shape)."""
    height: Spread
    width: Spread
    short_side: Spread
    distinct: int


class ImageStats(_Model):
    """A split's images as stored (after EXIF rotation, compositing, resizing and channel
    conversion), over its live samples: what a recipe sets normalisation (``mean``, ``std``:
    per channel, pixel values scaled to 0..1, over every pixel of every image, so a big image
    weighs more than a small one), the model's input channels and its training resolution
    (``sizes``) from."""
    split: str = "train"
    samples: int
    pixels: int  # summed over the samples
    channels: int
    mean: list[float]
    std: list[float]
    sizes: SizeSummary


class ImageFieldSpec(_Model):
    encoding: Literal["npy", "png", "jpg"]
    # Fixed (H, W, C) when every sample has it; None for variable sizes (jpg/png only).
    shape: tuple[int, int, int] | None
    dtype: Literal["uint8"] = "uint8"
    ffcv_field: Literal["ndarray", "rgb_image"]
    stats: ImageStats | None = None  # the train split's; None: written before them, or no train samples


class LabelFieldSpec(_Model):
    num_classes: int
    class_names: list[str] = Field(default_factory=list)


class FieldSpecs(_Model):
    image: ImageFieldSpec
    label: LabelFieldSpec
    # The split index and key travel with every sample: `.idx` (int64 LE) and the tar key in
    # WebDataset/DALI; the `index` int field in FFCV; keys.txt for all.
    index: Literal["int64"] = "int64"
    key: Literal["str"] = "str"


class SourceRecord(_Model):
    kind: str
    uri: str
    fingerprint: str
    details: dict[str, Any] = Field(default_factory=dict)


class QuarantineRecord(_Model):
    """A sample left out of the artifact, and why."""
    split: str
    key: str
    where: str  # file (and offset/member) it came from
    reason: str


class DamageRecord(_Model):
    """A damaged source file whose readable part was kept (``ingest.keep_damaged``)."""
    where: str
    reason: str


MAX_ANCESTORS = 1000  # a version a night: years of lineage in a few tens of KiB


class Manifest(_Model):
    schema_version: int = SCHEMA_VERSION
    fingerprint: str  # hash of source content + config + schema: same inputs, same artifact
    content_sha256: str  # hash over every file record, in order
    created_at: str = Field(default_factory=lambda: datetime.now(timezone.utc).isoformat())
    source: SourceRecord
    config: dict[str, Any]
    fields: FieldSpecs
    splits: dict[str, SplitRecord]
    quarantine: list[QuarantineRecord] = Field(default_factory=list)
    damaged_sources: list[DamageRecord] = Field(default_factory=list)
    formats: list[Literal["webdataset", "dali", "ffcv"]]
    parent: str | None = None  # the version this one was written on top of (its directory name)
    # The fingerprints of the versions this one descends from, nearest first (at most
    # MAX_ANCESTORS): "is version A an ancestor of this one" without reading A, which gc may
    # have removed.
    ancestors: list[str] = Field(default_factory=list)
    # The hash of the source's content and the config alone (``fingerprint`` also hashes the
    # parent's): equal for two versions of the same source state, however they were written.
    inputs: str | None = None
    delta: Delta | None = None
    # Why this version was written whole although an earlier version exists (parent unreadable,
    # another config, no per-sample content sums): the clear, recorded outcome of a refused parent.
    parent_refused: str | None = None

    @property
    def quarantined(self) -> int:
        return len(self.quarantine)

    def counts(self) -> dict[str, int]:
        return {name: s.count for name, s in self.splits.items()}

    def files(self) -> list[FileRecord]:
        """Every file the manifest vouches for, in a stable order."""
        return [f for name in sorted(self.splits) for f in self.splits[name].files()]

    def own_files(self) -> list[FileRecord]:
        """The files this version wrote itself (not reused from an ancestor)."""
        return [f for f in self.files() if f.version is None]

    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files())

    def split(self, name: str) -> SplitRecord:
        if name not in self.splits:
            raise KeyError(f"split {name!r} is not in this artifact; it has {sorted(self.splits)}")
        return self.splits[name]


def write_manifest(root: str | os.PathLike, manifest: Manifest) -> None:
    atomic.write_bytes(join(root, MANIFEST_NAME), (manifest.model_dump_json(indent=2) + "\n").encode())


def read_manifest(root: str | os.PathLike) -> Manifest:
    path = join(root, MANIFEST_NAME)
    try:
        raw = read_bytes(path)
    except FileNotFoundError:
        raise ArtifactError(f"no dataset artifact at {root}: {MANIFEST_NAME} is missing "
                            "(not written yet, or the shard run did not finish)") from None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path} is not valid JSON: {e}") from None
    version = data.get("schema_version")
    if version not in READABLE_SCHEMAS:
        raise ArtifactError(f"{path} has schema version {version}; this Sluice reads "
                            f"{', '.join(map(str, READABLE_SCHEMAS))}")
    return Manifest.model_validate(data)
