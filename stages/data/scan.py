"""The sharding stage's first pass: validate every planned sample once, quarantine the ones that
cannot be used (with the reason and where they came from), and fix each usable sample's split
index and key. The result is saved in the work directory, so a resumed run skips the pass."""
from __future__ import annotations

import json
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

import numpy as np

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
    # our split -> each good sample's stored (height, width), aligned to ``good`` (``sizes.npy``)
    sizes: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    # our split -> [pixels, sum per channel..., sum of squares per channel...] over its good
    # samples as stored (exact integers, so the statistics do not depend on how the scan was cut)
    totals: dict[str, list[int]] = field(default_factory=dict)
    # the channels the writers convert every sample to (``SampleEncoder.channels``): 3 where gray
    # and RGB photos mix or photos vary in size; None: as decoded
    channels: int | None = None

    @property
    def total(self) -> int:
        return sum(len(v) for v in self.good.values()) + len(self.bad)


class Checked(NamedTuple):
    """One usable sample as the scan saw it: its pixels' shape, content CRC (and the CRC its
    pixels would have as RGB, for a gray one while channels are open), and per channel the sum
    and the sum of squares of its pixel values."""
    shape: Shape
    where: str
    crc: int
    crc_rgb: int | None
    sums: tuple[int, ...]


_LEVELS = np.arange(256, dtype=np.int64)


def pixel_sums(pixels: np.ndarray) -> tuple[int, ...]:
    """Per channel the sum of the pixel values, then per channel the sum of their squares:
    exact integers (from a histogram of each channel), added up across samples in any order."""
    flat = pixels.reshape(-1, pixels.shape[2])
    hists = [np.bincount(flat[:, c], minlength=256) for c in range(flat.shape[1])]
    return tuple(int(h @ _LEVELS) for h in hists) + tuple(int(h @ (_LEVELS * _LEVELS)) for h in hists)


def check_chunk(encoder: SampleEncoder, chunk: list[tuple[str, int]]) -> list[tuple]:
    """Decode and validate each (source split, index) of a chunk (in a pool worker): per sample
    ``(key, where, label, Checked, None)``, or ``(key, where, None, None, reason)`` when it is
    unusable. Plain tuples: they cross the process boundary by the thousand. The pixels are
    decoded here once, so their size and statistics are taken here too."""
    out = []
    open_channels = encoder.config.channels is None
    for sp, i in chunk:
        key, where = encoder.source.describe(sp, i)
        try:
            s = encoder.source.load(sp, i)
            key, where = s.key, s.where
            pixels, label = encoder.prepare(s)
            rgb = content_crc(np.repeat(pixels, 3, axis=2)) if open_channels and pixels.shape[2] == 1 else None
            out.append((key, where, label, tuple(Checked(pixels.shape, where, content_crc(pixels), rgb,
                                                         pixel_sums(pixels))), None))
        except SampleError as e:
            out.append((key, where, None, None, str(e)))
    return out


def content_crc(pixels) -> int:
    """CRC-32 of a sample's prepared pixels and shape: equal for a sample whose content did not change."""
    return crc32(repr(tuple(pixels.shape)).encode() + pixels.tobytes())


