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
class SampleEncoder:
    """What every shard worker needs: the open source and how to encode its samples. Forked
    pool workers inherit it (``worker_pool.map_forked``) instead of re-reading the source."""
    source: Source
    config: ShardConfig
    num_classes: int | None
    # The channels every sample is stored with when ``config.channels`` leaves them open: set by
    # the stage after the scan (3 where gray and RGB photos mix, or photos vary in size), so the
    # writers turn a gray photo into RGB instead of the scan quarantining the minority.
    channels: int | None = None

    def prepare(self, s: RawSample) -> tuple[np.ndarray, int]:
        """Validated HWC uint8 pixels and the integer label, or SampleError saying why not."""
        label = to_label(s.label, self.num_classes)
        cfg = self.config
        pixels = decode_pixels(s, cfg.channels, cfg.image_size, cfg.max_pixels)
        if self.channels == 3 and pixels.shape[2] == 1:  # exactly what the scan's RGB content CRC took
            pixels = np.repeat(pixels, 3, axis=2)
        return pixels, label

    def members(self, s: RawSample, pixels: np.ndarray, label: int, index: int) -> list[tuple[str, bytes]]:
        """The tar members of one sample: its image (passed through unchanged when the source's
        bytes already decode to exactly these pixels in the wanted encoding), its label and its
        split index."""
        cfg = self.config
        passthrough = (s.encoded is not None and s.encoded_ext == cfg.encoding and cfg.encoding != "npy"
                       and cfg.image_size is None and cfg.channels is None
                       and stored_as_is(s.encoded, cfg.encoding, pixels))
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
        s = value.strip().lstrip("\ufeff").strip()  # a byte-order mark is encoding, not content
        if not (s.isascii() and s.lstrip("-").isdigit()):  # "²".isdigit() is True, int("²") fails
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


def decode_pixels(s: RawSample, channels: int | None, size: tuple[int, int] | None,
                  max_pixels: int | None = None) -> np.ndarray:
    """HxWxC uint8 pixels of a sample (decoding bytes if needed, resizing if asked). Pixel values
    are never changed silently: 16-bit images are scaled to 8 bits, anything else that is not
    0..255 is refused, and an image above ``max_pixels`` is refused before it is decoded. A
    photo is upright as a viewer shows it (EXIF orientation applied), and transparency is
    composited onto white (``on_white``): what the picture looks like, where dropping the alpha
    channel would show whatever colour the transparent pixels happen to hold (often black)."""
    if s.array is not None:
        arr = np.asarray(s.array)
    elif s.encoded is not None:
        arr = _decode_bytes(s.encoded, s.encoded_ext, channels, max_pixels)
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
    _check_pixels(arr.shape[1], arr.shape[0], max_pixels)
    if arr.shape[2] == 4:
        arr = on_white(arr)
    if channels == 3 and arr.shape[2] == 1:
        arr = np.repeat(arr, 3, axis=2)
    elif channels == 1 and arr.shape[2] == 3:
        arr = np.round(arr @ np.array([0.299, 0.587, 0.114])).astype(np.uint8)[:, :, None]
    if size is not None and arr.shape[:2] != tuple(size):
        arr = _resize(arr, size)
    return np.ascontiguousarray(arr)


def _check_pixels(width: int, height: int, max_pixels: int | None) -> None:
    if max_pixels is not None and width * height > max_pixels:
        raise SampleError(f"image is {width}x{height} = {width * height:,} pixels, more than "
                          f"shard.max_pixels={max_pixels:,} (a decompression bomb?); raise the limit "
                          "to keep such images")


_PIL_FORMAT = {"jpg": "JPEG", "png": "PNG"}


