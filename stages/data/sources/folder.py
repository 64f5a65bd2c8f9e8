"""``folder``: an image folder with one sub-folder per class (JPEG, PNG, WebP, BMP), optionally
under ``train/`` and ``test/``.

A sample's label is its class folder's position among the class folders sorted by name (the
union over ``train/`` and ``test/``): ``a/`` is 0, ``b/`` is 1, whatever their images. So a class
folder with no image in it would still take a label and never train; it is refused, naming it
(``ingest.check_classes: false`` keeps it, as an empty class), rather than skipped, because
skipping it would shift the label of every class after it the day it gets its first image.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from sluice.errors import SampleError, SourceError
from sluice.stages.data.sources.base import SOURCES, RawSample, Source, unique_keys
from sluice.storage.fingerprint import hash_files

# extension -> the format the bytes are announced as (RawSample.encoded_ext)
IMAGE_EXTS = {".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".webp": "webp", ".bmp": "bmp"}


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
        return cls(Path(spec), config.num_classes, check_classes=config.check_classes)

    def __init__(self, root: Path, num_classes: int | None = None, check_classes: bool = True):
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
        empty: list[tuple[Path, Counter]] = []
        for split, r in split_roots.items():
            items = []
            for ci, c in enumerate(classes):
                d = r / c
                if d.is_dir():
                    files = [p for p in sorted(d.rglob("*")) if p.is_file()]
                    images = [(p, ci) for p in files if p.suffix.lower() in IMAGE_EXTS]
                    if not images:
                        empty.append((d, Counter(p.suffix.lower() or "(none)" for p in files)))
                    items += images
            self._files[split] = items
        if empty and check_classes and any(self._files.values()):
            raise SourceError(_empty_message(empty))
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
        return RawSample(key=self._keys[split][i], label=label, encoded=data,
                         encoded_ext=IMAGE_EXTS[path.suffix.lower()], where=str(path))

    def describe(self, split: str, i: int) -> tuple[str, str]:
        return self._keys[split][i], str(self._files[split][i][0])

    def num_classes(self) -> int | None:
        return self._num_classes or len(self._classes)

    def class_names(self) -> list[str]:
        return list(self._classes)

    def image_formats(self) -> dict[str, int]:
        return dict(Counter(IMAGE_EXTS[p.suffix.lower()] for items in self._files.values() for p, _ in items))

    def class_counts(self) -> dict[str, int] | None:
        counts = Counter(label for _, label in self._files.get("train", []))
        return {c: counts.get(ci, 0) for ci, c in enumerate(self._classes)}

    def fingerprint(self) -> str:
        return hash_files([p for items in self._files.values() for p, _ in items], root=self.root)


def _empty_message(empty: list[tuple[Path, Counter]]) -> str:
    """Which class folders hold no image, and what they hold instead (a format we do not read?)."""
    def what(d: Path, found: Counter) -> str:
        if not found:
            return f"  {d}: no files"
        kinds = ", ".join(f"{n} {ext}" for ext, n in found.most_common(5))
        return f"  {d}: no images, but {sum(found.values())} other file(s) ({kinds})"
    listed = "\n".join(what(d, found) for d, found in empty[:10])
    more = f"\n  ... and {len(empty) - 10} more" if len(empty) > 10 else ""
    return (f"{len(empty)} class folder(s) hold no images ({', '.join(sorted(set(IMAGE_EXTS)))}), so their "
            f"classes would never train:\n{listed}{more}\nA class's label is its folder's position among the "
            "sorted class folders, so an empty one is refused rather than skipped (skipping would renumber "
            "every class after it once it fills). Add its images, remove the folder, or set "
            "ingest.check_classes=false to keep it as a class without samples")
