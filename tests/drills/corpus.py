"""The drill suite's generated corpus of hostile inputs, the list of drills, and the helpers the
fault drills share (run the CLI under a deadline, find the processes a run left, a small tmpfs).

``DRILLS`` is the one list of cases: every drill test names the case it covers, and the README's
reliability section lists every case (``test_every_drill_is_run_and_documented`` checks both).
"""
from __future__ import annotations

import contextlib
import io
import os
import struct
import subprocess
import sys
import tarfile
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from procwatch import pids_with_env, wait_until  # noqa: F401 - the drills import wait_until from here

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Drill:
    kind: str  # what sort of bad input or fault
    case: str  # what it is
    promise: str  # what Sluice does about it


DRILLS: dict[str, Drill] = {d_id: Drill(*d) for d_id, d in {
    # images (an image folder sharded once; each file's outcome checked)
    "image-corrupt-bytes": ("image", "bytes that are not an image, named .jpg", "quarantined, file named"),
    "image-empty-file": ("image", "a zero-byte .png", "quarantined, file named"),
    "image-truncated-jpeg": ("image", "a JPEG cut at 60%", "quarantined, file named"),
    "image-decompression-bomb": ("image", "a 14000x14000 PNG of ~190 KB", "quarantined before decoding (shard.max_pixels)"),
    "image-16-bit-png": ("image", "a 16-bit grayscale PNG", "scaled to 8 bits (every level kept in order), never saturated"),
    "image-exif-rotated": ("image", "a PNG with EXIF orientation 6", "stored upright, as a viewer shows it"),
    "image-cmyk-jpeg": ("image", "a CMYK JPEG", "converted to RGB"),
    "image-palette-alpha": ("image", "a palette PNG with transparency, an RGBA PNG", "composited onto white, stored as 3-channel RGB"),
    "image-gray-among-rgb": ("image", "one RGB image among grayscale ones (or the reverse)", "every image stored as RGB; none quarantined"),
    "folder-empty-class": ("image", "a class folder without images (empty, or only .heic files)", "refused naming the folder and what it holds; ingest.check_classes=false keeps it"),
    "folder-tiny-class": ("image", "a class of 4 images with val_fraction 0.1", "refused naming the class, its count, the fractions and the settings"),
    "image-png-named-jpg": ("image", "PNG bytes in a .jpg file", "decoded by content and kept"),
    "image-odd-names": ("image", "unicode, spaces and a 1x1 image", "kept with a tar-safe unique key"),
    # labels and members of a WebDataset tar (one tar sharded once)
    "label-not-integer": ("label", "2.5, UTF-16 bytes, a superscript digit", "quarantined, tar member named"),
    "label-out-of-range": ("label", "-1 and 10**23 with 10 classes", "quarantined, tar member named"),
    "label-bom": ("label", "a label file starting with a byte-order mark", "read as the number it holds"),
    "member-missing": ("tar member", "a sample without image, one without label", "quarantined, tar member named"),
    "tar-duplicate-keys": ("tar member", "the same key twice in one tar", "both kept (key-dup1)"),
    "tar-hostile-names": ("tar member", "../../ and absolute member names, a symlink member", "names are keys, never paths: nothing written outside the output"),
    # source files that cannot be read as a whole
    "tar-truncated": ("source file", "a tar cut mid-member", "fails naming the file; ingest.keep_damaged keeps the readable part, recorded in the manifest"),
    "tar-zero-length": ("source file", "a zero-byte shard among good ones", "fails naming the file; keep_damaged keeps the others"),
    "tar-corrupt-header": ("source file", "garbage in a member header", "fails naming the file"),
    "idx-header-overflow": ("source file", "IDX dimensions whose product overflows 64 bits", "fails naming the file"),
    "idx-truncated-gzip": ("source file", "an IDX .gz cut short", "fails naming the file"),
    "npz-pickled": ("source file", "an .npz holding a pickled object array", "refused, never unpickled"),
    # configs
    "config-image-size": ("config", "shard.image_size [0,0] or [-3,28]", "refused before anything runs (exit 2), field named"),
    "config-eval-split": ("config", "promotion.eval_split or report_split naming no split, or an empty one", "refused before any stage runs (exit 2)"),
    # artifacts and loader state
    "manifest-count-raised": ("artifact", "a hand-edited manifest with a split's count raised", "every backend refuses before the first batch, naming the file"),
    "corrupt-pixels": ("artifact", "16 bytes of three samples' pixels overwritten in a tar, or 64 bytes in the .beton (sizes unchanged)", "every backend raises CorruptSample naming the file, key, split index and how to re-shard, before the batch is yielded"),
    "corrupt-header": ("artifact", "4 bytes of an .npy member's header, or a label in a .beton record", "the same clear CorruptSample, never a parser's error; nothing damaged yielded"),
    "corrupt-skip": ("artifact", "the same damage read with loader.on_corrupt: skip", "exactly the damaged samples dropped and counted; fails past max_corrupt_fraction"),
    "corrupt-verify": ("artifact", "sluice verify [--full] on a damaged artifact", "exit 1 naming each damaged file and sample"),
    "corrupt-no-sums": ("artifact", "an artifact written before per-sample checksums", "readable, with a warning; headers never parsed; sluice verify --full finds damage"),
    "loader-state-negative": ("loader state", "next_batch=-5 or past the epoch", "refused (LoaderError)"),
    "registry-read-only": ("registry", "sluice models list on a fresh directory", "reads only; creates nothing"),
    # faults
    "fault-disk-full": ("fault", "a full disk (small tmpfs) while writing tar shards or the FFCV file", "exit 2 naming the file, no hang, no manifest, no process left"),
    "fault-kill-9-shard": ("fault", "kill -9 of sluice shard at random points", "no process left writing; the next run resumes to byte-identical files"),
    "fault-two-writers": ("fault", "two sluice shard runs on one output", "the second waits, naming the first; one complete artifact, no temp files"),
    "fault-worker-dies": ("fault", "a shard worker killed mid-task", "exit 2 naming the signal, no hang; the next run completes"),
    "fault-kill-9-train": ("fault", "kill -9 of the process that launched training", "torchrun and its ranks exit; a new launch resumes from the checkpoint"),
    "fault-hung-rank": ("fault", "a training rank that stops responding (SIGSTOP)", "the run fails within train.dist_timeout_s plus torchrun's grace; nothing left"),
}.items()}

