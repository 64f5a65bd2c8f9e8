"""``folder``: an image folder with one sub-folder per class (JPEG/PNG), optionally under
``train/`` and ``test/``."""
from __future__ import annotations

from pathlib import Path

from sluice.errors import SampleError, SourceError
from sluice.stages.data.sources.base import SOURCES, RawSample, Source, unique_keys
from sluice.storage.fingerprint import hash_files

IMAGE_EXTS = {".jpg", ".jpeg", ".png"}


@SOURCES.register("folder")
class FolderSource(Source):
    """One sub-folder per class (``root/<class>/<image>``), optionally under train/ and test/."""
    kind = "folder"
    detect_order = 90  # any directory: the fallback

    @classmethod
    def detect(cls, spec: str, path: Path) -> bool:
        return path.is_dir()

    @classmethod
    def open(cls, spec, config, class_names=None) -> "FolderSource":
        return cls(Path(spec), config.num_classes)

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
        self._keys = {s: unique_keys([f"{p.parent.name}_{p.stem}" for p, _ in items])
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

    def describe(self, split: str, i: int) -> tuple[str, str]:
        return self._keys[split][i], str(self._files[split][i][0])

    def num_classes(self) -> int | None:
        return self._num_classes or len(self._classes)

    def class_names(self) -> list[str]:
        return list(self._classes)

    def fingerprint(self) -> str:
        return hash_files([p for items in self._files.values() for p, _ in items], root=self.root)
