"""The .beton written from the tar shards' own image bytes (stages/data/formats/ffcv.py
``_from_tars``) instead of a second decode of every sample from the source: the very bytes the
source path writes (JPEG photos kept as they are, one whose metadata is too large to keep,
Fashion-MNIST's .npy pixels), and it reads nothing from the source."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sluice.stages.data.config import IngestConfig, ShardConfig
from sluice.stages.data.formats import ffcv
from sluice.stages.data.ingest import open_source
from sluice.stages.data.shard import shard_dataset

pytestmark = pytest.mark.timeout(300)


def _betons(root: str) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(root).rglob("*.beton"))}


def _photos(root: Path) -> Path:
    rng = np.random.default_rng(0)
    for c in ("cat", "dog"):
        (root / c).mkdir(parents=True)
        for i in range(14):
            h, w = int(rng.integers(40, 90)), int(rng.integers(40, 90))
            smooth = np.kron(rng.integers(0, 255, (h // 8 + 1, w // 8 + 1, 3)), np.ones((8, 8, 1)))[:h, :w]
            im = Image.fromarray(smooth.astype(np.uint8))
            extra = {"icc_profile": b"\0" * 120_000} if i == 3 else {}  # larger than any JPEG of its pixels
            im.save(root / c / f"{i:03d}.jpg", quality=88, **extra)
    return root


@pytest.mark.parametrize("source", ["photos", "fashion-mnist"])
def test_the_beton_from_the_tars_is_the_beton_from_the_source(tmp_path, source):
    spec = str(_photos(tmp_path / "src")) if source == "photos" else "fashion-mnist"
    ing = IngestConfig(source=spec, limit=900)
    with_tars = ShardConfig(shard_samples=7, formats=["webdataset", "dali", "ffcv"], progress=False)
    assert ffcv.from_tars_exact(with_tars.for_source(open_source(ing)), None if source == "photos" else (28, 28, 1))
    a = shard_dataset(ing, tmp_path / "tars", with_tars)
    b = shard_dataset(ing, tmp_path / "source", with_tars.model_copy(update={"formats": ["ffcv"]}))
    assert a.manifest.fields.image.encoding == ("jpg" if source == "photos" else "npy")
    assert _betons(a.root) == _betons(b.root) and len(_betons(a.root)) >= 2


def test_the_beton_from_the_tars_reads_from_the_source_only_what_it_must_encode_afresh(tmp_path, monkeypatch):
    """Every source read made by the .beton writer's process is logged: with the tar shards
    there, it reads only the photo whose metadata is too large to store as it is; without them
    (``formats: [ffcv]``), every sample."""
    import multiprocessing as mp
    import os
    ing = IngestConfig(source=str(_photos(tmp_path / "src")))
    cls = type(open_source(ing))
    log = tmp_path / "reads.log"
    load = cls.load

    def logged(self, split, i):
        if mp.current_process().name == "sluice-ffcv-writer":
            with open(log, "a") as f:
                f.write(f"{os.getpid()} {split} {i}\n")
        return load(self, split, i)
    monkeypatch.setattr(cls, "load", logged)
    cfg = ShardConfig(shard_samples=5, progress=False, workers=2)
    a = shard_dataset(ing, tmp_path / "tars", cfg)
    with_tars = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    b = shard_dataset(ing, tmp_path / "source", cfg.model_copy(update={"formats": ["ffcv"]}))
    from_source = log.read_text().splitlines()
    assert len(with_tars) == 2, with_tars  # the two oversized photos (003 of each class)
    assert len(from_source) == sum(b.manifest.counts().values()) == 28
    assert _betons(a.root) == _betons(b.root)
