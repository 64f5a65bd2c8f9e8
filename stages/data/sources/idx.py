"""``idx``: MNIST-format IDX files (``*-images-idx3-ubyte[.gz]`` and ``*-labels-idx1-ubyte[.gz]``
pairs, ``train-`` and ``t10k-``/``test-`` prefixes), gzipped or not."""
from __future__ import annotations

import gzip
import math
from pathlib import Path

import numpy as np

from sluice.errors import SourceError
from sluice.stages.data.sources.base import SOURCES, ArraySource
from sluice.storage.fingerprint import hash_files


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
    expected = header + math.prod(dims) * dtype.itemsize  # Python ints: no overflow
    if len(raw) != expected:
        raise SourceError(f"{path}: IDX header says shape {tuple(dims)} ({expected} bytes) but the "
                          f"file has {len(raw)} bytes")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)


@SOURCES.register("idx")
class IdxSource(ArraySource):
    """MNIST-format IDX files: images (N, H, W) uint8 and labels (N,)."""
    kind = "idx"
    detect_order = 20

    @classmethod
    def detect(cls, spec: str, path: Path) -> bool:
        return path.is_dir() and any(path.glob("*-idx3-ubyte*"))

    @classmethod
    def open(cls, spec, config, class_names=None) -> "IdxSource":
        return cls(Path(spec), config.num_classes, class_names)

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

    def where(self, split: str, i: int) -> str:
        return f"{self._files[split][0]}[{i}]"

    def fingerprint(self) -> str:
        return hash_files([p for pair in self._files.values() for p in pair])


def _first(root: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        if (root / name).is_file():
            return root / name
    return None
