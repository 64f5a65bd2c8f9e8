"""What a backend may hand the loader besides one stacked uint8 NHWC array: images of different
sizes on one zero-padded canvas (``Canvas``), or images still encoded (``Encoded``) for the
loader to decode in one batched call on its device. Both keep the batch's order; the labels and
indices travel beside them as before."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch


class Canvas(NamedTuple):
    """Images of different sizes in one batch: ``pixels`` (N, Hmax, Wmax, C) uint8, each image
    at the top left of its slot and zeros beyond it; ``sizes`` (N, 2) int64, each image's (h, w).
    Crop boxes are drawn in each image's own pixels, so the padding is never read."""
    pixels: np.ndarray | torch.Tensor
    sizes: np.ndarray | torch.Tensor


class Encoded(NamedTuple):
    """A batch's images as stored (JPEG), checked but not decoded: sample k's bytes are
    ``data[offsets[k]:offsets[k + 1]]``. One buffer, so a DataLoader worker hands it over in
    shared memory rather than pickling a list of bytes."""
    data: np.ndarray | torch.Tensor
    offsets: np.ndarray | torch.Tensor

    def count(self) -> int:
        return len(self.offsets) - 1

    def samples(self) -> list[np.ndarray]:
        """Each sample's bytes as a uint8 view."""
        data = np.asarray(self.data)
        offs = np.asarray(self.offsets).tolist()
        return [data[offs[k]:offs[k + 1]] for k in range(len(offs) - 1)]


def encoded(datas: list[bytes | np.ndarray]) -> Encoded:
    """The samples' bytes end to end in one buffer."""
    sizes = np.fromiter((len(d) for d in datas), np.int64, len(datas))
    offsets = np.zeros(len(datas) + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    data = np.empty(int(offsets[-1]), np.uint8)
    for d, lo, hi in zip(datas, offsets[:-1].tolist(), offsets[1:].tolist()):
        data[lo:hi] = np.frombuffer(d, np.uint8) if isinstance(d, (bytes, bytearray, memoryview)) else d
    return Encoded(data, offsets)


def stack_or_canvas(images: list[np.ndarray], empty_shape: tuple[int, ...]) -> np.ndarray | Canvas:
    """Decoded HWC images as one uint8 NHWC array where they share a size (exactly what
    ``np.stack`` gives), else a ``Canvas``. None of them: an empty array of ``empty_shape``."""
    if not images:
        return np.empty((0, *empty_shape), np.uint8)
    first = images[0].shape
    if all(im.shape == first for im in images):
        return np.stack(images)
    return canvas(images)


def canvas(images: list[np.ndarray | torch.Tensor]) -> Canvas:
    """HWC images (numpy or torch, one device) on one zero-padded (N, Hmax, Wmax, C) canvas."""
    sizes = np.array([im.shape[:2] for im in images], np.int64).reshape(-1, 2)
    c = images[0].shape[2]
    if any(im.shape[2] != c for im in images):
        raise ValueError(f"images of {sorted({im.shape[2] for im in images})} channels in one batch")
    hmax, wmax = (int(v) for v in sizes.max(0))
    if isinstance(images[0], torch.Tensor):
        out = torch.zeros((len(images), hmax, wmax, c), dtype=torch.uint8, device=images[0].device)
    else:
        out = np.zeros((len(images), hmax, wmax, c), np.uint8)
    for k, im in enumerate(images):
        out[k, :im.shape[0], :im.shape[1]] = im
    return Canvas(out, sizes)


def stored_channels(artifact) -> int:
    """The channels of an artifact's images: its fixed shape's, else what the shard config
    converted to (``shard.channels``), else 3 (RGB)."""
    shape = artifact.manifest.fields.image.shape
    if shape is not None:
        return int(shape[2])
    shard = (artifact.manifest.config or {}).get("shard") or {}
    return int(shard.get("channels") or 3)
