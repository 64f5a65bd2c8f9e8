"""Sources that yield samples, and the deterministic train/holdout/val/test split.

A source knows its own splits (``train``, and ``test`` when it has one), how many samples each
holds, and how to load sample ``i`` of a split. Loading is random access so shard writers in
several processes can each read their own partition. Nothing is decoded or validated here;
``sluice.stages.data.shard`` does that per sample and quarantines what fails.

Supported sources:

* ``fashion-mnist`` (or ``mnist-like`` IDX directory): ``*-images-idx3-ubyte[.gz]`` and
  ``*-labels-idx1-ubyte[.gz]`` pairs, ``train-`` and ``t10k-``/``test-`` prefixes.
* an image folder with one sub-folder per class (JPEG/PNG), optionally under ``train/`` and
  ``test/``.
* an ``.npz`` with ``images`` and ``labels`` (and optionally ``test_images``/``test_labels``,
  ``class_names``).
* existing WebDataset ``.tar`` shards: a file, a directory of them (optionally ``train/`` and
  ``test/`` sub-directories), or a brace pattern ``shards-{000..009}.tar``.
"""
from __future__ import annotations

import gzip
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from sluice.errors import SampleError, SourceError
from sluice.storage.fingerprint import hash_files, hash_obj
from sluice.storage.manifest import SourceRecord

NAMED_SOURCES = {"fashion-mnist": "/usr/share/datasets/fashion-mnist"}
FASHION_MNIST_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal",
                         "Shirt", "Sneaker", "Bag", "Ankle boot"]
IMAGE_EXTS = {".jpg", ".jpeg", ".png"}
_KEY_BAD = re.compile(r"[^A-Za-z0-9_-]+")


def sanitize_key(text: str) -> str:
    """A tar-safe sample key: letters, digits, '_' and '-' only (no dots, no slashes)."""
    return _KEY_BAD.sub("_", text).strip("_") or "sample"


@dataclass
class RawSample:
    """A sample as the source holds it: an array or encoded bytes, and a raw label."""
    key: str
    label: object
    where: str  # file (and position) it came from, for error messages
    array: np.ndarray | None = None
    encoded: bytes | None = None
    encoded_ext: str | None = None  # 'jpg' / 'png' / 'npy' when ``encoded`` is set


class Source(Protocol):
    kind: str
    uri: str

    def split_sizes(self) -> dict[str, int]: ...
    def load(self, split: str, i: int) -> RawSample: ...
    def num_classes(self) -> int | None: ...
    def class_names(self) -> list[str]: ...
    def fingerprint(self) -> str: ...


class IngestConfig(BaseModel):
    """Where samples come from and how the source's train split is cut into our splits."""
    model_config = ConfigDict(extra="forbid")

    source: str = "fashion-mnist"
    kind: Literal["auto", "idx", "folder", "npz", "webdataset"] = "auto"
    holdout_fraction: float = Field(0.1, ge=0.0, lt=1.0,
                                    description="share of the source's train split held out for RHO-LOSS")
    val_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    test_fraction: float = Field(0.1, ge=0.0, lt=1.0,
                                 description="used only when the source has no test split")
    seed: int = 0
    limit: int | None = Field(None, ge=1, description="first N samples of each source split (quick runs)")
    num_classes: int | None = Field(None, ge=1, description="labels must lie in [0, num_classes)")

    @model_validator(mode="after")
    def _fractions(self) -> "IngestConfig":
        if self.holdout_fraction + self.val_fraction + self.test_fraction >= 1.0:
            raise ValueError("holdout_fraction + val_fraction + test_fraction must be < 1")
        return self

    def split_fingerprint(self) -> str:
        """What, besides the source content, decides which sample lands in which split."""
        return hash_obj(self.model_dump(exclude={"source", "kind"}))


# ---------------------------------------------------------------- IDX (MNIST format)

IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (gzipped or not), checking its header against its size."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise SourceError(f"cannot read IDX file {path}: {e.strerror or e}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise SourceError(f"IDX file {path} is not valid gzip (truncated or corrupt): {e}") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise SourceError(f"{path} is not an IDX file: bad magic bytes {raw[:4].hex()}")
    code, ndim = raw[2], raw[3]
    if code not in IDX_DTYPES:
        raise SourceError(f"{path}: unknown IDX data type code 0x{code:02x}")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise SourceError(f"{path}: IDX header says {ndim} dimensions but the file ends at byte {len(raw)}")
    dims = [int.from_bytes(raw[4 + 4 * k: 8 + 4 * k], "big") for k in range(ndim)]
    dtype = np.dtype(IDX_DTYPES[code])
    expected = header + int(np.prod(dims)) * dtype.itemsize
    if len(raw) != expected:
        raise SourceError(f"{path}: IDX header says shape {tuple(dims)} ({expected} bytes) but the "
                          f"file has {len(raw)} bytes")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)


