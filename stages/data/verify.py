"""``sluice verify``: every sample of an artifact checked against the checksums written with it.

The loader checks the samples it reads as it reads them; this reads them all, in every format
(the tar shards' image members, the ``.beton``'s image fields and records), and names each
damaged file and sample, so a damaged artifact is found before a nightly run trains on it.
``full`` also re-hashes every file against the manifest's sha256 (what catches damage in bytes no
sample owns: tar headers, padding, unreferenced pages).

The per-sample checks run in parts (a tar shard, or a range of a ``.beton``'s records), in this
process or on a Ray cluster (``engine: ray``, ``stages/data/engine.py``): a part opens the
artifact by its root, so every node must see it at the same path; the report is the same wherever
the parts ran. The files' sizes, sha256 (``full``) and counts are checked where the stage runs.
"""
from __future__ import annotations

import os
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from sluice.errors import ArtifactError
from sluice.stages.data.engine import LocalParts, Parts, keep, kept
from sluice.stages.data.formats.beton import read_layout
from sluice.storage.artifact import DatasetArtifact, open_artifact, verify_file


@dataclass
class Damaged:
    """One damaged sample (``index`` >= 0) or a damaged file as a whole (``index`` -1)."""
    split: str
    file: str
    index: int
    key: str
    reason: str


@dataclass
class VerifyReport:
    root: str
    full: bool
    samples: int = 0  # sample checks made (one per sample and format)
    files: int = 0
    damaged: list[Damaged] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)  # splits without checksums
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.damaged

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}

    def format(self) -> str:
        how = "per-sample checksums and every file's sha256" if self.full else "per-sample checksums"
        lines = [f"sluice verify {self.root} ({how}): {self.samples} sample checks, {self.files} files, "
                 f"{self.seconds:.1f} s"]
        for s in self.unchecked:
            lines.append(f"  split {s!r} has no per-sample checksums (written before them): re-shard it, "
                         "or use --full")
        if self.ok:
            lines.append("  no damage found")
            return "\n".join(lines)
        by_file: dict[str, list[Damaged]] = {}
        for d in self.damaged:
            by_file.setdefault(d.file, []).append(d)
        n = sum(d.index >= 0 for d in self.damaged)
        lines.append(f"  {n} damaged sample{'s' if n != 1 else ''} in {len(by_file)} file{'s' if len(by_file) != 1 else ''}")
        for f, ds in by_file.items():
            samples = [d for d in ds if d.index >= 0]
            lines.append(f"  DAMAGED {f}: " + (f"{len(samples)} damaged sample{'s' if len(samples) != 1 else ''}"
                                               if samples else ds[0].reason))
            for d in samples[:20]:
                lines.append(f"    index {d.index} key {d.key!r}: {d.reason}")
            if len(samples) > 20:
                lines.append(f"    ... and {len(samples) - 20} more")
        lines.append(f"  re-shard: remove {self.root} and run `sluice shard` on its source again "
                     "(same fingerprint, same indices)")
        return "\n".join(lines)


BETON_PART = 20_000  # .beton records per part


def verify_artifact(path: str | os.PathLike, full: bool = False, parts: Parts | None = None) -> VerifyReport:
    """Check every sample of every split (and with ``full`` every file's sha256); never raises
    for damage (the report lists it), only for an artifact that cannot be opened at all.
    ``parts``: where the per-sample checks run (None: here)."""
    import time
    t0 = time.perf_counter()
    art = open_artifact(path)
    keep("artifact", art.root, (art, {}))  # parts run here use the artifact already open, read afresh
    report = VerifyReport(root=art.root, full=full)
    for split, rec in art.manifest.splits.items():
        if rec.count == 0:
            continue
        try:
            art.verify([split], deep=full)
        except ArtifactError as e:
            report.damaged.append(Damaged(split, _file_of(str(e), art, split), -1, "", str(e)))
            if not full:
                continue  # sizes or counts disagree: the per-sample offsets cannot be trusted
        report.files += len([f for f in art.manifest.files() if f.path.startswith(split + "/")])
        if rec.sums is None:
            report.unchecked.append(split)
            continue
        try:
            keys = art.keys(split)
            for what in ("tar", "labels"):  # read here first: a bad file is named before any part runs
                _read(art.root, split, what)
        except ArtifactError as e:
            report.damaged.append(Damaged(split, rec.sums.path, -1, "", str(e)))
            continue
        for d in _check_tars(art, split, parts) + _check_beton(art, split, parts):
            d.key = keys[d.index] if 0 <= d.index < len(keys) else ""
            report.damaged.append(d)
        report.samples += rec.count * (bool(rec.shards) + (rec.ffcv is not None))
    report.seconds = time.perf_counter() - t0
    return report


def _file_of(message: str, art: DatasetArtifact, split: str) -> str:
    for f in art.manifest.files():
        if f.path in message:
            return f.path
    return f"{split}/"


def _opened(root: str) -> tuple[DatasetArtifact, dict]:
    """The artifact at ``root``, opened once per process, with what its parts have read of it."""
    return kept("artifact", root, lambda: (open_artifact(root), {}))


def _read(root: str, split: str, what: str) -> np.ndarray:
    """The split's checksums of one format (``tar``, ``ffcv``: one read of ``sums.npy`` serves
    both) or its stored labels, read once per process."""
    art, reads = _opened(root)
    key = (split, "labels" if what == "labels" else "sums")
    if key not in reads:
        reads[key] = art.stored_labels(split) if what == "labels" else art.sums(split)
    return reads[key] if what == "labels" else reads[key][what]


