"""FFCV's ``.beton`` file format (version 2), written without importing FFCV.

Importing FFCV costs ~5 s in every fresh process (``ffcv.fields`` makes numba compile a typed
dict), and its ``DatasetWriter`` forks workers that it polls forever if one dies. The format is
simple, so this module writes it directly, byte for byte as ``DatasetWriter`` with one worker
does (a test compares the two and reads the result with FFCV's own loader):

    header | one descriptor per field | one metadata record per sample | zero padding
    | data pages (``page_size`` bytes each) | allocation table (sample, offset, size)

Fixed-size values (ints) live in the metadata record; variable data (pixels, JPEG bytes, keys)
is allocated on the current page, and the record holds its file offset. A sample whose data
does not fit in what is left of a page starts again on a fresh page (the bytes it wrote on the
old page stay there, unreferenced, as FFCV leaves them).
"""
from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterable, Sequence

import numpy as np

VERSION = 2
MIN_PAGE_SIZE = 1 << 21  # FFCV's smallest page (2 MiB); pages are powers of two
# FFCV's writer refuses pages under 2 MiB (a huge page), its reader takes any power of two: the
# parts of incremental versions use 64 KiB pages (tests/test_ffcv_parts.py reads them with FFCV)
PART_PAGE_SIZE = 1 << 16
HEADER = np.dtype([("version", "<u2"), ("num_fields", "<u2"), ("page_size", "<u4"),
                   ("num_samples", "<u8"), ("alloc_table_ptr", "<u8")], align=True)
FIELD_DESCRIPTOR = np.dtype([("type_id", "<u1"), ("name", ("<u1", 16)), ("arguments", ("<u1", (1024,)))],
                            align=True)
ALLOCATION = np.dtype([("sample_id", "<u8"), ("ptr", "<u8"), ("size", "<u8")])
_NDARRAY_ARGS = np.dtype([("shape", "<u8", 32), ("type_length", "<u8")])
_RGB_MODES = {"jpg": 0, "raw": 1}


class _Retry(Exception):
    """The sample did not fit in what was left of the page: write it again on the fresh one."""


@dataclass(frozen=True)
class IntField:
    """A scalar int64, kept in the metadata record (FFCV's ``IntField``, type 1)."""
    type_id = 1
    metadata = np.dtype("<i8")

    def arguments(self) -> bytes:
        return b""

    def encode(self, record: np.ndarray, value: Any, malloc) -> None:
        record[0] = value


@dataclass(frozen=True)
class BytesField:
    """A variable-length byte string (FFCV's ``BytesField``, type 3)."""
    type_id = 3
    metadata = np.dtype([("ptr", "<u8"), ("size", "<u8")])

    def arguments(self) -> bytes:
        return b""

    def encode(self, record: np.ndarray, value: np.ndarray, malloc) -> None:
        record["ptr"], buf = malloc(value.size)
        buf[:] = value
        record["size"] = value.size


@dataclass(frozen=True)
class NDArrayField:
    """A fixed-shape array (FFCV's ``NDArrayField``, type 4): its dtype and shape travel in the
    descriptor's arguments."""
    dtype: np.dtype
    shape: tuple[int, ...]
    type_id = 4
    metadata = np.dtype("<u8")

    def arguments(self) -> bytes:
        head = np.zeros(1, dtype=_NDARRAY_ARGS)
        head["shape"][0][:len(self.shape)] = np.asarray(self.shape, dtype="<u8")
        described = json.dumps(np.dtype(self.dtype).descr).encode("ascii")
        head["type_length"][0] = len(described)
        return head.tobytes() + described

    def encode(self, record: np.ndarray, value: np.ndarray, malloc) -> None:
        record[0], buf = malloc(int(np.dtype(self.dtype).itemsize * np.prod(self.shape)))
        buf[:] = value.reshape(-1).view("<u1")


