"""``webdataset``: existing WebDataset ``.tar`` shards — a file, a directory of them (optionally
``train/`` and ``test/`` sub-directories), or a brace pattern ``shards-{000..009}.tar``."""
from __future__ import annotations

import re
import tarfile
from pathlib import Path

from sluice.errors import SampleError, SourceError
from sluice.stages.data.sources.base import SOURCES, RawSample, Source, sanitize_key
from sluice.storage.fingerprint import hash_files


def expand_braces(pattern: str) -> list[str]:
    """Expand ``{000..009}`` and ``{a,b}`` the way WebDataset URLs do."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    body, pre, post = m.group(1), pattern[:m.start()], pattern[m.end():]
    rng = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if rng:
        a, b = rng.groups()
        items = [str(n).zfill(len(a)) for n in range(int(a), int(b) + 1)]
    else:
        items = body.split(",")
    return [e for it in items for e in expand_braces(pre + it + post)]

BLOCK = 512
# image member extension -> the format its bytes are announced as, in order of preference
IMAGE_MEMBERS = {"jpg": "jpg", "jpeg": "jpg", "png": "png", "webp": "webp", "bmp": "bmp", "npy": "npy"}


def _image_ext(members: dict) -> str | None:
    """The sample's image member: the first of ``IMAGE_MEMBERS`` it has."""
    return next((e for e in IMAGE_MEMBERS if e in members), None)


