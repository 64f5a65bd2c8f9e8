"""Turn a raw sample into validated pixels and encoded bytes for each output format.

This is where per-sample problems are found (undecodable bytes, wrong shape, a label that is
not an integer or out of range); each raises SampleError with the reason, and the shard stage
quarantines that sample.
"""
from __future__ import annotations

import io
import numbers
from dataclasses import dataclass

import numpy as np

from sluice.errors import SampleError
from sluice.stages.data.config import ShardConfig
from sluice.stages.data.sources.base import RawSample, Source

NPY_HEADERS: dict[tuple[int, ...], bytes] = {}


@dataclass
class ShardJob:
    """What every shard worker needs: the open source and how to encode its samples. Forked
    pool workers inherit it (``procs.map_forked``) instead of re-reading the source."""
    source: Source
    config: ShardConfig
    num_classes: int | None

    def prepare(self, s: RawSample) -> tuple[np.ndarray, int]:
        """Validated HWC uint8 pixels and the integer label, or SampleError saying why not."""
        label = to_label(s.label, self.num_classes)
        return decode_pixels(s, self.config.channels, self.config.image_size), label

    def members(self, s: RawSample, pixels: np.ndarray, label: int, index: int) -> list[tuple[str, bytes]]:
        """The tar members of one sample: its image (passed through unchanged when the source
        already holds it in the wanted encoding), its label and its split index."""
        cfg = self.config
        passthrough = (s.encoded is not None and s.encoded_ext == cfg.encoding and cfg.encoding != "npy"
                       and cfg.image_size is None and cfg.channels is None)
        img = s.encoded if passthrough else encode_image(pixels, cfg.encoding, cfg.jpeg_quality, cfg.png_level)
        return [(cfg.encoding, img), ("cls", str(label).encode()),
                ("idx", int(index).to_bytes(8, "little", signed=True))]


def to_label(value: object, num_classes: int | None) -> int:
    """An integer class label, or SampleError saying what is wrong with ``value``."""
    if isinstance(value, np.generic):
        value = value.item()
    if type(value) is int:  # the common case, without the ABC checks below
        if value < 0 or (num_classes is not None and value >= num_classes):
            rng = f"[0, {num_classes})" if num_classes is not None else ">= 0"
            raise SampleError(f"label {value} is out of range {rng}")
        return value
    if isinstance(value, (bytes, bytearray)):
        try:
            value = value.decode().strip()
        except UnicodeDecodeError:
            raise SampleError(f"label {bytes(value)[:16]!r} is not an integer") from None
    if isinstance(value, str):
        s = value.strip()
        if not (s.lstrip("-").isdigit()):
            raise SampleError(f"label {value!r} is not an integer")
        label = int(s)
    elif isinstance(value, (bool, np.bool_)):
        raise SampleError(f"label {value!r} is a boolean, not an integer class")
    elif isinstance(value, numbers.Integral):
        label = int(value)
    elif isinstance(value, numbers.Real):
        f = float(value)
        if not np.isfinite(f) or f != int(f):
            raise SampleError(f"label {value!r} is not an integer")
        label = int(f)
    else:
        raise SampleError(f"label of type {type(value).__name__} is not an integer")
    if label < 0 or (num_classes is not None and label >= num_classes):
        rng = f"[0, {num_classes})" if num_classes is not None else ">= 0"
        raise SampleError(f"label {label} is out of range {rng}")
    return label


def decode_pixels(s: RawSample, channels: int | None, size: tuple[int, int] | None) -> np.ndarray:
    """HxWxC uint8 pixels of a sample (decoding bytes if needed, resizing if asked)."""
    if s.array is not None:
        arr = np.asarray(s.array)
    elif s.encoded is not None:
        arr = _decode_bytes(s.encoded, s.encoded_ext, channels)
    else:
        raise SampleError("sample has no image data")
    if arr.dtype != np.uint8:
        if arr.dtype.kind in "iu" and arr.size and arr.min() >= 0 and arr.max() <= 255:
            arr = arr.astype(np.uint8)
        else:
            raise SampleError(f"image dtype {arr.dtype} is not uint8 (values must be 0..255)")
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if arr.ndim != 3 or arr.shape[2] not in (1, 3, 4) or arr.shape[0] < 1 or arr.shape[1] < 1:
        raise SampleError(f"image shape {arr.shape} is not (H, W, C) with C in 1, 3")
    if arr.shape[2] == 4:
        arr = arr[:, :, :3]
    if channels == 3 and arr.shape[2] == 1:
        arr = np.repeat(arr, 3, axis=2)
    elif channels == 1 and arr.shape[2] == 3:
        arr = np.round(arr @ np.array([0.299, 0.587, 0.114])).astype(np.uint8)[:, :, None]
    if size is not None and arr.shape[:2] != tuple(size):
        arr = _resize(arr, size)
    return np.ascontiguousarray(arr)


def _decode_bytes(data: bytes, ext: str | None, channels: int | None) -> np.ndarray:
    if ext == "npy":
        try:
            return np.load(io.BytesIO(data), allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise SampleError(f"cannot decode .npy bytes: {e}") from None
    from PIL import Image, UnidentifiedImageError
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            mode = "L" if channels == 1 or (channels is None and im.mode in ("L", "I;16", "1")) else "RGB"
            return np.asarray(im.convert(mode))
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise SampleError(f"cannot decode image ({ext or 'unknown format'}): {e}") from None


def _resize(arr: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    from PIL import Image
    mode = "L" if arr.shape[2] == 1 else "RGB"
    im = Image.fromarray(arr[:, :, 0] if mode == "L" else arr, mode)
    out = np.asarray(im.resize((size[1], size[0]), Image.BILINEAR))
    return out[:, :, None] if out.ndim == 2 else out


def encode_npy(arr: np.ndarray) -> bytes:
    """The .npy file bytes of ``arr``, reusing the header for repeated shapes."""
    key = arr.shape
    head = NPY_HEADERS.get(key)
    if head is None:
        buf = io.BytesIO()
        np.lib.format.write_array(buf, arr, allow_pickle=False)
        head = buf.getvalue()[: -arr.nbytes]
        NPY_HEADERS[key] = head
    return head + arr.tobytes()


def encode_image(arr: np.ndarray, encoding: str, jpeg_quality: int, png_level: int = 1) -> bytes:
    if encoding == "npy":
        return encode_npy(arr)
    from PIL import Image
    im = Image.fromarray(arr[:, :, 0] if arr.shape[2] == 1 else arr)
    buf = io.BytesIO()
    if encoding == "png":
        im.save(buf, format="PNG", compress_level=png_level)
    else:
        im.save(buf, format="JPEG", quality=jpeg_quality)
    return buf.getvalue()
