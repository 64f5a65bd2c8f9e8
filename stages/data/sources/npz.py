"""``npz``: an ``.npz`` with ``images`` and ``labels`` (and optionally ``test_images``,
``test_labels``, ``class_names``, and ``keys`` / ``test_keys``: each sample's stable key, a
string array aligned to its split; without them a sample's key is its position); pickled
arrays are refused."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from sluice.errors import SourceError
from sluice.stages.data.sources.base import SOURCES, ArraySource, checked_keys
from sluice.storage.fingerprint import hash_files


@SOURCES.register("npz")
class NpzSource(ArraySource):
    """An ``.npz`` with ``images`` (N, H, W[, C]) uint8 and ``labels`` (N,)."""
    kind = "npz"
    detect_order = 10

    @classmethod
    def detect(cls, spec: str, path: Path) -> bool:
        return path.suffix == ".npz"

    @classmethod
    def open(cls, spec, config, class_names=None) -> "NpzSource":
        return cls(Path(spec), config.num_classes)

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
        self._keys = {}
        for split, kk in {"train": "keys", "test": "test_keys"}.items():
            if kk in arrays:
                if split not in self._labels:
                    raise SourceError(f"{path}: has {kk!r} but no test split ('test_images', 'test_labels')")
                self._keys[split] = checked_keys(arrays[kk], len(self._labels[split]), f"{path}: {kk!r}")
        if len(self._keys) == 2 and set(self._keys["train"]) & set(self._keys["test"]):
            both = sorted(set(self._keys["train"]) & set(self._keys["test"]))
            raise SourceError(f"{path}: 'keys' and 'test_keys' share {len(both)} key(s), e.g. {both[0]!r}: "
                              "a key names one sample")
        names = arrays.get("class_names")
        self._class_names = [str(n) for n in names] if names is not None else []
        self._num_classes = num_classes

    def where(self, split: str, i: int) -> str:
        return f"{self.path}[{split}][{i}]"

    def fingerprint(self) -> str:
        return hash_files([self.path])