CLASSES = ("a", "b")


# ------------------------------------------------------------------ encoders

def encode(arr: np.ndarray | None = None, fmt: str = "PNG", image=None, **kw) -> bytes:
    from PIL import Image
    im = image if image is not None else Image.fromarray(arr)
    buf = io.BytesIO()
    im.save(buf, format=fmt, **kw)
    return buf.getvalue()


def png_bomb(width: int = 14000, height: int = 14000) -> bytes:
    """A real, decodable 8-bit gray PNG of ``width`` x ``height`` zeros: ~190 KB on disk,
    ~196 MB once decoded. Compressed row by row, so making it needs no big buffer."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    z = zlib.compressobj(9)
    row = bytes(width + 1)  # filter byte + pixels
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def rgb(seed: int, h: int = 16, w: int = 16) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def smooth_rgb(h: int = 16, w: int = 16) -> np.ndarray:
    x, y = np.meshgrid(np.linspace(0, 255, w), np.linspace(0, 255, h))
    return np.stack([x, y, np.full((h, w), 128.0)], -1).astype(np.uint8)


# ------------------------------------------------------------------ sources

def image_folder(root: Path) -> dict[str, Path]:
    """Good RGB PNGs in two classes plus one file per image case; returns case -> path (or
    the first of several)."""
    from PIL import Image
    for ci, c in enumerate(CLASSES):
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(12):
            (root / c / f"good{i:02d}.png").write_bytes(encode(rgb(100 * ci + i)))
    a = root / "a"
    files = {
        "image-corrupt-bytes": (a / "corrupt.jpg", b"\xff\xd8\xff\xe0 this is not a jpeg"),
        "image-empty-file": (a / "empty.png", b""),
        "image-truncated-jpeg": (a / "truncated.jpg", encode(rgb(7), "JPEG", quality=95)),
        "image-decompression-bomb": (a / "bomb.png", png_bomb()),
        "image-exif-rotated": (a / "rotated.png", None),
        "image-cmyk-jpeg": (a / "cmyk.jpg", encode(fmt="JPEG", image=Image.fromarray(smooth_rgb()).convert("CMYK"),
                                                  quality=95)),
        "image-palette-alpha": (a / "palette.png", None),
        "image-png-named-jpg": (a / "actually-png.jpg", encode(rgb(9))),
        "image-odd-names": (root / "b" / "ümlaut näme (1).png", encode(rgb(11))),
    }
    trunc = files["image-truncated-jpeg"][1]
    files["image-truncated-jpeg"] = (files["image-truncated-jpeg"][0], trunc[: int(len(trunc) * 0.6)])
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise to display
    files["image-exif-rotated"] = (files["image-exif-rotated"][0], encode(rgb(5, 12, 16), exif=exif))
    pal = Image.fromarray(rgb(6)).convert("P", palette=Image.ADAPTIVE, colors=16)
    pal.info["transparency"] = 0
    files["image-palette-alpha"] = (files["image-palette-alpha"][0], encode(image=pal))
    (a / "rgba.png").write_bytes(encode(np.dstack([rgb(8), np.full((16, 16), 9, np.uint8)])))
    (root / "b" / "tiny.png").write_bytes(encode(rgb(12, 1, 1)))
    for path, data in files.values():
        path.write_bytes(data)
    return {case: path for case, (path, _) in files.items()}


def gray_folder(root: Path) -> dict[str, Path]:
    """Gray PNGs, one of them 16-bit, and one RGB image among them."""
    for c in CLASSES:
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(6):
            (root / c / f"gray{i}.png").write_bytes(encode(np.full((16, 16), 10 * i, np.uint8)))
    files = {"image-16-bit-png": root / "a" / "deep.png", "image-gray-among-rgb": root / "b" / "colour.png"}
    files["image-16-bit-png"].write_bytes(encode(np.arange(256, dtype=np.uint16).reshape(16, 16) * 257))
    files["image-gray-among-rgb"].write_bytes(encode(rgb(3)))
    return files


def tar_of(path: Path, members: list[tuple[str, bytes | None]]) -> Path:
    """A tar written by ``tarfile`` from (name, data) members; data None makes a symlink."""
    with tarfile.open(path, "w") as t:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
                t.addfile(info)
            else:
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    return path


def label_tar(path: Path) -> dict[str, list[str]]:
    """One WebDataset tar: good samples and one or more per label/member case; returns
    case -> the keys (as written) of its samples."""
    gray = lambda v: encode(np.full((8, 8), v, np.uint8))  # noqa: E731
    members: list[tuple[str, bytes | None]] = []
    for i in range(40):
        members += [(f"good{i:02d}.png", gray(i)), (f"good{i:02d}.cls", str(i % 10).encode())]
    cases = {
        "label-not-integer": [("float", b"2.5"), ("utf16", "3".encode("utf-16")), ("superscript", "²".encode())],
        "label-out-of-range": [("neg", b"-1"), ("huge", b"99999999999999999999999")],
        "label-bom": [("bom", "\ufeff4\n".encode())],
    }
    keys: dict[str, list[str]] = {}
    for case, items in cases.items():
        for key, label in items:
            members += [(f"{key}.png", gray(50)), (f"{key}.cls", label)]
            keys.setdefault(case, []).append(key)
    members += [("nolabel.png", gray(60)), ("noimage.cls", b"1")]
    keys["member-missing"] = ["nolabel", "noimage"]
    members += [("twice.png", gray(70)), ("twice.cls", b"7"), ("between.png", gray(71)), ("between.cls", b"1"),
                ("twice.png", gray(72)), ("twice.cls", b"8")]
    keys["tar-duplicate-keys"] = ["twice"]
    members += [("../../escape.png", gray(80)), ("../../escape.cls", b"2"),
                ("/abs/dir/rooted.png", gray(81)), ("/abs/dir/rooted.cls", b"3"), ("link.png", None)]
    keys["tar-hostile-names"] = ["../../escape", "/abs/dir/rooted"]
    tar_of(path, members)
    return keys


def idx_bytes(dims: list[int], payload: bytes = b"", code: int = 0x08) -> bytes:
    return bytes([0, 0, code, len(dims)]) + b"".join(d.to_bytes(4, "big") for d in dims) + payload


# ------------------------------------------------------------------ running things

def run_cli(args: list[str], timeout: float, env: dict[str, str] | None = None,
            cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``python -m sluice.flows.cli ARGS`` under a deadline: a hang fails the drill (and the
    process group is killed) instead of stalling the suite."""
    p = subprocess.Popen([sys.executable, "-m", "sluice.flows.cli", *args], cwd=cwd, env={**os.environ, **(env or {})},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        out, err = p.communicate()
        raise AssertionError(f"sluice {' '.join(args)} hung for more than {timeout:.0f} s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def marker() -> tuple[str, str]:
    """An environment variable that every process of one drill inherits, to find them all."""
    return "SLUICE_DRILL", uuid.uuid4().hex


def pids_with(mark: tuple[str, str]) -> list[int]:
    return pids_with_env(f"{mark[0]}={mark[1]}")


def no_survivors(mark: tuple[str, str], timeout: float = 15.0) -> None:
    """Every process of the drill has exited (killed ones included) within ``timeout``."""
    try:
        wait_until("every process of the run to exit", lambda: not pids_with(mark), timeout)
    except AssertionError:
        left = {p: Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:150] for p in pids_with(mark)}
        for p in left:
            with contextlib.suppress(OSError):
                os.kill(p, 9)
        raise AssertionError(f"processes left running: {left}") from None


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` for the block (root only); always unmounted."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        import pytest
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); the full-disk drill needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def file_digests(root: Path) -> dict[str, str]:
    """sha256 of every file under an artifact (the manifest aside: it records a timestamp)."""
    import hashlib
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "manifest.json"}