def _decode_bytes(data: bytes, ext: str | None, channels: int | None, max_pixels: int | None = None) -> np.ndarray:
    if ext == "npy":
        try:
            return np.load(io.BytesIO(data), allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise SampleError(f"cannot decode .npy bytes: {e}") from None
    from PIL import Image, ImageOps, UnidentifiedImageError
    try:
        with Image.open(io.BytesIO(data)) as im:
            _check_pixels(*im.size, max_pixels)  # from the header, before any pixel is decoded
            im.load()
            if im.getexif().get(0x0112, 1) != 1:
                im = ImageOps.exif_transpose(im)  # upright, as a viewer shows it
            if im.mode.startswith("I;16"):
                arr = _from_16_bit(np.asarray(im))
                return _to_channels(arr, channels)
            if im.mode == "I":
                arr = np.asarray(im)
                if arr.size and (arr.min() < 0 or arr.max() > 255):
                    raise SampleError(f"32-bit integer pixels (range {arr.min()}..{arr.max()}) cannot "
                                      "be scaled to 8 bits without knowing their range")
                return _to_channels(arr.astype(np.uint8), channels)
            if im.mode == "F":
                raise SampleError("floating-point pixels cannot be stored as 8 bits without changing them")
            if _transparent(im):
                gray = im.mode in ("L", "LA", "La", "1")
                flat = on_white(np.asarray(im.convert("LA" if gray else "RGBA")))
                im = Image.fromarray(flat[:, :, 0] if gray else flat)
            mode = "L" if channels == 1 or (channels is None and im.mode in ("L", "1")) else "RGB"
            return np.asarray(im.convert(mode))  # P, CMYK, YCbCr, LAB: to RGB; 1: to gray
    except Image.DecompressionBombError:  # PIL refuses it at open, before our own check
        limit = 2 * (Image.MAX_IMAGE_PIXELS or 0)
        ours = f"more than shard.max_pixels={max_pixels:,} and " if max_pixels and max_pixels < limit else ""
        raise SampleError(f"image has {ours}more than the {limit:,} pixels PIL will decode (a decompression "
                          "bomb?)") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise SampleError(f"cannot decode image ({ext or 'unknown format'}): {e}") from None


def _transparent(im) -> bool:
    """Whether a PIL image carries transparency: an alpha channel, or a transparent palette
    entry or colour key (PNG's tRNS, GIF's transparency, kept in ``info``)."""
    return im.mode in ("RGBA", "RGBa", "LA", "La", "PA") or "transparency" in im.info


def on_white(arr: np.ndarray) -> np.ndarray:
    """HxWx(C+1) uint8 pixels with alpha last, composited onto white: HxWxC, each value
    ``round((v * a + 255 * (255 - a)) / 255)`` (opaque pixels unchanged, transparent ones white)."""
    v, a = arr[:, :, :-1].astype(np.uint32), arr[:, :, -1:].astype(np.uint32)
    return ((v * a + 255 * (255 - a) + 127) // 255).astype(np.uint8)


def _from_16_bit(arr: np.ndarray) -> np.ndarray:
    """16-bit pixels scaled to 8 bits, rounding: 0 stays 0, 65535 becomes 255, order is kept."""
    return ((arr.astype(np.uint32) * 255 + 32767) // 65535).astype(np.uint8)


def _to_channels(arr: np.ndarray, channels: int | None) -> np.ndarray:
    return np.repeat(arr[:, :, None], 3, axis=2) if channels == 3 else arr


def stored_as_is(data: bytes, encoding: str, pixels: np.ndarray) -> bool:
    """Whether ``data`` decodes, with no further step, to exactly ``pixels``: the wanted format,
    8-bit gray or RGB as stored, opaque, upright (no EXIF rotation), the same size. Only then may the
    source's bytes go into the artifact unchanged; anything else is re-encoded from the pixels."""
    from PIL import Image
    try:
        with Image.open(io.BytesIO(data)) as im:
            gray = pixels.shape[2] == 1
            return (im.format == _PIL_FORMAT.get(encoding) and im.mode == ("L" if gray else "RGB")
                    and "transparency" not in im.info
                    and im.size == (pixels.shape[1], pixels.shape[0])
                    and im.getexif().get(0x0112, 1) == 1)
    except Exception:  # noqa: BLE001 - undecidable: re-encode
        return False


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
