"""An ImageNet-like JPEG folder for the GPU loader benchmark, cut from the two sample photos the
other benchmarks use (scikit-learn's ``china.jpg`` and ``flower.jpg``, 640×427).

``make_imagenet_like(n)`` writes ``<root>/<class>/<i>.jpg``: 1,000 class folders ``c0000`` ..
``c0999`` (sample ``i`` is in class ``i % 1000``; the labels carry no signal, this is a throughput
dataset), JPEG quality 90 (4:2:0, PIL's default at that quality). Sample ``i`` depends only on
(seed, i), so any ``n`` is a prefix of a larger one.

**Sizes** (width × height) follow ImageNet's training set, where most images are Flickr "medium"
sizes with 500 px on the long side (``SIZE_TABLE``):

======================  ======
500×375 (4:3)             45%
375×500                   12%
500×333 (3:2)             12%
333×500                    5%
500×500                    4%
spread                    22%
======================  ======

The spread: a long side drawn log-uniformly in 256..800 px, an aspect of 4:3, 3:2, 1:1 or 16:9,
landscape two times in three. The mean comes out near 500×375 (about 190,000 pixels);
``.complete`` records the measured mean width, height, pixels and bytes.

**Content.** Re-encoded at quality 90, crops of the two photos compress to about 0.3 byte a pixel
(bokeh, sky, smooth walls), half of ImageNet's (about 110 KB for 500×375, 0.6 byte a pixel), and
what a JPEG costs to decode grows with its entropy-coded bytes as well as its pixels. So each
image is a mosaic of four crops (a random split point; each crop of either photo at 1 to 2 times
its native pixel density, mirrored half the time, its own colour gain and offset), sharpened by an
unsharp mask (radius 1.5, 150..300%) and given luminance grain (Gaussian, sigma 9..19), which
brings the mean file to about 110 KB. The knobs are ``SHARPEN`` and ``GRAIN``; ``python -m
benchmarks.imagenet_like N`` prints the measured means.

**The photos** are read from ``benchmarks/data/`` (copies of scikit-learn's two files, CC BY 2.0,
see ``benchmarks/data/README.md``), so the generator needs PIL and NumPy only, not scikit-learn
(the offline GPU machine may lack it) and the same bytes make the same dataset everywhere.

Written by ``workers`` processes (fork) into ``<root>.tmp-<pid>`` and renamed into place with a
``.complete`` marker (JSON: the stats); a folder without the marker, or another run's leftover
temporary folder, is never reused. Cached under ``benchmarks/.cache/``.

``shard_imagenet_like(folder)`` shards it with Sluice's own shard stage into every format
(WebDataset tar shards, the DALI index, FFCV ``.beton``), all samples in ``train``, the JPEG
bytes stored as they are (so every image keeps its own size); the shard stage's content
fingerprint makes a second call return the same artifact.

    python -m benchmarks.imagenet_like N [--out DIR] [--workers W] [--shard]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".cache"
DATA = HERE / "data"
PHOTOS = ("china.jpg", "flower.jpg")
QUALITY = 90
CLASSES = 1000
VERSION = 1  # bump when the pixels a (seed, i) gives change: the cache key holds it
# (width, height, probability); the rest of the mass is the spread (_spread)
SIZE_TABLE = ((500, 375, 0.45), (375, 500, 0.12), (500, 333, 0.12), (333, 500, 0.05), (500, 500, 0.04))
SPREAD_LONG_SIDE = (256, 800)
SPREAD_ASPECTS = (4 / 3, 3 / 2, 1.0, 16 / 9)
SHARPEN = (150, 300)  # unsharp-mask percent, uniform
GRAIN = (9.0, 19.0)  # luminance grain sigma (grey levels), uniform
DENSITY = (1.0, 2.0)  # source pixels per output pixel, per crop (1 = native scale)
NOISE_SIDE = 1024  # a fixed grain field, cropped at a random offset per image (cheap)


def class_name(c: int) -> str:
    return f"c{c:04d}"


def photo_paths() -> list[Path]:
    """The two source photos: the committed copies, else scikit-learn's own files."""
    if all((DATA / p).is_file() for p in PHOTOS):
        return [DATA / p for p in PHOTOS]
    try:
        import sklearn.datasets
        d = Path(sklearn.datasets.__file__).parent / "images"
        if all((d / p).is_file() for p in PHOTOS):
            return [d / p for p in PHOTOS]
    except ImportError:
        pass
    raise FileNotFoundError(f"the sample photos {PHOTOS} are neither in {DATA} nor in scikit-learn")


_STATE: dict = {}


