"""Real-photo JPEG image folders for the loader benchmarks, cut from scikit-learn's sample photos.

``make_photo_crops(n)`` writes ``n`` deterministic (seeded) crops of ``china.jpg`` and
``flower.jpg`` (427×640 RGB): a square of random side (64..256 px) at a random place, resized to
64×64 (antialiased), saved as JPEG quality 90 into ``<root>/<class>/<i>.jpg``. Four classes:
which photo × which half (left/right) the crop's centre lies in. The folder is written under a
temporary name and renamed into place, and reused when it already exists.

``make_photo_folder(total_bytes)`` is the same kind of folder sized by bytes, for datasets
larger than memory: crops of random side ``min_side..max_side`` kept at their own size
(variable sizes), written by ``workers`` processes until the JPEGs add up to ``total_bytes``.
Sample ``i`` depends only on (seed, i), so any size is a prefix of a larger one.

    python -m benchmarks.photo_crops [N] [--out DIR]
    python -m benchmarks.photo_crops --bytes 3.2e9 [--min-side 96 --max-side 256] [--out DIR]
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


def _crop(photos, seed: int, i: int, min_side: int, max_side: int, out_side: int | None = None):
    """Sample ``i``: (class, PIL image) — a square crop of random side at a random place,
    resized to ``out_side`` × ``out_side`` when given."""
    rng = np.random.default_rng([seed, i])
    p = int(rng.integers(2))
    im = photos[p]
    w, h = im.size
    side = int(rng.integers(min_side, min(max_side, w, h) + 1))
    left, top = int(rng.integers(0, w - side + 1)), int(rng.integers(0, h - side + 1))
    half = int(left + side / 2 >= w / 2)
    box = (left, top, left + side, top + side)
    if out_side:
        from PIL import Image
        return CLASSES[2 * p + half], im.resize((out_side, out_side), Image.BILINEAR, box=box, reducing_gap=2.0)
    return CLASSES[2 * p + half], im.crop(box)


def _write_range(args) -> int:
    """Write samples lo..hi-1 (one worker's share); returns the bytes written."""
    from PIL import Image
    from sklearn.datasets import load_sample_images
    tmp, lo, hi, seed, min_side, max_side, out_side = args
    photos = [Image.fromarray(np.asarray(im)) for im in load_sample_images().images]
    total = 0
    for i in range(lo, hi):
        cls, crop = _crop(photos, seed, i, min_side, max_side, out_side)
        path = Path(tmp) / cls / f"{i:08d}.jpg"
        crop.save(path, quality=QUALITY)
        total += path.stat().st_size
    return total


def make_photo_folder(total_bytes: float, out: str | os.PathLike | None = None, seed: int = 0,
                      min_side: int = 96, max_side: int = 256, side: int | None = None,
                      workers: int | None = None, progress: bool = True) -> Path:
    """An image folder of JPEG crops adding up to ``total_bytes`` (created once, then reused):
    ``<root>/<class>/<i>.jpg``, four classes as in ``make_photo_crops``. Crops keep their own
    (variable) size, or are resized to ``side`` × ``side`` — what a loader benchmark wants, so
    the shard stage stores the JPEG bytes as they are instead of re-encoding every image."""
    from concurrent.futures import ProcessPoolExecutor
    from tqdm import tqdm
    total_bytes = int(total_bytes)
    root = Path(out) if out else CACHE / f"photo_folder-{total_bytes}-{min_side}-{max_side}-{side or 'var'}-s{seed}"
    if (root / ".complete").exists():
        return root
    tmp = root.with_name(root.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    for c in CLASSES:
        (tmp / c).mkdir(parents=True)
    workers = workers or os.cpu_count() or 1
    chunk = int(min(500, max(10, total_bytes / 11e3 / workers / 4)))  # ~11 kB a crop: overshoot little
    written, n = 0, 0
    with ProcessPoolExecutor(workers) as ex, tqdm(total=total_bytes, unit="B", unit_scale=True,
                                                  desc="photo folder", disable=not progress) as bar:
        while written < total_bytes:
            # one round of chunks per worker, then check the size: a prefix of the sequence
            jobs = [(str(tmp), n + k * chunk, n + (k + 1) * chunk, seed, min_side, max_side, side)
                    for k in range(workers)]
            for b in ex.map(_write_range, jobs):
                written += b
                bar.update(b)
            n += workers * chunk
    (tmp / ".complete").write_text(f"{n} crops ({written} bytes), sides {min_side}..{max_side} "
                                   f"{f'resized to {side}' if side else 'as cut'}, seed {seed}\n")
    if root.exists():
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
    ap.add_argument("--bytes", type=float, default=None, help="a variable-size folder of this many bytes")
    ap.add_argument("--min-side", type=int, default=96)
    ap.add_argument("--max-side", type=int, default=256)
    ap.add_argument("--side", type=int, default=None, help="resize every crop to SIDE×SIDE (default: keep sizes)")
    a = ap.parse_args()
    if a.bytes:
        print(make_photo_folder(a.bytes, a.out, min_side=a.min_side, max_side=a.max_side, side=a.side))
    else:
        print(make_photo_crops(a.n, a.out))