class IdxSource:
    """MNIST-format IDX files: images (N, H, W) uint8 and labels (N,)."""
    kind = "idx"

    def __init__(self, root: Path, num_classes: int | None = None, class_names: list[str] | None = None):
        self.root = root
        self.uri = str(root)
        self._files: dict[str, tuple[Path, Path]] = {}
        for split, prefixes in (("train", ("train",)), ("test", ("t10k", "test"))):
            for pre in prefixes:
                imgs = _first(root, f"{pre}-images-idx3-ubyte")
                labs = _first(root, f"{pre}-labels-idx1-ubyte")
                if imgs and labs:
                    self._files[split] = (imgs, labs)
                    break
                if imgs or labs:
                    raise SourceError(f"{root}: found {(imgs or labs).name} without its "
                                      f"{'labels' if imgs else 'images'} file")
        if "train" not in self._files:
            raise SourceError(f"{root}: no train-images-idx3-ubyte[.gz] / train-labels-idx1-ubyte[.gz] pair")
        self._images: dict[str, np.ndarray] = {}
        self._labels: dict[str, np.ndarray] = {}
        for split, (ip, lp) in self._files.items():
            images, labels = read_idx(ip), read_idx(lp)
            if images.ndim not in (3, 4):
                raise SourceError(f"{ip}: expected images of shape (N, H, W[, C]), got {images.shape}")
            if labels.ndim != 1:
                raise SourceError(f"{lp}: expected labels of shape (N,), got {labels.shape}")
            if len(images) != len(labels):
                raise SourceError(f"{ip.name} holds {len(images)} images but {lp.name} holds "
                                  f"{len(labels)} labels")
            self._images[split], self._labels[split] = images, labels
        self._num_classes = num_classes
        self._class_names = class_names or []

    def split_sizes(self) -> dict[str, int]:
        return {s: len(v) for s, v in self._labels.items()}

    def load(self, split: str, i: int) -> RawSample:
        img = self._images[split][i]
        if img.ndim == 2:
            img = img[:, :, None]
        return RawSample(key=f"{split}-{i:06d}", label=self._labels[split][i], array=img,
                         where=f"{self._files[split][0]}[{i}]")

    def num_classes(self) -> int | None:
        if self._num_classes:
            return self._num_classes
        if self._class_names:
            return len(self._class_names)
        return int(self._labels["train"].max()) + 1 if len(self._labels["train"]) else None

    def class_names(self) -> list[str]:
        return list(self._class_names)

    def fingerprint(self) -> str:
        return hash_files([p for pair in self._files.values() for p in pair])


