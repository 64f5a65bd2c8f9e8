"""Fashion-MNIST as a folder of photos: the second real image dataset, shaped like what users
point Sluice at (issue #48: 12,000 JPEGs in 10 class folders, 40-146 px a side, three aspect
ratios, RGB).

``make_fashion_photos(out, n)`` writes ``out/<class>/<i>.jpg``:

* **classes**: the ten Fashion-MNIST class names as folders (``t-shirt_top``, ``trouser``,
  ``pullover``, ``dress``, ``coat``, ``sandal``, ``shirt``, ``sneaker``, ``bag``,
  ``ankle_boot``). A folder source numbers its labels by the **sorted folder names**
  (``ankle_boot`` 0, ``bag`` 1, ``coat`` 2, ``dress`` 3, ``pullover`` 4, ``sandal`` 5,
  ``shirt`` 6, ``sneaker`` 7, ``t-shirt_top`` 8, ``trouser`` 9), not Fashion-MNIST's own order:
  ``LABELS`` maps one to the other.
* **balanced**: image ``i`` is of class ``i % 10`` (Fashion-MNIST's numbering), so 12,000 images
  are 1,200 a class; it is the ``i // 10``-th image of that class in a seeded order of the
  Fashion-MNIST training set (read from the Debian package dataset-fashion-mnist, or
  ``$SLUICE_FASHION_MNIST``). Everything about image ``i`` depends on (seed, i) alone, so any
  ``n`` is a prefix of a larger one (at most 60,000: 6,000 a class).
* **sizes**: an aspect ratio of 1:1, 4:3 or 3:4 (width:height, equally likely); a square side in
  40..146 px, or a short side in 40..109 px and the long side 4/3 of it (53..145 px).
  Upscaled from 28x28 with PIL's bicubic filter.
* **colour**: a mild tint per image, so the three planes differ while the garment stays what it
  was: each pixel ``g * gain + (255 - g) * paper / 255``, a gain of 0.7..1.0 per channel on the
  garment and a background of 0..40 per channel where Fashion-MNIST is black.
* **JPEG** quality 90 (4:2:0, PIL's default), baseline, no EXIF: stored by the shard stage as
  they are (``encoding: auto`` picks jpg).

``messy=True`` adds the awkward files photo folders hold (``MESSY``, two of each, one truncated, named
``messy-<kind>-<k>.<ext>`` in the class folders; ``.complete`` lists them): grayscale JPEGs, RGBA
PNGs whose background is transparent (black under the alpha), palette PNGs with a transparent
entry, WebP, JPEGs stored on their side with EXIF orientation 6, CMYK JPEGs, and truncated JPEGs
(which the shard stage must quarantine).

Written into ``<out>.tmp-<pid>`` and renamed into place with a ``.complete`` marker (JSON: the
parameters, the classes, the messy files); a complete folder of the same parameters is reused, one
of other parameters is refused (choose another ``out``), and a half-written one is never used.

    python -m sluice.stages.data.fashion_photos OUT [--n N] [--seed S] [--messy]
"""
from __future__ import annotations

import argparse
import io
import json
import os
import shutil
from pathlib import Path

import numpy as np

from sluice.errors import SourceError

VERSION = 1  # bump when the images change for the same parameters
CLASS_NAMES = ["t-shirt_top", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
               "ankle_boot"]  # Fashion-MNIST's order
# Fashion-MNIST label -> the label a folder source gives the folder (its rank among the sorted names)
LABELS = {c: sorted(CLASS_NAMES).index(name) for c, name in enumerate(CLASS_NAMES)}
PER_CLASS = 6000  # Fashion-MNIST's training images per class
QUALITY = 90
ASPECTS = ((1, 1), (4, 3), (3, 4))  # width : height
SIDE = (40, 146)  # a square's side
SHORT = (40, 109)  # the short side of a 4:3 or 3:4 image (long side round(4/3 short) <= 145)
MESSY = ("gray", "rgba", "palette", "webp", "exif6", "cmyk", "truncated")
COMPLETE = ".complete"


def _train_set() -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST's training images (60,000 x 28 x 28) and labels, from its IDX files."""
    from sluice.stages.data.ingest import fashion_mnist_dir
    from sluice.stages.data.sources.idx import read_idx
    root = Path(fashion_mnist_dir())
    found = []
    for stem in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"):
        path = next((root / n for n in (stem + ".gz", stem) if (root / n).is_file()), None)
        if path is None:
            raise SourceError(f"Fashion-MNIST's {stem}[.gz] is not in {root} (install it with: apt-get install "
                              "dataset-fashion-mnist, or set SLUICE_FASHION_MNIST to a folder holding it)")
        found.append(read_idx(path))
    return found[0], found[1].astype(np.int64)


