"""The source registry, and what every source provides.

A source knows its own splits (``train``, and ``test`` when it has one), how many samples each
holds, and how to load sample ``i`` of a split. Loading is random access so shard writers in
several processes can each read their own partition. Nothing is decoded or validated here;
the sharding stage does that per sample and quarantines what fails.

Add a source: a new file with a ``Source`` subclass registered by ``@SOURCES.register(name)``
(``open`` builds it from a path, ``detect`` says whether a path looks like one, for
``kind: auto``), plus one import line in ``sources/__init__.py`` (outside Sluice: the same
decorator, or an entry point in group ``sluice.sources``); then ``ingest.kind: name``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from sluice.errors import SourceError
from sluice.plugins import PluginRegistry

if TYPE_CHECKING:  # the ingest config imports this registry; no runtime cycle
    from sluice.stages.data.config import IngestConfig

SOURCES: PluginRegistry[type["Source"]] = PluginRegistry("sources", "source kind")
_KEY_BAD = re.compile(r"[^A-Za-z0-9_-]+")


def sanitize_key(text: str) -> str:
    """A tar-safe sample key: letters, digits, '_' and '-' only (no dots, no slashes)."""
    return _KEY_BAD.sub("_", text).strip("_") or "sample"


def unique_keys(raw: list[str]) -> list[str]:
    """Sanitised keys, made unique by suffixing repeats with ``-1``, ``-2``..."""
    seen: dict[str, int] = {}
    out = []
    for k in map(sanitize_key, raw):
        n = seen.get(k, 0)
        seen[k] = n + 1
        out.append(k if n == 0 else f"{k}-{n}")
    return out


def checked_keys(raw: np.ndarray, n: int, what: str) -> list[str]:
    """A split's stable keys from a 1-D string array (``what`` names it in errors, e.g.
    ``file.npz: 'keys'``): sanitised like every other source's keys, one per sample. A length
    that is not ``n`` or two samples with one key (after sanitising) are refused: a key names one
    sample, so a repeat cannot be made unique without guessing which sample keeps it."""
    if raw.dtype.kind != "U" or raw.ndim != 1:
        raise SourceError(f"{what} must be a 1-D array of strings (numpy unicode), "
                          f"got dtype {raw.dtype} and shape {raw.shape}")
    if len(raw) != n:
        raise SourceError(f"{what} holds {len(raw)} keys for {n} samples")
    keys = [sanitize_key(str(k)) for k in raw]
    first: dict[str, int] = {}
    for i, k in enumerate(keys):
        j = first.setdefault(k, i)
        if j != i:
            raw_pair = f" (raw {str(raw[j])!r} and {str(raw[i])!r})" if raw[j] != raw[i] else ""
            raise SourceError(f"{what} repeats the key {k!r}{raw_pair} at samples {j} and {i}: "
                              "every sample needs its own key")
    return keys


@dataclass
class RawSample:
    """A sample as the source holds it: an array or encoded bytes, and a raw label."""
    key: str
    label: object
    where: str  # file (and position) it came from, for error messages
    array: np.ndarray | None = None
    encoded: bytes | None = None
    encoded_ext: str | None = None  # 'jpg' / 'png' / 'webp' / 'bmp' / 'npy' when ``encoded`` is set


class Source:
    """A readable source. ``kind`` is its registered name; ``uri`` where it lives."""
    kind: ClassVar[str] = ""
    detect_order: ClassVar[int] = 50  # lower is tried first by ``kind: auto``
    uri: str

    @classmethod
    def detect(cls, spec: str, path: Path) -> bool:
        """Whether ``spec`` (a path or pattern) looks like this kind of source."""
        return False

    @classmethod
    def open(cls, spec: str, config: "IngestConfig", class_names: list[str] | None = None) -> "Source":
        raise NotImplementedError

    def split_sizes(self) -> dict[str, int]:
        raise NotImplementedError

    def load(self, split: str, i: int) -> RawSample:
        raise NotImplementedError

    def describe(self, split: str, i: int) -> tuple[str, str]:
        """Sample ``i``'s key and where it lives (file, tar member), without reading it: what a
        quarantine record names when even loading the sample fails."""
        return f"{split}-{i:06d}", f"{split}[{i}]"

    def damaged(self) -> list[tuple[str, str]]:
        """(file, what is wrong) for each damaged file whose readable part this source kept
        (``ingest.keep_damaged``); without that option a damaged file fails ``open``."""
        return []

    def num_classes(self) -> int | None:
        return None

    def class_names(self) -> list[str]:
        return []

    def image_formats(self) -> dict[str, int]:
        """How many samples the source holds in each stored format (``jpg``, ``png``, ``webp``,
        ``bmp``, ``npy``; ``array`` for pixels in memory), from its listing alone: what
        ``encoding: auto`` decides on (``ShardConfig.for_source``). Empty (the default, for a
        source that cannot tell): npy, the encoding every source got before ``auto``."""
        return {}

    def class_counts(self) -> dict[str, int] | None:
        """Images per class name in the source's train split, from its listing alone (no
        sample read), for the check that every class can reach every split
        (``split.check_class_sizes``); None when the source cannot tell without reading."""
        return None

    def fingerprint(self) -> str:
        raise NotImplementedError


class ArraySource(Source):
    """A source whose splits are arrays in memory (``_images`` / ``_labels`` per split): IDX
    files and ``.npz`` archives. Subclasses fill them and say where a sample came from. A
    sample's key is its position (``train-000123``) unless ``_keys`` gives a split its own
    stable keys (sanitised and unique, see :func:`checked_keys`): then deleting a sample never
    re-keys the samples after it, so none of them changes split."""
    _images: dict[str, np.ndarray]
    _labels: dict[str, np.ndarray]
    _class_names: list[str]
    _num_classes: int | None
    _keys: dict[str, list[str]] | None = None  # split -> keys aligned to its arrays

    def where(self, split: str, i: int) -> str:
        raise NotImplementedError

    def key(self, split: str, i: int) -> str:
        keys = (self._keys or {}).get(split)
        return keys[i] if keys is not None else f"{split}-{i:06d}"

    def describe(self, split: str, i: int) -> tuple[str, str]:
        return self.key(split, i), self.where(split, i)

    def split_sizes(self) -> dict[str, int]:
        return {s: len(v) for s, v in self._labels.items()}

    def load(self, split: str, i: int) -> RawSample:
        img = self._images[split][i]
        if img.ndim == 2:
            img = img[:, :, None]
        return RawSample(key=self.key(split, i), label=self._labels[split][i], array=img,
                         where=self.where(split, i))

    def num_classes(self) -> int | None:
        if self._num_classes:
            return self._num_classes
        if self._class_names:
            return len(self._class_names)
        labels = self._labels["train"]
        if labels.dtype.kind in "iu" and len(labels):
            return int(labels.max()) + 1
        return None

    def class_names(self) -> list[str]:
        return list(self._class_names)

    def image_formats(self) -> dict[str, int]:
        return {"array": sum(self.split_sizes().values())}
