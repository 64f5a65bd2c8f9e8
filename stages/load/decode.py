"""Decoding one stored sample to uint8 HWC pixels, as fast as this machine allows.

Baseline JPEGs go through OpenCV when it is installed (the same libjpeg-turbo defaults as PIL,
so the same pixels, about 2× faster for small images); anything unusual goes through PIL
(``SampleIndex.pixels``).
"""
from __future__ import annotations

import time

import numpy as np

from sluice.errors import CorruptSample
from sluice.stages.load.integrity import Damage
from sluice.stages.load.sample_index import SampleIndex

_CV2: list = []


def opencv():
    """OpenCV if installed (imported on first use), else None: callers then take another path."""
    if not _CV2:
        try:
            import cv2
        except ImportError:
            cv2 = None
        _CV2.append(cv2)
    return _CV2[0]


def pixels(si: SampleIndex, i: int) -> np.ndarray:
    """``si.pixels(i)``, with baseline JPEGs decoded by OpenCV (the same libjpeg-turbo defaults
    as PIL, so the same pixels; about 2× faster for small images). Anything unusual (CMYK, no
    OpenCV, a decode failure) goes through PIL as before. The read and the decode are timed
    into ``si.timings``."""
    data = si.read(i)
    t = time.perf_counter()
    try:
        return decode_bytes(si, i, data)
    finally:
        si.timings.add("decode", time.perf_counter() - t)


def pixels_batch(si: SampleIndex, idx: np.ndarray) -> tuple[list[np.ndarray], list[int], list[Damage]]:
    """``pixels`` for a whole batch (``si.read_batch``, then one decode per sample): the images
    and split indices of the good samples, in order, and the damage found (checksums that do not
    match, bytes that no longer decode). Read and decode are timed once per batch."""
    datas, damage = si.read_batch(idx)
    imgs, keep = [], []
    t = time.perf_counter()
    for i, data in zip(np.asarray(idx).reshape(-1).tolist(), datas):
        if data is None:
            continue
        try:
            imgs.append(decode_bytes(si, i, data))
            keep.append(i)
        except CorruptSample as e:
            damage.append(Damage(i, e.file, getattr(e, "reason", str(e))))
    si.timings.add("decode", time.perf_counter() - t)
    return imgs, keep, damage


def decode_bytes(si: SampleIndex, i: int, data: bytes) -> np.ndarray:
    """Sample ``i``'s stored bytes as uint8 HWC pixels (untimed); bytes that no longer decode
    raise ``CorruptSample`` naming it."""
    if si.encoding in ("jpg", "jpeg"):
        cv2 = opencv()
        if cv2 is not None and jpeg_components(data) in (1, 3):
            arr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED | cv2.IMREAD_IGNORE_ORIENTATION)
            if arr is not None and arr.dtype == np.uint8 and (arr.ndim == 2 or arr.shape[2] == 3):
                return arr[:, :, None] if arr.ndim == 2 else cv2.cvtColor(arr, cv2.COLOR_BGR2RGB)
    try:
        return si.decode_untimed(data)
    except Exception as e:  # noqa: BLE001 - stored bytes that no longer decode are damage, named
        raise si.damaged(i, f"cannot decode its {si.encoding} bytes ({type(e).__name__}: {e})") from None


def jpeg_components(data: bytes) -> int | None:
    """Colour components of a Huffman baseline/extended/progressive JPEG (from its SOF0-2
    header); None for anything else, which is then left to PIL."""
    if data[:2] != b"\xff\xd8":
        return None
    pos, end = 2, len(data) - 9
    while pos < end:
        if data[pos] != 0xFF:
            return None
        m = data[pos + 1]
        if m == 0xFF:  # fill byte
            pos += 1
            continue
        if m in (0xC0, 0xC1, 0xC2):
            return data[pos + 9]
        if 0xC3 <= m <= 0xCF and m not in (0xC4, 0xC8, 0xCC) or m == 0xDA:
            return None  # lossless / arithmetic coding, or scan data before any SOF
        if m == 0x01 or 0xD0 <= m <= 0xD7:
            pos += 2
            continue
        pos += 2 + ((data[pos + 2] << 8) | data[pos + 3])
    return None