@dataclass(frozen=True)
class RGBImageField:
    """An RGB image (FFCV's ``RGBImageField``, type 2), stored raw or as JPEG (``mode``): the JPEG
    the tar shards hold where it is given (a photo's own bytes, kept), else OpenCV's, as FFCV's
    own writer makes it."""
    mode: str = "raw"
    jpeg_quality: int = 90
    type_id = 2
    metadata = np.dtype([("mode", "<u1"), ("width", "<u2"), ("height", "<u2"), ("data_ptr", "<u8")])

    def arguments(self) -> bytes:
        return b""

    def encode(self, record: np.ndarray, image: np.ndarray | tuple[np.ndarray, bytes], malloc) -> None:
        """``image``: its pixels, or (pixels, the JPEG bytes they decode from): in ``jpg`` mode
        those bytes are stored as they are (the tar shards' own, so every backend reads the same
        JPEG), unless they exceed ``jpeg_bound`` (a photo carrying large metadata), which the
        page size was chosen for; then the pixels are encoded afresh."""
        image, given = image if isinstance(image, tuple) else (image, None)
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(f"an RGB image field takes uint8 (H, W, 3) pixels, not {image.dtype} {image.shape}")
        record["mode"] = _RGB_MODES[self.mode]
        record["height"], record["width"] = image.shape[:2]
        if self.mode == "jpg" and given is not None and len(given) <= jpeg_bound(*image.shape[:2]):
            data = np.frombuffer(given, "<u1")
        elif self.mode == "jpg":
            import cv2
            ok, data = cv2.imencode(".jpg", cv2.cvtColor(image, cv2.COLOR_RGB2BGR),
                                    [int(cv2.IMWRITE_JPEG_QUALITY), int(self.jpeg_quality)])
            if not ok:
                raise ValueError("OpenCV could not encode the image as JPEG")
            data = data.reshape(-1)
        else:
            data = np.ascontiguousarray(image).view("<u1").reshape(-1)
        record["data_ptr"], buf = malloc(data.nbytes)
        buf[:] = data


Field = IntField | BytesField | NDArrayField | RGBImageField


def metadata_type(fields: Sequence[Field]) -> np.dtype:
    """One sample's metadata record: each field's record, unnamed, C-aligned (FFCV's layout)."""
    return np.dtype([("", f.metadata) for f in fields], align=True)


def page_size_for(sample_bytes: int | None, small: bool = False) -> int:
    """At least four samples to a page; variable-size samples (``None``) get 8 MiB pages, as
    FFCV's own writer gives them (the shard stage sizes them with ``page_size_for_largest``).
    ``small``: from ``PART_PAGE_SIZE`` (a later version's part of a few new samples, where a
    2 MiB page and the padding to its boundary would outweigh the samples themselves)."""
    page = (PART_PAGE_SIZE if small else MIN_PAGE_SIZE) if sample_bytes else VARIABLE_PAGE_SIZE
    while page < 4 * (sample_bytes or 0):
        page *= 2
    return page


VARIABLE_PAGE_SIZE = 4 * MIN_PAGE_SIZE  # FFCV's default page, 8 MiB: variable-size samples of unknown size