def index_tar(path: Path) -> tuple[list[tuple[str, dict[str, tuple[int, int]]]], str | None]:
    """The samples of one tar from its headers: ``[(key, {ext: (offset, size)})]`` in order,
    and what is wrong with the file (None when it is whole).

    Consecutive members with the same key form a sample; a key that comes back later, or a
    repeated extension, starts a new sample (so duplicate keys lose nothing; the shard stage
    makes keys unique). Python's ``tarfile`` silently stops at a truncated or corrupt header,
    so the end is checked too: the last member's data must be complete and followed by the
    end-of-archive marker (two zero blocks).
    """
    samples: list[tuple[str, dict[str, tuple[int, int]]]] = []
    end = 0  # where the last member's (padded) data ends
    try:
        with tarfile.open(path, "r:") as tf:
            for m in tf:
                end = m.offset_data + -(-m.size // BLOCK) * BLOCK
                if not m.isfile():
                    continue
                base = m.name.rsplit("/", 1)[-1]
                if "." not in base:
                    continue
                stem, ext = base.split(".", 1)
                key, ext = m.name[: len(m.name) - len(base)] + stem, ext.lower()
                if not samples or samples[-1][0] != key or ext in samples[-1][1]:
                    samples.append((key, {}))
                samples[-1][1][ext] = (m.offset_data, m.size)
    except (tarfile.TarError, OSError, EOFError) as e:
        return samples, f"unreadable from byte {end}: {e}"
    size = path.stat().st_size
    if size < end:
        return samples, f"truncated: its last member needs {end} bytes, the file has {size}"
    with open(path, "rb") as f:
        f.seek(end)
        marker = f.read(2 * BLOCK)
    if marker != bytes(2 * BLOCK):
        return samples, (f"truncated or corrupt after byte {end}: no end-of-archive marker there"
                         if len(marker) < 2 * BLOCK else f"corrupt tar header at byte {end}")
    return samples, None


@SOURCES.register("webdataset")
class WebDatasetSource(Source):
    """Existing WebDataset tar shards, re-sharded. Members are indexed once (headers only) so
    samples can be read by position; member names are used as keys, never as paths.

    A damaged shard (truncated, a corrupt header, no end-of-archive marker, zero bytes) fails
    ``open`` naming the file, unless ``keep_damaged``: then the samples read before the damage
    are kept and the damage is reported (``damaged()``, the manifest, the summary)."""
    kind = "webdataset"
    detect_order = 30

    @classmethod
    def detect(cls, spec: str, path: Path) -> bool:
        if "{" in spec or path.suffix == ".tar":
            return True
        return path.is_dir() and (any(path.glob("*.tar")) or any(path.glob("*/*.tar")))

    @classmethod
    def open(cls, spec, config, class_names=None) -> "WebDatasetSource":
        return cls(spec, config.num_classes, keep_damaged=config.keep_damaged)
    label_exts = ("cls", "label", "target")

    def __init__(self, spec: str, num_classes: int | None = None, keep_damaged: bool = False):
        self.uri = spec
        self._tars: dict[str, list[Path]] = {}
        p = Path(spec)
        if p.is_dir():
            subs = {s: sorted((p / s).glob("*.tar")) for s in ("train", "test") if (p / s).is_dir()}
            self._tars = {s: v for s, v in subs.items() if v} or {"train": sorted(p.glob("*.tar"))}
        else:
            self._tars = {"train": [Path(u) for u in expand_braces(spec)]}
        for tars in self._tars.values():
            for t in tars:
                if not t.is_file():
                    raise SourceError(f"WebDataset shard not found: {t}")
        if not any(self._tars.values()):
            raise SourceError(f"{spec}: no .tar shards found")
        self._damaged: list[tuple[str, str]] = []
        self._index = {s: self._index_split(tars, keep_damaged) for s, tars in self._tars.items()}
        self._num_classes = num_classes

    def _index_split(self, tars: list[Path], keep_damaged: bool) -> list[tuple[Path, str, dict[str, tuple[int, int]]]]:
        """(tar, key, {ext: (offset, size)}) per sample, from headers alone."""
        out = []
        for t in tars:
            samples, problem = index_tar(t)
            if problem is not None:
                if not keep_damaged:
                    raise SourceError(f"{t}: damaged WebDataset shard ({problem}); {len(samples)} samples "
                                      "could be read before the damage. Repair or remove it, or set "
                                      "ingest.keep_damaged=true to shard the readable part (the damage "
                                      "is then recorded in the manifest)")
                self._damaged.append((str(t), f"{problem}; kept the {len(samples)} samples before it"))
            out += [(t, k, members) for k, members in samples]
        return out

    def damaged(self) -> list[tuple[str, str]]:
        return list(self._damaged)

    def describe(self, split: str, i: int) -> tuple[str, str]:
        tar, key, _ = self._index[split][i]
        return sanitize_key(key), f"{tar}:{key}"

    def split_sizes(self) -> dict[str, int]:
        return {s: len(v) for s, v in self._index.items()}

    def load(self, split: str, i: int) -> RawSample:
        tar, key, members = self._index[split][i]
        where = f"{tar}:{key}"
        img_ext = _image_ext(members)
        lab_ext = next((e for e in self.label_exts if e in members), None)
        if img_ext is None:
            raise SampleError(f"no image member ({'/'.join('.' + e for e in IMAGE_MEMBERS)}) among {sorted(members)}")
        if lab_ext is None:
            raise SampleError(f"no label member (.cls) among {sorted(members)}")
        with open(tar, "rb") as f:
            def read(ext: str) -> bytes:
                off, size = members[ext]
                f.seek(off)
                data = f.read(size)
                if len(data) != size:
                    raise SampleError(f"member .{ext} is truncated ({len(data)} of {size} bytes)")
                return data
            img, lab = read(img_ext), read(lab_ext)
        try:
            label: object = lab.decode().strip()
        except UnicodeDecodeError:
            label = lab
        ext = IMAGE_MEMBERS[img_ext]
        return RawSample(key=sanitize_key(key), label=label, encoded=img, encoded_ext=ext, where=where)

    def num_classes(self) -> int | None:
        return self._num_classes

    def image_formats(self) -> dict[str, int]:
        found: dict[str, int] = {}
        for items in self._index.values():
            for _, _, members in items:
                ext = _image_ext(members)
                if ext is not None:
                    found[IMAGE_MEMBERS[ext]] = found.get(IMAGE_MEMBERS[ext], 0) + 1
        return found

    def class_names(self) -> list[str]:
        return []

    def fingerprint(self) -> str:
        return hash_files([t for tars in self._tars.values() for t in tars])
