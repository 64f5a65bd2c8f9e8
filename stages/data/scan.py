"""The sharding stage's first pass: validate every planned sample once, quarantine the ones that
cannot be used (with the reason and where they came from), and fix each usable sample's split
index and key. The result is saved in the work directory, so a resumed run skips the pass."""
from __future__ import annotations

import json
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from sluice.errors import SampleError, ShardError, TooManyBadSamples
from sluice.stages.data.config import ShardConfig
from sluice.stages.data.encode import SampleEncoder
from sluice.stages.data.split import SplitPlan
from sluice.stages.worker_pool import map_forked
from sluice.storage import atomic
from sluice.storage.sums import crc32

SCAN_FILE = ".scan.json"
Shape = tuple[int, int, int]


class PlannedSample(NamedTuple):
    """A usable sample: where it is in the source, and its key and label in the artifact."""
    source_split: str
    source_index: int
    key: str
    label: int


@dataclass
class ScanResult:
    good: dict[str, list[PlannedSample]]  # our split -> usable samples, in split-index order
    bad: list[dict]  # quarantine records (split, key, where, reason)
    shape: Shape | None  # the fixed (H, W, C), or None for variable-size RGB images
    # our split -> CRC-32 of each good sample's prepared pixels (aligned to ``good``): what tells
    # a changed sample from an unchanged one across versions (``content.npy``)
    content: dict[str, list[int]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(len(v) for v in self.good.values()) + len(self.bad)


def check_chunk(encoder: SampleEncoder, chunk: list[tuple[str, int]]) -> list[tuple]:
    """Decode and validate each (source split, index) of a chunk (in a pool worker): per sample
    ``(key, where, label, shape, None, content crc)``, or ``(key, where, None, None, reason, 0)``
    when it is unusable. Plain tuples: they cross the process boundary by the thousand."""
    out = []
    for sp, i in chunk:
        key, where = encoder.source.describe(sp, i)
        try:
            s = encoder.source.load(sp, i)
            key, where = s.key, s.where
            pixels, label = encoder.prepare(s)
            out.append((key, where, label, pixels.shape, None, content_crc(pixels)))
        except SampleError as e:
            out.append((key, where, None, None, str(e), 0))
    return out


def content_crc(pixels) -> int:
    """CRC-32 of a sample's prepared pixels and shape: equal for a sample whose content did not change."""
    return crc32(repr(tuple(pixels.shape)).encode() + pixels.tobytes())


def scan(encoder: SampleEncoder, plan: SplitPlan, work: Path, workers: int, progress) -> ScanResult:
    """Validate every planned sample once (``progress(n)`` after each chunk); reuse a saved scan
    of the same plan."""
    scan_path = work / SCAN_FILE
    sizes = {k: len(v) for k, v in plan.items()}
    if scan_path.exists():
        saved = json.loads(scan_path.read_text())
        if saved.get("plan_sizes") == sizes and "content" in saved:
            good = {s: [PlannedSample(*g) for g in items] for s, items in saved["good"].items()}
            return ScanResult(good, saved["bad"], tuple(saved["shape"]) if saved["shape"] else None,
                              saved["content"])
    n = sum(sizes.values())
    step = max(64, min(2000, n // (workers * 8) or 64))
    chunks = [(split, items[k:k + step]) for split, items in plan.items() for k in range(0, len(items), step)]
    good: dict[str, list[PlannedSample]] = {s: [] for s in plan}
    shapes: dict[str, list[tuple[Shape, str]]] = {s: [] for s in plan}  # and where each came from
    bad: list[dict] = []
    crcs: dict[tuple[str, int], int] = {}
    for (split, items), res in zip(chunks, map_forked(check_chunk, encoder, [c for _, c in chunks], workers)):
        g, sh = good[split], shapes[split]
        for (sp, i), (key, where, label, shape, reason, crc) in zip(items, res):
            if reason is None:
                g.append(PlannedSample(sp, i, key, label))
                sh.append((shape, where))
                crcs[(sp, i)] = crc
            else:
                bad.append({"split": split, "key": key, "where": where, "reason": reason})
        progress(len(items))
    shape = _fixed_shape(good, shapes, bad, encoder.config)
    good = {split: _dedupe(items) for split, items in good.items()}
    content = {split: [crcs[(g.source_split, g.source_index)] for g in items] for split, items in good.items()}
    atomic.write_bytes(scan_path, json.dumps({"plan_sizes": sizes, "good": good, "bad": bad,
                                              "shape": list(shape) if shape else None, "content": content},
                                             separators=(",", ":")).encode())
    return ScanResult(good, bad, shape, content)


def _fixed_shape(good: dict[str, list[PlannedSample]], shapes: dict[str, list[tuple[Shape, str]]],
                 bad: list[dict], cfg: ShardConfig) -> Shape | None:
    """The dataset's (H, W, C); samples of another shape are quarantined where a fixed shape is
    required (raw arrays and FFCV's ndarray field). None when RGB images may vary in size."""
    counts = Counter(s for sh in shapes.values() for s, _ in sh)
    if not counts:
        return None
    common = counts.most_common(1)[0][0]
    if len(counts) == 1:
        return common
    if cfg.encoding in ("jpg", "png") and all(s[2] == 3 for s in counts):
        return None  # variable-size RGB images are fine
    for split, items in good.items():
        keep = []
        for g, (s, where) in zip(items, shapes[split]):
            if s == common:
                keep.append(g)
            else:
                bad.append({"split": split, "key": g.key, "where": where,
                            "reason": f"shape {s} differs from the dataset's {common}; a fixed shape "
                                      f"is required here ({_shape_hint(s, common)})"})
        good[split] = keep
    return common


def _shape_hint(shape: Shape, common: Shape) -> str:
    """The setting that makes ``shape`` fit: channels, size, or both."""
    fixes = []
    if shape[:2] != common[:2]:
        fixes.append(f"set shard.image_size=[{common[0]},{common[1]}] to resize")
    if shape[2] != common[2]:
        fixes.append(f"set shard.channels={common[2]} to convert {'gray to RGB' if common[2] == 3 else 'RGB to gray'}")
    return " and ".join(fixes)


def _dedupe(items: list[PlannedSample]) -> list[PlannedSample]:
    """Keys unique within the split: repeats get ``-dup1``, ``-dup2``..."""
    seen: Counter = Counter()
    out = []
    for g in items:
        n = seen[g.key]
        seen[g.key] += 1
        out.append(g._replace(key=f"{g.key}-dup{n}") if n else g)
    return out


def check_bad(result: ScanResult, cfg: ShardConfig, remove: Path | None) -> None:
    """Refuse (and remove a fresh work directory) when more samples were bad than allowed."""
    total, bad = result.total, result.bad
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