def jpeg_bound(height: int, width: int) -> int:
    """The most bytes a JPEG of a ``height`` x ``width`` RGB image can take: libjpeg-turbo's
    ``tjBufSize`` at 4:4:4, its worst subsampling (blocks padded to 8 px, 6 bytes a pixel, 2 KiB
    of headers; a noisy image at high quality can exceed its raw size)."""
    return (-(-width // 8) * 8) * (-(-height // 8) * 8) * 6 + 2048


def page_size_for_largest(largest: int, exact: bool) -> int:
    """A page for variable-size samples whose largest stores at most ``largest`` bytes: the
    smallest power of two that holds it, at least ``PART_PAGE_SIZE``. FFCV's reader needs only a
    power of two that holds every sample (its writer's 2 MiB minimum is for huge pages; the
    pages are read through the page cache), so 300 small photos no longer pad each split to two
    8 MiB pages. An upper bound (``exact`` false: ``jpeg_bound``, often 20x the real JPEG) is
    capped at FFCV's default 8 MiB, so large photos never get pages larger than before."""
    page = PART_PAGE_SIZE
    while page < largest:
        page *= 2
    return page if exact else min(page, max(VARIABLE_PAGE_SIZE, PART_PAGE_SIZE))


class _Pages:
    """The data region: samples fill fixed-size pages in order (FFCV's ``MemoryAllocator`` with
    one worker)."""

    def __init__(self, fp: BinaryIO, start: int, page_size: int):
        self.fp, self.page_size = fp, page_size
        self.offset = -(-start // page_size) * page_size  # the first page boundary at or after start
        self.page, self.used = -1, 0
        self.buf = np.zeros(page_size, "<u1")
        self.allocations: list[tuple[int, int, int]] = []
        self.sample = 0

    def malloc(self, size: int) -> tuple[int, np.ndarray]:
        if size > self.page_size:
            raise ValueError(f"a sample's field takes {size} bytes, more than a page ({self.page_size})")
        if self.page < 0 or size > self.page_size - self.used:
            self.flush()
            self.page, self.used = self.page + 1, 0
            self.buf.fill(0)
            if self.allocations and self.allocations[-1][0] == self.sample:
                while self.allocations and self.allocations[-1][0] == self.sample:
                    self.allocations.pop()
                raise _Retry
        ptr = self.offset + self.page * self.page_size + self.used
        view = self.buf[self.used:self.used + size]
        self.used += size
        self.allocations.append((self.sample, ptr, size))
        return ptr, view

    def flush(self) -> None:
        if self.page < 0:
            return
        where = self.offset + self.page * self.page_size
        end = self.fp.seek(0, os.SEEK_END)
        if where > end:  # the first page: zeros up to the page boundary after the metadata region
            self.fp.write(bytes(where - end))
        self.fp.seek(where)
        self.fp.write(self.buf.tobytes())


def write_beton(fp: BinaryIO, fields: dict[str, Field], samples: Iterable[Sequence[Any]], count: int,
                page_size: int, checksum: str | None = None) -> np.ndarray | None:
    """Write ``count`` samples (one value per field, in ``fields``' order) to ``fp``, an empty
    file opened for reading and writing. With ``checksum`` (a field name), return the CRC-32 of
    the bytes that field stored for each sample (``storage/sums.py``), taken as they are written."""
    if page_size < PART_PAGE_SIZE or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two of at least {PART_PAGE_SIZE}, not {page_size}")
    kinds = list(fields.values())
    header = np.zeros(1, dtype=HEADER)
    header["version"], header["num_fields"] = VERSION, len(kinds)
    header["page_size"], header["num_samples"] = page_size, count
    descriptors = np.zeros(len(kinds), dtype=FIELD_DESCRIPTOR)
    for d, (name, field) in zip(descriptors, fields.items()):
        encoded = np.frombuffer(name.encode("ascii"), dtype="<u1")[:16]
        d["type_id"], d["name"][:len(encoded)] = field.type_id, encoded
        args = np.frombuffer(field.arguments(), dtype="<u1")
        d["arguments"][:len(args)] = args
    fp.write(header.tobytes() + descriptors.tobytes())
    meta_type = metadata_type(kinds)
    metadata = np.zeros(count, dtype=meta_type)
    meta_start = HEADER.itemsize + descriptors.nbytes
    pages = _Pages(fp, meta_start + metadata.nbytes, page_size)
    columns = [metadata[name] for name in meta_type.names]
    watched = list(fields).index(checksum) if checksum is not None else -1
    sums = np.zeros(count, np.uint32) if checksum is not None else None
    views: list[np.ndarray] = []

    def watch(size: int) -> tuple[int, np.ndarray]:
        ptr, view = pages.malloc(size)
        views.append(view)
        return ptr, view
    written = 0
    for n, values in enumerate(samples):
        if n >= count:
            raise ValueError(f"more samples than the {count} announced")
        pages.sample = n
        for attempt in (0, 1):
            try:
                for k, (column, field, value) in enumerate(zip(columns, kinds, values)):
                    views.clear()
                    field.encode(column[n:n + 1], value, watch if k == watched else pages.malloc)
                    if k == watched and sums is not None:
                        c = 0
                        for v in views:
                            c = zlib.crc32(v, c)
                        sums[n] = c
                break
            except _Retry:
                if attempt:
                    raise ValueError(f"sample {n} does not fit in one {page_size}-byte page") from None
        written += 1
    if written != count:
        raise ValueError(f"{written} samples written, {count} announced")
    pages.flush()
    fp.seek(meta_start)
    fp.write(metadata.tobytes())
    table_at = fp.seek(0, os.SEEK_END)
    fp.write(np.array(pages.allocations, dtype=ALLOCATION).tobytes())
    header["alloc_table_ptr"] = table_at
    fp.seek(0)
    fp.write(header.tobytes())
    return sums


def read_layout(path: str) -> tuple[np.ndarray, list[tuple[str, int]], np.ndarray, np.ndarray]:
    """(header, [(field name, type id)], metadata records, allocation table) of a ``.beton``,
    read without FFCV: what a checker needs to find each sample's stored bytes. Raises
    ValueError when the file's own structure does not hold together."""
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(HEADER.itemsize), HEADER)
        if len(header) != 1 or header["version"][0] != VERSION:
            raise ValueError(f"not a version-{VERSION} .beton header")
        nf, n = int(header["num_fields"][0]), int(header["num_samples"][0])
        descs = np.frombuffer(f.read(nf * FIELD_DESCRIPTOR.itemsize), FIELD_DESCRIPTOR)
        fields = [(bytes(d["name"]).rstrip(b"\0").decode("ascii", "replace"), int(d["type_id"])) for d in descs]
        kinds = {1: IntField.metadata, 2: RGBImageField.metadata, 3: BytesField.metadata, 4: NDArrayField.metadata}
        if len(descs) != nf or any(t not in kinds for _, t in fields):
            raise ValueError("unknown field types in the .beton header")
        meta_type = np.dtype([("", kinds[t]) for _, t in fields], align=True)
        metadata = np.frombuffer(f.read(n * meta_type.itemsize), meta_type)
        f.seek(int(header["alloc_table_ptr"][0]))
        alloc = np.frombuffer(f.read(), ALLOCATION)
    if len(metadata) != n:
        raise ValueError(f"the metadata region is cut short ({len(metadata)} of {n} records)")
    return header[0], fields, metadata, alloc