def _sources():
    """(photos as PIL images, the grain field), loaded once per process."""
    if not _STATE:
        from PIL import Image
        _STATE["photos"] = [Image.open(p).convert("RGB") for p in photo_paths()]
        _STATE["grain"] = np.random.default_rng(12345).standard_normal((NOISE_SIDE, NOISE_SIDE)).astype(np.float32)
    return _STATE["photos"], _STATE["grain"]


def draw_size(rng: np.random.Generator) -> tuple[int, int]:
    """(width, height) from the ImageNet-like distribution (module docstring)."""
    u = rng.random()
    for w, h, p in SIZE_TABLE:
        if u < p:
            return w, h
        u -= p
    lo, hi = SPREAD_LONG_SIDE
    long_side = math.exp(rng.uniform(math.log(lo), math.log(hi)))
    aspect = SPREAD_ASPECTS[int(rng.integers(len(SPREAD_ASPECTS)))]
    short = max(64, round(long_side / aspect))
    long_side = round(long_side)
    return (long_side, short) if rng.random() < 2 / 3 else (short, long_side)


def _crop(rng: np.random.Generator, photos, w: int, h: int) -> np.ndarray:
    """One mosaic piece: ``w``×``h`` of a photo at 1..2 source pixels per output pixel, mirrored
    half the time, with its own colour gain and offset (float32 HWC)."""
    from PIL import Image
    im = photos[int(rng.integers(len(photos)))]
    pw, ph = im.size
    d = rng.uniform(*DENSITY)
    cw, ch = min(pw, max(1, round(w * d))), min(ph, max(1, round(h * d)))
    x0, y0 = int(rng.integers(0, pw - cw + 1)), int(rng.integers(0, ph - ch + 1))
    piece = im.resize((w, h), Image.BILINEAR, box=(x0, y0, x0 + cw, y0 + ch))
    if rng.random() < 0.5:
        piece = piece.transpose(Image.FLIP_LEFT_RIGHT)
    a = np.asarray(piece, np.float32)
    return a * rng.uniform(0.75, 1.25, 3).astype(np.float32) + rng.uniform(-20, 20, 3).astype(np.float32)


