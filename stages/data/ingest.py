"""Ingest: open the source an ``IngestConfig`` names (a named dataset, a path or a pattern),
guessing its kind from the path for ``kind: auto``, and refuse one whose classes cannot all
reach every split (``split.check_class_sizes``; an empty class folder: ``sources/folder.py``)."""
from __future__ import annotations

import os
from pathlib import Path

from sluice.errors import SourceError
from sluice.stages.data.config import IngestConfig
from sluice.stages.data.sources import SOURCES, Source
from sluice.stages.data.split import check_class_sizes
from sluice.storage.manifest import SourceRecord

FASHION_MNIST_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal",
                         "Shirt", "Sneaker", "Bag", "Ankle boot"]
# names that stand for a path (and the class names that go with it)
NAMED_SOURCES = {"fashion-mnist": ("/usr/share/datasets/fashion-mnist", FASHION_MNIST_CLASSES)}


def fashion_mnist_dir() -> str:
    """Where the Fashion-MNIST IDX files are: ``$SLUICE_FASHION_MNIST`` (a machine without the
    Debian package, e.g. the GPU check's carried copy), else the package's folder."""
    return os.environ.get("SLUICE_FASHION_MNIST") or NAMED_SOURCES["fashion-mnist"][0]
_INSTALL_HINTS = {"fashion-mnist": " (install it with: apt-get install dataset-fashion-mnist)"}


def detect_kind(spec: str) -> str:
    """The registered source kind whose ``detect`` accepts ``spec`` first (by ``detect_order``)."""
    path = Path(spec)
    for name in sorted(SOURCES.names(), key=lambda n: SOURCES.get(n).detect_order):
        if SOURCES.get(name).detect(spec, path):
            return name
    raise SourceError(f"cannot tell what kind of source {spec} is; set ingest.kind to one of "
                      f"{', '.join(SOURCES.names())}")


def open_source(config: IngestConfig | str) -> Source:
    """Open a source from its ``IngestConfig`` (or a path); a missing or unrecognisable path,
    or an empty source, is a SourceError naming it."""
    cfg = IngestConfig(source=config) if isinstance(config, str) else config
    spec, class_names = NAMED_SOURCES.get(cfg.source, (cfg.source, None))
    if cfg.source == "fashion-mnist":
        spec = fashion_mnist_dir()
    if "{" not in spec and not Path(spec).exists():
        raise SourceError(f"source not found: {spec}{_INSTALL_HINTS.get(cfg.source, '')}")
    kind = detect_kind(spec) if cfg.kind == "auto" else cfg.kind
    src = SOURCES.get(kind).open(spec, cfg, class_names)
    if sum(src.split_sizes().values()) == 0:
        raise SourceError(f"source {spec} is empty: no samples found")
    check_class_sizes(src, cfg)
    return src


def source_record(src: Source, fingerprint: str) -> SourceRecord:
    """What the manifest records of the source an artifact came from; ``fingerprint``: the
    source's, as the stage took it (hashing every source byte once is enough)."""
    return SourceRecord(kind=src.kind, uri=src.uri, fingerprint=fingerprint,
                        details={"splits": src.split_sizes(), "class_names": src.class_names()})