def scan(encoder: SampleEncoder, plan: SplitPlan, work: Path, workers: int, progress,
         elsewhere: Callable[[list], Iterable[list[tuple]]] | None = None) -> ScanResult:
    """Validate every planned sample once (``progress(n)`` after each chunk); reuse a saved scan
    of the same plan. ``elsewhere(chunks)``: each chunk's ``check_chunk`` verdicts, in order, run
    somewhere else (a Ray cluster's parts); None: this machine's pool of ``workers``."""
    scan_path = work / SCAN_FILE
    sizes = {k: len(v) for k, v in plan.items()}
    if scan_path.exists():
        saved = json.loads(scan_path.read_text())
        if saved.get("plan_sizes") == sizes and "totals" in saved:
            good = {s: [PlannedSample(*g) for g in items] for s, items in saved["good"].items()}
            return ScanResult(good, saved["bad"], tuple(saved["shape"]) if saved["shape"] else None,
                              saved["content"], {s: [tuple(hw) for hw in v] for s, v in saved["sizes"].items()},
                              saved["totals"], saved["channels"])
    n = sum(sizes.values())
    # chunks: a few per pool worker; elsewhere, up to 500 samples (the cluster's size is its own)
    step = max(16, min(500, n // 64 or 16)) if elsewhere is not None else max(64, min(2000, n // (workers * 8) or 64))
    chunks = [(split, items[k:k + step]) for split, items in plan.items() for k in range(0, len(items), step)]
    good: dict[str, list[PlannedSample]] = {s: [] for s in plan}
    checked: dict[str, list[Checked]] = {s: [] for s in plan}  # aligned to good
    bad: list[dict] = []
    verdicts = elsewhere([c for _, c in chunks]) if elsewhere is not None else \
        map_forked(check_chunk, encoder, [c for _, c in chunks], workers)
    for (split, items), res in zip(chunks, verdicts):
        g, ch = good[split], checked[split]
        for (sp, i), (key, where, label, seen, reason) in zip(items, res):
            if reason is None:
                g.append(PlannedSample(sp, i, key, label))
                ch.append(Checked(*seen))
            else:
                bad.append({"split": split, "key": key, "where": where, "reason": reason})
        progress(len(items))
    shape, channels = _settle(good, checked, bad, encoder.config)
    good = {split: _dedupe(items) for split, items in good.items()}
    content = {split: [c.crc_rgb if channels == 3 and c.shape[2] == 1 else c.crc for c in cs]
               for split, cs in checked.items()}
    hw = {split: [(int(c.shape[0]), int(c.shape[1])) for c in cs] for split, cs in checked.items()}
    totals = {split: _totals(cs, channels) for split, cs in checked.items()}
    atomic.write_bytes(scan_path, json.dumps({"plan_sizes": sizes, "good": good, "bad": bad,
                                              "shape": list(shape) if shape else None, "content": content,
                                              "sizes": hw, "totals": totals, "channels": channels},
                                             separators=(",", ":")).encode())
    return ScanResult(good, bad, shape, content, hw, totals, channels)


def _totals(checked: list[Checked], channels: int | None) -> list[int]:
    """[pixels, sums..., sums of squares...] over a split's samples, as the writers store them
    (a gray sample's values counted in each of the three channels when it is turned into RGB)."""
    width = max((3 if channels == 3 else c.shape[2] for c in checked), default=0)
    out = [0] * (1 + 2 * width)
    for c in checked:
        k = c.shape[2]
        out[0] += c.shape[0] * c.shape[1]
        for ch in range(width):
            out[1 + ch] += c.sums[min(ch, k - 1)]
            out[1 + width + ch] += c.sums[k + min(ch, k - 1)]
    return out


def _settle(good: dict[str, list[PlannedSample]], checked: dict[str, list[Checked]],
            bad: list[dict], cfg: ShardConfig) -> tuple[Shape | None, int | None]:
    """The dataset's (H, W, C) (None: JPEG/PNG photos of varying sizes, stored as RGB), and the
    channels the writers must convert every sample to (None: as decoded).

    Gray and RGB photos in one source all become RGB (a gray photo loses nothing as RGB; the
    minority is not quarantined). Photos of varying sizes are stored as RGB too: FFCV's image
    field and every loader's variable-size path take RGB. A fixed size is required for raw
    arrays (``npy``) and for gray kept gray (``channels: 1``): samples of another size are then
    quarantined, naming the setting that would make them fit."""
    counts = Counter(c.shape for cs in checked.values() for c in cs)
    if not counts:
        return None, None
    channels = {s[2] for s in counts}
    if len({s[:2] for s in counts}) > 1 and cfg.encoding in ("jpg", "png") and cfg.channels != 1:
        return None, (3 if cfg.channels is None and 1 in channels else None)
    size = Counter(s[:2] for s in counts.elements()).most_common(1)[0][0]
    channels = {s[2] for s in counts if s[:2] == size}  # of the samples that keep their place
    gray_and_rgb = cfg.channels is None and channels == {1, 3}
    common = (size[0], size[1], 3 if gray_and_rgb else next(iter(channels)))
    for split, items in good.items():
        keep, kept = [], []
        for g, c in zip(items, checked[split]):
            if c.shape[:2] == size:
                keep.append(g)
                kept.append(c)
            else:
                bad.append({"split": split, "key": g.key, "where": c.where,
                            "reason": f"shape {c.shape} differs from the dataset's {common}; a fixed shape "
                                      f"is required here ({_shape_hint(c.shape, common)})"})
        good[split], checked[split] = keep, kept
    return common, (3 if gray_and_rgb else None)


def _shape_hint(shape: Shape, common: Shape) -> str:
    """The setting that makes ``shape`` fit: the size (channels never keep a sample out: gray and
    RGB mixed become RGB), and for gray kept gray, the alternative of RGB photos of any size."""
    fix = f"set shard.image_size=[{common[0]},{common[1]}] to resize"
    if common[2] == 1:
        fix += ", or leave shard.channels unset with encoding jpg or png to keep every size (as RGB)"
    return fix


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
