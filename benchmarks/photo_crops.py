"""A real-photo JPEG image folder for the loader benchmark, cut from scikit-learn's sample photos.

``make_photo_crops(n)`` writes ``n`` deterministic (seeded) crops of ``china.jpg`` and
``flower.jpg`` (427×640 RGB): a square of random side (64..256 px) at a random place, resized to
64×64 (antialiased), saved as JPEG quality 90 into ``<root>/<class>/<i>.jpg``. Four classes:
which photo × which half (left/right) the crop's centre lies in. The folder is written under a
temporary name and renamed into place, and reused when it already exists.

    python -m benchmarks.photo_crops [N] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import numpy as np

CACHE = Path(__file__).resolve().parent / ".cache"
SIDE = 64
QUALITY = 90
CLASSES = ["china_left", "china_right", "flower_left", "flower_right"]


def make_photo_crops(n: int = 20_000, out: str | os.PathLike | None = None, seed: int = 0) -> Path:
    """Return the folder of ``n`` 64×64 JPEG crops (created once, then reused)."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    root = Path(out) if out else CACHE / f"photo_crops-{n}-s{seed}"
    if (root / ".complete").exists():
        return root
    photos = [Image.fromarray(np.asarray(im)) for im in load_sample_images().images]
    rng = np.random.default_rng(seed)
    tmp = root.with_name(root.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    for c in CLASSES:
        (tmp / c).mkdir(parents=True)
    for i in range(n):
        p = int(rng.integers(2))
        im = photos[p]
        w, h = im.size
        side = int(rng.integers(SIDE, 257))
        left = int(rng.integers(0, w - side + 1))
        top = int(rng.integers(0, h - side + 1))
        half = int(left + side / 2 >= w / 2)
        crop = im.resize((SIDE, SIDE), Image.BILINEAR, box=(left, top, left + side, top + side),
                         reducing_gap=2.0)
        crop.save(tmp / CLASSES[2 * p + half] / f"{i:06d}.jpg", quality=QUALITY)
    (tmp / ".complete").write_text(f"{n} crops, seed {seed}\n")
    if root.exists():  # a half-written leftover without .complete
        shutil.rmtree(root)
    tmp.rename(root)
    return root


def folder_files(root: Path) -> tuple[list[Path], np.ndarray]:
    """(paths, labels) of an image folder, classes in sorted order (as ``sluice.stages.data.ingest`` does)."""
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    paths, labels = [], []
    for ci, c in enumerate(classes):
        files = sorted((root / c).glob("*.jpg"))
        paths += files
        labels += [ci] * len(files)
    return paths, np.array(labels, np.int64)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("n", type=int, nargs="?", default=20_000)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    print(make_photo_crops(a.n, a.out))