def _order(labels: np.ndarray, seed: int) -> list[np.ndarray]:
    """Per class, its training-set indices in a seeded order (the class alone decides it)."""
    return [np.random.default_rng([seed, 7, c]).permutation(np.flatnonzero(labels == c)) for c in range(10)]


def draw_size(rng: np.random.Generator) -> tuple[int, int]:
    """(height, width): an aspect of 1:1, 4:3 or 3:4 and a side in range (module docstring)."""
    aw, ah = ASPECTS[int(rng.integers(len(ASPECTS)))]
    if aw == ah:
        side = int(rng.integers(SIDE[0], SIDE[1] + 1))
        return side, side
    short = int(rng.integers(SHORT[0], SHORT[1] + 1))
    long = round(short * 4 / 3)
    return (short, long) if aw > ah else (long, short)


def make_photo(gray: np.ndarray, rng: np.random.Generator):
    """One Fashion-MNIST image as an RGB photo (PIL image): resized, tinted."""
    from PIL import Image
    h, w = draw_size(rng)
    big = np.asarray(Image.fromarray(gray).resize((w, h), Image.BICUBIC), np.float64)[:, :, None]
    gain = rng.uniform(0.7, 1.0, 3)
    paper = rng.uniform(0.0, 40.0, 3)
    rgb = big * gain + (255.0 - big) * paper / 255.0
    return Image.fromarray(np.clip(np.rint(rgb), 0, 255).astype(np.uint8), "RGB")