def make_image(seed: int, i: int):
    """Sample ``i``: (class index, PIL image); depends only on (seed, i)."""
    from PIL import Image, ImageFilter
    photos, grain = _sources()
    rng = np.random.default_rng([seed, i, VERSION])
    w, h = draw_size(rng)
    sx = int(rng.integers(w // 4, 3 * w // 4 + 1))
    sy = int(rng.integers(h // 4, 3 * h // 4 + 1))
    out = np.empty((h, w, 3), np.float32)
    for ys, ye in ((0, sy), (sy, h)):
        for xs, xe in ((0, sx), (sx, w)):
            out[ys:ye, xs:xe] = _crop(rng, photos, xe - xs, ye - ys)
    im = Image.fromarray(out.clip(0, 255).astype(np.uint8))
    im = im.filter(ImageFilter.UnsharpMask(radius=1.5, percent=int(rng.integers(*SHARPEN)), threshold=0))
    a = np.asarray(im, np.float32)
    sigma = rng.uniform(*GRAIN)
    # the grain field is tiled to cover images larger than it
    reps = (-(-h // NOISE_SIDE), -(-w // NOISE_SIDE))
    field = np.tile(grain, reps) if reps != (1, 1) else grain
    oy, ox = int(rng.integers(0, field.shape[0] - h + 1)), int(rng.integers(0, field.shape[1] - w + 1))
    a = a + sigma * field[oy:oy + h, ox:ox + w, None]
    return i % CLASSES, Image.fromarray(a.clip(0, 255).astype(np.uint8))


def _write_range(args) -> list[tuple[int, int, int]]:
    """Write samples lo..hi-1 into ``tmp``; (bytes, width, height) of each."""
    tmp, lo, hi, seed = args
    stats = []
    for i in range(lo, hi):
        c, im = make_image(seed, i)
        path = Path(tmp) / class_name(c) / f"{i:08d}.jpg"
        im.save(path, quality=QUALITY)
        stats.append((path.stat().st_size, *im.size))
    return stats


def default_root(n: int, seed: int = 0, cache: str | os.PathLike | None = None) -> Path:
    return Path(cache or CACHE) / f"imagenet_like-{n}-s{seed}-v{VERSION}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clear_leftovers(root: Path) -> None:
    """Remove temporary folders of ``root`` left by runs whose process is gone (never reused)."""
    for p in root.parent.glob(root.name + ".tmp-*"):
        try:
            pid = int(p.name.rsplit("-", 1)[1])
        except ValueError:
            continue
        if pid == os.getpid() or not _pid_alive(pid):
            shutil.rmtree(p, ignore_errors=True)


def make_imagenet_like(n: int, out: str | os.PathLike | None = None, seed: int = 0,
                       workers: int | None = None, progress: bool = True) -> Path:
    """The folder of ``n`` ImageNet-like JPEGs (module docstring), written once, then reused."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    root = Path(out) if out else default_root(n, seed)
    if (root / ".complete").exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    _clear_leftovers(root)
    tmp = root.with_name(root.name + f".tmp-{os.getpid()}")
    for c in range(CLASSES):
        (tmp / class_name(c)).mkdir(parents=True)
    workers = max(1, min(workers or os.cpu_count() or 1, n))
    chunk = max(1, min(200, -(-n // (workers * 4))))
    jobs = [(str(tmp), lo, min(n, lo + chunk), seed) for lo in range(0, n, chunk)]
    t = time.perf_counter()
    stats: list[tuple[int, int, int]] = []
    if workers == 1:
        for j in jobs:
            stats += _write_range(j)
    else:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as ex:
            for k, s in enumerate(ex.map(_write_range, jobs)):
                stats += s
                if progress and (k + 1) % max(1, len(jobs) // 10) == 0:
                    print(f"imagenet_like: {len(stats):,}/{n:,} images", flush=True)
    a = np.array(stats, np.float64).reshape(-1, 3)
    info = {"n": n, "seed": seed, "version": VERSION, "classes": CLASSES, "quality": QUALITY,
            "mean_bytes": float(a[:, 0].mean()), "median_bytes": float(np.median(a[:, 0])),
            "total_bytes": int(a[:, 0].sum()), "mean_width": float(a[:, 1].mean()),
            "mean_height": float(a[:, 2].mean()), "mean_pixels": float((a[:, 1] * a[:, 2]).mean()),
            "bytes_per_pixel": float(a[:, 0].sum() / (a[:, 1] * a[:, 2]).sum()),
            "workers": workers, "seconds": round(time.perf_counter() - t, 1)}
    (tmp / ".complete").write_text(json.dumps(info, indent=1) + "\n")
    if root.exists() and not (root / ".complete").exists():  # a half-written folder: never reused
        shutil.rmtree(root)
    try:
        tmp.rename(root)
    except OSError:  # another run finished the same folder first: it is the same data
        if not (root / ".complete").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    if progress:
        print(f"imagenet_like: {describe(root)}", flush=True)
    return root


def stats(folder: str | os.PathLike) -> dict:
    """What ``.complete`` records about a folder: n, mean bytes, mean width/height/pixels, ..."""
    return json.loads((Path(folder) / ".complete").read_text())


def describe(folder: str | os.PathLike) -> str:
    s = stats(folder)
    return (f"{s['n']:,} JPEGs, mean {s['mean_bytes'] / 1e3:.1f} KB (median {s['median_bytes'] / 1e3:.1f}), "
            f"mean {s['mean_width']:.0f}×{s['mean_height']:.0f} px ({s['mean_pixels']:,.0f} pixels, "
            f"{s['bytes_per_pixel']:.2f} byte/pixel), quality {s['quality']}, {s['classes']} classes; "
            f"written in {s['seconds']} s by {s['workers']} processes")


def shard_imagenet_like(folder: str | os.PathLike, out: str | os.PathLike | None = None,
                        formats: list[str] | None = None, workers: int | None = None,
                        shard_bytes: int = 64_000_000, progress: bool = False):
    """Shard ``folder`` with Sluice's shard stage into every format (or ``formats``), all of it in
    ``train``, the JPEG bytes as they are (variable sizes kept); returns the artifact's root
    (default: under ``artifacts/`` beside the folder). The stage's content fingerprint makes a
    repeated call find the same artifact."""
    from sluice.stages.data.config import IngestConfig, ShardConfig
    from sluice.stages.data.shard import shard_dataset
    folder = Path(folder)
    out = Path(out) if out else folder.parent / "artifacts" / f"{folder.name}-{'-'.join(formats) if formats else 'all'}"
    kw = {"formats": list(formats)} if formats else {}
    # check_classes=False: below 1,000 images most of the 1,000 class folders are empty, on purpose
    s = shard_dataset(IngestConfig(source=str(folder), kind="folder", holdout_fraction=0.0, val_fraction=0.0,
                                   test_fraction=0.0, check_classes=False),
                      out, ShardConfig(encoding="jpg", jpeg_quality=QUALITY, shard_bytes=shard_bytes,
                                       workers=workers, progress=progress, **kw))
    return s.root


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("n", type=int, nargs="?", default=10_000)
    ap.add_argument("--out", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--shard", action="store_true", help="also shard it into every format")
    a = ap.parse_args(argv)
    root = make_imagenet_like(a.n, a.out, a.seed, a.workers)
    print(root)
    print(describe(root))
    if a.shard:
        t = time.perf_counter()
        print(shard_imagenet_like(root, workers=a.workers), f"({time.perf_counter() - t:.0f} s)")


if __name__ == "__main__":
    main()
