"""Shared fixtures: small real data (a Fashion-MNIST slice, generated images) and artifacts."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("OMP_NUM_THREADS", "1")

FMNIST = Path("/usr/share/datasets/fashion-mnist")


def pytest_collection_modifyitems(config, items):
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def fmnist_artifact(tmp_path_factory):
    """A raw (npy) artifact of a 600+600 sample Fashion-MNIST slice, all formats, small shards."""
    from sluice.stages.data.ingest import IngestConfig
    from sluice.stages.data.shard import ShardConfig, shard_dataset
    out = tmp_path_factory.mktemp("fmnist")
    summary = shard_dataset(IngestConfig(source="fashion-mnist", limit=600), out,
                            ShardConfig(shard_samples=128, progress=False, workers=2))
    return summary


def write_images(root: Path, n_per_class: int = 6, classes=("cat", "dog"), size=(20, 24),
                 fmt: str = "png", seed: int = 0) -> list[Path]:
    """Real PNG/JPEG files in an image-folder layout; returns the paths written."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    paths = []
    for c in classes:
        d = root / c
        d.mkdir(parents=True, exist_ok=True)
        for i in range(n_per_class):
            arr = rng.integers(0, 256, size=(*size, 3), dtype=np.uint8)
            p = d / f"img{i:03d}.{fmt}"
            Image.fromarray(arr).save(p)
            paths.append(p)
    return paths
