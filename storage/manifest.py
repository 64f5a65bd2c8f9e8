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

``sums`` is an optional field of the split record, not a new schema version: an artifact written
before it (no sums) stays readable, its samples unchecked (the loader warns once). A Sluice
older than it refuses a manifest that has it (unknown field), rather than reading unchecked.
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
    path: str  # relative to the artifact root, '/'-separated
    bytes: int
    sha256: str


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
    class_counts: list[int] = Field(default_factory=list)


class ImageFieldSpec(_Model):
    encoding: Literal["npy", "png", "jpg"]
    # Fixed (H, W, C) when every sample has it; None for variable sizes (jpg/png only).
    shape: tuple[int, int, int] | None
    dtype: Literal["uint8"] = "uint8"
    ffcv_field: Literal["ndarray", "rgb_image"]


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

    @property
    def quarantined(self) -> int:
        return len(self.quarantine)

    def counts(self) -> dict[str, int]:
        return {name: s.count for name, s in self.splits.items()}

    def files(self) -> list[FileRecord]:
        """Every file the manifest vouches for, in a stable order."""
        out: list[FileRecord] = []
        for name in sorted(self.splits):
            s = self.splits[name]
            for sh in s.shards:
                out.append(sh.tar)
                if sh.dali_index:
                    out.append(sh.dali_index)
            if s.ffcv:
                out.append(s.ffcv)
            out += [s.labels, s.keys] + ([s.sums] if s.sums else [])
        return out

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