def _first(root: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        if (root / name).is_file():
            return root / name
    return None


# ---------------------------------------------------------------- image folder

class FolderSource:
    """One sub-folder per class (``root/<class>/<image>``), optionally under train/ and test/."""
    kind = "folder"

    def __init__(self, root: Path, num_classes: int | None = None):
        self.root = root
        self.uri = str(root)
        split_roots = {s: root / s for s in ("train", "test") if (root / s).is_dir()}
        if not split_roots:
            split_roots = {"train": root}
        classes = sorted({d.name for r in split_roots.values() for d in r.iterdir() if d.is_dir()})
        if not classes:
            raise SourceError(f"{root}: an image folder needs one sub-folder per class; found none")
        self._classes = classes
        self._files: dict[str, list[tuple[Path, int]]] = {}
        for split, r in split_roots.items():
            items = []
            for ci, c in enumerate(classes):
                d = r / c
                if d.is_dir():
                    items += [(p, ci) for p in sorted(d.rglob("*"))
                              if p.is_file() and p.suffix.lower() in IMAGE_EXTS]
            self._files[split] = items
        self._num_classes = num_classes
        self._keys = {s: _unique_keys([f"{p.parent.name}_{p.stem}" for p, _ in items])
                      for s, items in self._files.items()}

    def split_sizes(self) -> dict[str, int]:
        return {s: len(v) for s, v in self._files.items()}

    def load(self, split: str, i: int) -> RawSample:
        path, label = self._files[split][i]
        try:
            data = path.read_bytes()
        except OSError as e:
            raise SampleError(f"cannot read {path}: {e.strerror or e}") from None
        ext = "png" if path.suffix.lower() == ".png" else "jpg"
        return RawSample(key=self._keys[split][i], label=label, encoded=data, encoded_ext=ext,
                         where=str(path))

    def num_classes(self) -> int | None:
        return self._num_classes or len(self._classes)

    def class_names(self) -> list[str]:
        return list(self._classes)

    def fingerprint(self) -> str:
        return hash_files([p for items in self._files.values() for p, _ in items], root=self.root)


def _unique_keys(raw: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for k in map(sanitize_key, raw):
        n = seen.get(k, 0)
        seen[k] = n + 1
        out.append(k if n == 0 else f"{k}-{n}")
    return out


# ---------------------------------------------------------------- npz

class NpzSource:
    """An ``.npz`` with ``images`` (N, H, W[, C]) uint8 and ``labels`` (N,)."""
    kind = "npz"

    def __init__(self, path: Path, num_classes: int | None = None):
        self.path = path
        self.uri = str(path)
        try:
            # allow_pickle=False: an npz is data, never code.
            with np.load(path, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except ValueError as e:
            raise SourceError(f"{path}: cannot read without unpickling (object arrays are refused): {e}") from None
        except (OSError, EOFError, Exception) as e:  # zipfile.BadZipFile and friends
            raise SourceError(f"{path} is not a readable .npz: {e}") from None
        self._images, self._labels = {}, {}
        for split, (ik, lk) in {"train": ("images", "labels"), "test": ("test_images", "test_labels")}.items():
            if ik in arrays or lk in arrays:
                if ik not in arrays or lk not in arrays:
                    raise SourceError(f"{path}: has {ik if ik in arrays else lk!r} but not "
                                      f"{lk if ik in arrays else ik!r}")
                imgs, labs = arrays[ik], arrays[lk]
                if labs.ndim != 1:
                    raise SourceError(f"{path}: {lk!r} must be 1-D (N,), got shape {labs.shape}")
                if len(imgs) != len(labs):
                    raise SourceError(f"{path}: {ik!r} holds {len(imgs)} images but {lk!r} "
                                      f"holds {len(labs)} labels")
                self._images[split], self._labels[split] = imgs, labs
        if "train" not in self._images:
            raise SourceError(f"{path}: needs arrays 'images' and 'labels' (has {sorted(arrays)})")
        names = arrays.get("class_names")
        self._class_names = [str(n) for n in names] if names is not None else []
        self._num_classes = num_classes

    def split_sizes(self) -> dict[str, int]:
        return {s: len(v) for s, v in self._labels.items()}

    def load(self, split: str, i: int) -> RawSample:
        img = self._images[split][i]
        if img.ndim == 2:
            img = img[:, :, None]
        return RawSample(key=f"{split}-{i:06d}", label=self._labels[split][i], array=img,
                         where=f"{self.path}[{split}][{i}]")

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

    def fingerprint(self) -> str:
        return hash_files([self.path])


# ---------------------------------------------------------------- WebDataset shards

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


class WebDatasetSource:
    """Existing WebDataset tar shards, re-sharded. Members are indexed once (headers only) so
    samples can be read by position; member names are used as keys, never as paths."""
    kind = "webdataset"
    label_exts = ("cls", "label", "target")

    def __init__(self, spec: str, num_classes: int | None = None):
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
        self._index = {s: self._index_split(tars) for s, tars in self._tars.items()}
        self._num_classes = num_classes

    def _index_split(self, tars: list[Path]) -> list[tuple[Path, str, dict[str, tuple[int, int]]]]:
        """(tar, key, {ext: (offset, size)}) per sample, from headers alone."""
        out = []
        for t in tars:
            groups: dict[str, dict[str, tuple[int, int]]] = {}
            order: list[str] = []
            try:
                with tarfile.open(t, "r:") as tf:
                    for m in tf:
                        if not m.isfile():
                            continue
                        base = m.name.rsplit("/", 1)[-1]
                        if "." not in base:
                            continue
                        stem, ext = base.split(".", 1)
                        key = m.name[: len(m.name) - len(base)] + stem
                        if key not in groups:
                            groups[key] = {}
                            order.append(key)
                        groups[key][ext.lower()] = (m.offset_data, m.size)
            except (tarfile.TarError, OSError, EOFError) as e:
                # A truncated shard keeps the samples read before the damage.
                if not order:
                    raise SourceError(f"{t}: not a readable tar file: {e}") from None
                self._damaged = getattr(self, "_damaged", []) + [f"{t}: {e}"]
            out += [(t, k, groups[k]) for k in order]
        return out

    def split_sizes(self) -> dict[str, int]:
        return {s: len(v) for s, v in self._index.items()}

    def load(self, split: str, i: int) -> RawSample:
        tar, key, members = self._index[split][i]
        where = f"{tar}:{key}"
        img_ext = next((e for e in ("jpg", "jpeg", "png", "npy") if e in members), None)
        lab_ext = next((e for e in self.label_exts if e in members), None)
        if img_ext is None:
            raise SampleError(f"no image member (.jpg/.png/.npy) among {sorted(members)}")
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
        ext = {"jpeg": "jpg"}.get(img_ext, img_ext)
        return RawSample(key=sanitize_key(key), label=label, encoded=img, encoded_ext=ext, where=where)

    def num_classes(self) -> int | None:
        return self._num_classes

    def class_names(self) -> list[str]:
        return []

    def fingerprint(self) -> str:
        return hash_files([t for tars in self._tars.values() for t in tars])


# ---------------------------------------------------------------- opening and splitting

def open_source(config: IngestConfig | str) -> Source:
    """Open a source from its spec; a missing or unrecognisable path is a SourceError."""
    cfg = IngestConfig(source=config) if isinstance(config, str) else config
    spec = NAMED_SOURCES.get(cfg.source, cfg.source)
    path = Path(spec)
    kind = cfg.kind
    is_pattern = "{" in spec
    if not is_pattern and not path.exists():
        hint = ""
        if cfg.source in NAMED_SOURCES:
            hint = " (install it with: apt-get install dataset-fashion-mnist)"
        raise SourceError(f"source not found: {spec}{hint}")
    if kind == "auto":
        if is_pattern or path.suffix == ".tar":
            kind = "webdataset"
        elif path.suffix == ".npz":
            kind = "npz"
        elif path.is_dir() and any(path.glob("*-idx3-ubyte*")):
            kind = "idx"
        elif path.is_dir() and (any(path.glob("*.tar")) or any(path.glob("*/*.tar"))):
            kind = "webdataset"
        elif path.is_dir():
            kind = "folder"
        else:
            raise SourceError(f"cannot tell what kind of source {spec} is; set kind to one of "
                              "idx, folder, npz, webdataset")
    names = FASHION_MNIST_CLASSES if cfg.source == "fashion-mnist" else None
    if kind == "idx":
        src: Source = IdxSource(path, cfg.num_classes, names)
    elif kind == "folder":
        src = FolderSource(path, cfg.num_classes)
    elif kind == "npz":
        src = NpzSource(path, cfg.num_classes)
    else:
        src = WebDatasetSource(spec, cfg.num_classes)
    if sum(src.split_sizes().values()) == 0:
        raise SourceError(f"source {spec} is empty: no samples found")
    return src


def source_record(src: Source) -> SourceRecord:
    return SourceRecord(kind=src.kind, uri=src.uri, fingerprint=src.fingerprint(),
                        details={"splits": src.split_sizes(), "class_names": src.class_names()})


SplitPlan = dict[str, list[tuple[str, int]]]  # our split -> [(source split, source index)]


def plan_splits(src: Source, cfg: IngestConfig) -> SplitPlan:
    """Deterministically assign source samples to train / holdout / val / test.

    The source's own test split stays test. Its train split is permuted with ``seed`` and cut
    into holdout, val (and test, if the source has none) and train; each split keeps source
    order so shards read the source sequentially.
    """
    sizes = src.split_sizes()
    if cfg.limit:
        sizes = {s: min(n, cfg.limit) for s, n in sizes.items()}
    n = sizes.get("train", 0)
    perm = np.random.default_rng(cfg.seed).permutation(n)
    n_hold = int(round(n * cfg.holdout_fraction))
    n_val = int(round(n * cfg.val_fraction))
    n_test = 0 if "test" in sizes else int(round(n * cfg.test_fraction))
    cuts = np.cumsum([n_hold, n_val, n_test])
    parts = np.split(perm, cuts)
    plan: SplitPlan = {
        "train": [("train", int(i)) for i in np.sort(parts[3])],
        "holdout": [("train", int(i)) for i in np.sort(parts[0])],
        "val": [("train", int(i)) for i in np.sort(parts[1])],
        "test": ([("test", i) for i in range(sizes["test"])] if "test" in sizes
                 else [("train", int(i)) for i in np.sort(parts[2])]),
    }
    return plan