def _check_tars(art: DatasetArtifact, split: str, parts: Parts | None) -> list[Damaged]:
    """Each tar shard checked as one part (``tar_part``), the damage in shard order."""
    n = len(art.manifest.split(split).shards)
    found = (parts or LocalParts()).ordered(tar_part, ((art.root, split, k) for k in range(n)))
    return [Damaged(*d) for damaged in found for d in damaged]


def tar_part(part: tuple[str, str, int]) -> list[tuple]:
    """(root, split, shard number) -> the shard's damage: each image member's bytes at the offsets
    the DALI index gives (or, without index files, in tar order) against the split's checksums."""
    from sluice.stages.data.formats.tar import image_member_sums
    root, split, k = part
    art, _ = _opened(root)
    sh = art.manifest.split(split).shards[k]
    path = art.local(sh.tar)
    try:
        if sh.dali_index is not None:
            got = _indexed_member_sums(art, sh, art.manifest.fields.image.encoding, path)
        else:
            got = image_member_sums(path, art.manifest.fields.image.encoding)
    except Exception as e:  # noqa: BLE001 - an unreadable shard is damage, named
        return [(split, sh.tar.path, -1, "", f"cannot read its members: {type(e).__name__}: {e}")]
    want = _read(root, split, "tar")[sh.first_index: sh.first_index + sh.count]
    if len(got) != len(want):
        return [(split, sh.tar.path, -1, "", f"{len(got)} image members, {len(want)} expected")]
    return [(split, sh.tar.path, sh.first_index + int(i), "",
             f"image member checksum {got[i]:08x}, written as {int(want[i]):08x}")
            for i in np.flatnonzero(np.asarray(got, np.uint32) != want)]


def _indexed_member_sums(art: DatasetArtifact, sh, ext: str, path) -> list[int]:
    raw = path.read_bytes()
    got = []
    for line in art.local(sh.dali_index).read_text().split("\n")[1:1 + sh.count]:
        parts = line.split()
        j = parts.index(ext)
        off, size = int(parts[j + 1]), int(parts[j + 2])
        got.append(zlib.crc32(raw[off:off + size]) if off + size <= len(raw) else -1)
    return got


def _check_beton(art: DatasetArtifact, split: str, parts: Parts | None) -> list[Damaged]:
    """Each image field's stored bytes where FFCV reads them (the record's pointer), and each
    record's label and index against the labels as stored and the split index, in every
    ``.beton`` part of the split, ``BETON_PART`` records a part (``beton_part``)."""
    todo = [(art.root, split, j, lo, min(lo + BETON_PART, p.count))
            for j, p in enumerate(art.manifest.split(split).ffcv_files()) for lo in range(0, p.count, BETON_PART)]
    return [Damaged(*d) for damaged in (parts or LocalParts()).ordered(beton_part, todo) for d in damaged]


def beton_part(part: tuple[str, str, int, int, int]) -> list[tuple]:
    """(root, split, .beton number, first record, end record) -> those records' damage."""
    root, split, j, lo, hi = part
    art, _ = _opened(root)
    p = art.manifest.split(split).ffcv_files()[j]
    rec, first = p.file, p.first_index
    path = art.local(rec)
    try:
        _, fields, meta, alloc = read_layout(str(path))
        names = meta.dtype.names
        image, label, index = (meta[n] for n in names[:3])
    except Exception as e:  # noqa: BLE001 - a damaged header or table is damage, named
        return [(split, rec.path, -1, "", f"its structure does not hold together: {type(e).__name__}: {e}")] \
            if lo == 0 else []  # said once, by the file's first part
    sums, labels = _read(root, split, "ffcv"), _read(root, split, "labels")
    raw = np.memmap(path, np.uint8, mode="r")
    image, label, index = image[lo:hi], label[lo:hi], index[lo:hi]
    if art.manifest.fields.image.ffcv_field == "ndarray":
        ptr = image.astype(np.int64)
        size = np.full(len(ptr), int(np.prod(art.manifest.fields.image.shape)), np.int64)
    else:
        ptr = image["data_ptr"].astype(np.int64)
        sizes = dict(zip(alloc["ptr"].tolist(), alloc["size"].tolist()))
        size = np.array([sizes.get(int(q), -1) for q in ptr], np.int64)
    out = []
    for k in range(len(ptr)):
        i, q, n = first + lo + k, int(ptr[k]), int(size[k])
        if n < 0 or q + n > len(raw):
            out.append((split, rec.path, i, "", "its record points outside the stored images"))
            continue
        got = zlib.crc32(raw[q:q + n])
        if got != sums[i]:
            out.append((split, rec.path, i, "", f"image field checksum {got:08x}, written as {int(sums[i]):08x}"))
        elif label[k] != labels[i] or index[k] != i:
            out.append((split, rec.path, i, "", f"its record says label {int(label[k])}, index {int(index[k])}; "
                                                f"written as label {int(labels[i])}, index {i}"))
    return out


__all__ = ["VerifyReport", "Damaged", "verify_artifact", "verify_file", "tar_part", "beton_part"]


def check_before_training(root: str | os.PathLike, on_corrupt: str,
                          parts: Parts | None = None) -> tuple[VerifyReport, dict[str, Any]]:
    """The pipeline's check before any rank reads a sample: every sample's checksum (the cheap
    form of ``sluice verify``). Damage fails here, naming it, unless the loader is set to skip
    damaged samples (``on_corrupt: skip``); returns the report and its summary for the run report."""
    r = verify_artifact(root, parts=parts)
    if not r.ok and on_corrupt == "fail":
        raise ArtifactError(r.format() + "\n(loader.on_corrupt: skip trains without the damaged samples)")
    return r, {"ok": r.ok, "samples": r.samples, "seconds": r.seconds, "unchecked": r.unchecked,
               "damaged": [{"file": d.file, "index": d.index, "key": d.key} for d in r.damaged[:100]],
               "damaged_count": len(r.damaged)}