def _messy(kind: str, gray: np.ndarray, rng: np.random.Generator) -> tuple[str, bytes, dict]:
    """One awkward file: (extension, bytes, what the shard stage should make of it)."""
    from PIL import Image
    im = make_photo(gray, rng)
    w, h = im.size
    buf = io.BytesIO()
    info: dict = {"kind": kind}
    if kind == "gray":
        im.convert("L").save(buf, "JPEG", quality=QUALITY)
        ext, info["size"] = "jpg", [h, w]
    elif kind in ("rgba", "palette"):
        big = np.asarray(Image.fromarray(gray).resize((w, h), Image.BICUBIC))
        alpha = np.where(big > 24, 255, 0).astype(np.uint8)  # the garment opaque, the background transparent
        rgba = np.dstack([np.asarray(im) * (alpha[:, :, None] // 255), alpha])  # black under the transparency
        if kind == "rgba":
            Image.fromarray(rgba, "RGBA").save(buf, "PNG")
        else:
            p = Image.fromarray(rgba[:, :, :3], "RGB").quantize(255)  # indices 0..254; 255 is transparent
            idx = np.asarray(p).copy()
            idx[alpha == 0] = 255
            out = Image.fromarray(idx, "P")
            palette = (p.getpalette() or []) + [0] * 768
            out.putpalette(palette[:255 * 3] + [0, 0, 0])
            out.save(buf, "PNG", transparency=255)
        ext, info["size"] = "png", [h, w]
        ys, xs = np.nonzero(alpha == 0)
        info["transparent_pixel"] = [int(ys[0]), int(xs[0])] if len(ys) else None
    elif kind == "webp":
        im.save(buf, "WEBP", quality=QUALITY)
        ext, info["size"] = "webp", [h, w]
    elif kind == "exif6":
        exif = Image.Exif()
        exif[0x0112] = 6  # rotate 90 degrees clockwise to view: the upright image is w tall, h wide
        im.save(buf, "JPEG", quality=QUALITY, exif=exif.tobytes())
        ext, info["size"] = "jpg", [w, h]
    elif kind == "cmyk":
        im.convert("CMYK").save(buf, "JPEG", quality=QUALITY)
        ext, info["size"] = "jpg", [h, w]
    elif kind == "truncated":
        im.save(buf, "JPEG", quality=QUALITY)
        data = buf.getvalue()
        return "jpg", data[: len(data) // 2], {"kind": kind, "size": None}
    else:
        raise ValueError(f"unknown messy kind {kind!r}; one of {', '.join(MESSY)}")
    return ext, buf.getvalue(), info


def _params(n: int, seed: int, messy: bool) -> dict:
    return {"n": n, "seed": seed, "messy": messy, "version": VERSION, "quality": QUALITY}


def make_fashion_photos(out: str | os.PathLike, n: int = 12_000, seed: int = 0, messy: bool = False) -> Path:
    """The photo folder at ``out`` (module docstring), written once, then reused."""
    if not 1 <= n <= 10 * PER_CLASS:
        raise ValueError(f"n must be 1..{10 * PER_CLASS} (Fashion-MNIST's training set), not {n}")
    root = Path(out)
    want = _params(n, seed, messy)
    if (root / COMPLETE).exists():
        return _reuse(root, want)
    if root.exists() and any(root.iterdir()):
        raise FileExistsError(f"{root} exists without a {COMPLETE} marker (half-written, or not ours); "
                              "remove it or choose another folder")
    root.parent.mkdir(parents=True, exist_ok=True)
    _clear_leftovers(root)
    tmp = root.with_name(f"{root.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    for name in CLASS_NAMES:
        (tmp / name).mkdir(parents=True)
    images, labels = _train_set()
    order = _order(labels, seed)
    short = [CLASS_NAMES[c] for c in range(10) if len(order[c]) < len(range(c, n, 10)) + (14 if messy else 0)]
    if short:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(f"the Fashion-MNIST training set found has too few images of {', '.join(short)} for "
                         f"n={n} (a class needs n / 10 images{', and 14 more for the messy files' if messy else ''})")
    for i in range(n):
        c = i % 10
        rng = np.random.default_rng([seed, i])
        make_photo(images[order[c][i // 10]], rng).save(tmp / CLASS_NAMES[c] / f"{i}.jpg", "JPEG", quality=QUALITY)
    extras = []
    if messy:
        for k, kind in enumerate(MESSY):
            for j in range(1 if kind == "truncated" else 2):  # one bad file in 100 is within max_bad_fraction
                c = (3 * k + j) % 10
                rng = np.random.default_rng([seed, 1 << 20, k, j])
                ext, data, info = _messy(kind, images[order[c][-1 - (2 * k + j)]], rng)
                rel = f"{CLASS_NAMES[c]}/messy-{kind}-{j}.{ext}"
                (tmp / rel).write_bytes(data)
                extras.append({"path": rel, **info})
    (tmp / COMPLETE).write_text(json.dumps({**want, "classes": CLASS_NAMES, "folder_labels": sorted(CLASS_NAMES),
                                            "messy_files": extras}, indent=1) + "\n")
    try:
        if root.exists():
            root.rmdir()  # an empty folder (checked above) may be replaced
        tmp.rename(root)
    except OSError:  # another run finished the same folder first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (root / COMPLETE).exists():
            raise
        return _reuse(root, want)
    return root


def info(folder: str | os.PathLike) -> dict:
    """What ``.complete`` records of a finished folder: parameters, classes, messy files."""
    return json.loads((Path(folder) / COMPLETE).read_text())


def _reuse(root: Path, want: dict) -> Path:
    have = {k: v for k, v in info(root).items() if k in want}
    if have != want:
        raise FileExistsError(f"{root} holds photos made with {have}, not {want}; choose another folder")
    return root


def _clear_leftovers(root: Path) -> None:
    """Remove temporary folders of ``root`` left by runs whose process is gone."""
    for p in root.parent.glob(root.name + ".tmp-*"):
        try:
            pid = int(p.name.rsplit("-", 1)[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except (ValueError, PermissionError):
            continue


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m sluice.stages.data.fashion_photos",
                                 description="Fashion-MNIST as a folder of RGB JPEG photos of varying sizes")
    ap.add_argument("out", help="the folder to write (reused when complete with the same parameters)")
    ap.add_argument("--n", type=int, default=12_000, help="images (balanced over the 10 classes; default 12000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--messy", action="store_true", help="add gray, RGBA, palette, WebP, EXIF-rotated, CMYK and "
                                                         "truncated files (for tests)")
    a = ap.parse_args(argv)
    root = make_fashion_photos(a.out, a.n, a.seed, a.messy)
    d = info(root)
    print(f"{root}: {d['n']} photos in {len(d['classes'])} class folders (seed {d['seed']}"
          f"{', ' + str(len(d['messy_files'])) + ' messy files' if d['messy_files'] else ''}); "
          f"labels follow the sorted folder names: {', '.join(d['folder_labels'])}")


if __name__ == "__main__":
    main()
