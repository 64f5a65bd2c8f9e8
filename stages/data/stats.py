"""What a recipe reads to fit a model to a dataset artifact: its images' per-channel mean and std
(for normalisation), channels, and sizes (for the training resolution).

    from sluice.stages.data.stats import image_stats
    s = image_stats("sluice-data/photos")   # a version, or a dataset root (its LATEST)
    s.mean, s.std          # per channel, 0..1: [0.2863, ...], [0.3530, ...]
    s.channels             # 1 (gray) or 3 (RGB)
    s.sizes.short_side.median, s.sizes.distinct   # e.g. 87.0 px, 153 distinct (height, width)

The shard stage takes them in its scan, where every sample's pixels are decoded anyway (no
extra decode), and records them in the manifest (``fields.image.stats``, ``ImageStats``: the
train split's live samples, every pixel of every image counted once, values as stored after
EXIF rotation, compositing onto white, resizing and channel conversion; a re-encoded JPEG's are
its pixels before encoding, within JPEG noise of what a reader decodes). An artifact written
before them has none: ``image_stats`` then decodes its stored train samples once (not saved: an
artifact is never changed), which for Fashion-MNIST takes a second or two.
"""
from __future__ import annotations

import io
import math
import os
import tarfile

import numpy as np

from sluice.errors import ArtifactError
from sluice.stages.data.scan import pixel_sums
from sluice.storage.artifact import DatasetArtifact, open_artifact
from sluice.storage.manifest import ImageStats, SizeSummary, Spread

__all__ = ["image_stats", "image_stats_of"]


def image_stats(artifact: DatasetArtifact | str | os.PathLike, split: str = "train",
                compute: bool = True) -> ImageStats | None:
    """``split``'s image statistics: the manifest's (``fields.image.stats``, recorded for train);
    otherwise, with ``compute``, taken now from the split's stored samples (decoding each once),
    else None. An empty split has none."""
    art = artifact if isinstance(artifact, DatasetArtifact) else open_artifact(artifact)
    stored = art.manifest.fields.image.stats
    if stored is not None and stored.split == split:
        return stored
    if not compute or art.manifest.split(split).live_count == 0:
        return None
    sizes: list[tuple[int, int]] = []
    totals: list[int] = []
    for pixels in _stored_images(art, split):
        sums = pixel_sums(pixels)
        if not totals:
            totals = [0] * (1 + len(sums))
        totals[0] += pixels.shape[0] * pixels.shape[1]
        for k, v in enumerate(sums):
            totals[1 + k] += v
        sizes.append((pixels.shape[0], pixels.shape[1]))
    return image_stats_of(sizes, totals, split)


def image_stats_of(sizes: list[tuple[int, int]], totals: list[int], split: str = "train") -> ImageStats | None:
    """A split's ``ImageStats`` from its samples' (height, width) and its exact totals
    [pixels, per-channel sums..., per-channel sums of squares...] (``ScanResult.totals``).
    None for an empty split."""
    if not sizes or not totals or not totals[0]:
        return None
    n, c = totals[0], (len(totals) - 1) // 2
    sums, squares = totals[1:1 + c], totals[1 + c:]
    # std from exact integers: n * sum(x^2) - sum(x)^2 >= 0, no cancellation in floating point
    mean = [s / (255 * n) for s in sums]
    std = [math.sqrt(n * q - s * s) / (255 * n) for s, q in zip(sums, squares)]
    hw = np.asarray(sizes, np.int64).reshape(-1, 2)

    def spread(v: np.ndarray) -> Spread:
        return Spread(min=int(v.min()), median=float(np.median(v)), max=int(v.max()))
    summary = SizeSummary(height=spread(hw[:, 0]), width=spread(hw[:, 1]), short_side=spread(hw.min(1)),
                          distinct=len({(int(h), int(w)) for h, w in hw}))
    return ImageStats(split=split, samples=len(hw), pixels=n, channels=c, mean=mean, std=std, sizes=summary)


def _stored_images(art: DatasetArtifact, split: str):
    """Each live sample's stored pixels (HxWxC uint8), from the tar shards, else the .beton."""
    rec = art.manifest.split(split)
    live = np.zeros(rec.count, bool)
    live[art.live(split)] = True
    encoding = art.manifest.fields.image.encoding
    if rec.shards:
        for sh in rec.shards:
            with tarfile.open(art.local(sh.tar), "r:") as t:
                images = (m for m in t if m.isfile() and m.name.endswith("." + encoding))
                for k, m in enumerate(images):
                    if live[sh.first_index + k]:
                        yield _decode(t.extractfile(m).read(), encoding, f"{sh.tar.path}:{m.name}")
        return
    if not rec.ffcv_files():
        raise ArtifactError(f"{art.root}: split {split!r} has neither tar shards nor a .beton to read images from")
    from sluice.stages.data.formats.beton import read_layout
    shape = art.manifest.fields.image.shape
    for part in rec.ffcv_files():
        path = art.local(part.file)
        _, _, meta, alloc = read_layout(str(path))
        image = meta[meta.dtype.names[0]]
        raw = np.memmap(path, np.uint8, mode="r")
        sizes = dict(zip(alloc["ptr"].tolist(), alloc["size"].tolist()))
        for k in range(len(meta)):
            if not live[part.first_index + k]:
                continue
            if art.manifest.fields.image.ffcv_field == "ndarray":
                p = int(image[k])
                yield np.array(raw[p:p + int(np.prod(shape))]).reshape(shape)
                continue
            p = int(image["data_ptr"][k])
            data = bytes(raw[p:p + sizes[p]])
            if int(image["mode"][k]) == 1:  # raw RGB
                yield np.frombuffer(data, np.uint8).reshape(int(image["height"][k]), int(image["width"][k]), 3)
            else:
                yield _decode(data, "jpg", f"{part.file.path}[{k}]")


def _decode(data: bytes, encoding: str, where: str) -> np.ndarray:
    """Stored image bytes as HxWxC uint8, as a reader decodes them."""
    try:
        if encoding == "npy":
            arr = np.load(io.BytesIO(data), allow_pickle=False)
        else:
            from PIL import Image
            with Image.open(io.BytesIO(data)) as im:
                arr = np.asarray(im.convert("L" if im.mode in ("L", "1") else "RGB"))
    except Exception as e:  # noqa: BLE001 - a damaged sample is named
        raise ArtifactError(f"{where}: cannot decode its stored {encoding} bytes ({type(e).__name__}: {e}); "
                            "run `sluice verify` on the artifact") from None
    return arr[:, :, None] if arr.ndim == 2 else arr
