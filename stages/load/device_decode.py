"""Decoding a batch of JPEG bytes in one call where the batch is made (``loader.decode: device``).

The backends' workers then only read and check the bytes (``canvas.Encoded``); the loader
decodes each batch here, on its device: nvJPEG through ``torchvision.io.decode_jpeg`` (batched)
where torchvision is installed, DALI's ``mixed`` decoder where DALI is, and on a CPU loader
OpenCV (the same decode as the CPU path, ``decode.py``), which is how the path runs without a
GPU. A batch that fails as a whole is decoded sample by sample to find the bad ones; a sample
that neither the device nor the CPU decoder can read is damage, for the backend's ``Guard``.
"""
from __future__ import annotations

import importlib.util
import io
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from sluice.stages.load.canvas import Encoded
from sluice.stages.load.decode import jpeg_components, opencv

_SAID: set[str] = set()  # what was said once already, this process


def say_once(message: str) -> None:
    """Warn with ``message`` the first time only (a loader is rebuilt every epoch or rank)."""
    if message not in _SAID:
        _SAID.add(message)
        warnings.warn(message, stacklevel=3)


def to_channels(img: np.ndarray, channels: int) -> np.ndarray:
    """HWC uint8 pixels with ``channels`` channels, converted as the shard stage converts
    (gray repeated to RGB; RGB to gray by the 0.299/0.587/0.114 weights; alpha dropped)."""
    if img.ndim == 2:
        img = img[:, :, None]
    if img.shape[2] == 4:
        img = img[:, :, :3]
    if img.shape[2] == channels:
        return img
    if channels == 3 and img.shape[2] == 1:
        return np.repeat(img, 3, axis=2)
    if channels == 1 and img.shape[2] == 3:
        return np.round(img @ np.array([0.299, 0.587, 0.114])).astype(np.uint8)[:, :, None]
    raise ValueError(f"cannot make {img.shape[2]}-channel pixels {channels}-channel")


def decode_cpu(data: np.ndarray | bytes, channels: int) -> np.ndarray:
    """One JPEG's HWC uint8 pixels as the CPU path decodes them (OpenCV for baseline JPEGs,
    else PIL), with ``channels`` channels. Raises whatever the decoder raises."""
    cv2 = opencv()
    buf = np.frombuffer(data, np.uint8) if isinstance(data, (bytes, bytearray)) else data
    if cv2 is not None and jpeg_components(memoryview(buf)) in (1, 3):
        arr = cv2.imdecode(buf, cv2.IMREAD_UNCHANGED | cv2.IMREAD_IGNORE_ORIENTATION)
        if arr is not None and arr.dtype == np.uint8 and (arr.ndim == 2 or arr.shape[2] == 3):
            arr = arr[:, :, None] if arr.ndim == 2 else cv2.cvtColor(arr, cv2.COLOR_BGR2RGB)
            return to_channels(arr, channels)
    from PIL import Image
    with Image.open(io.BytesIO(buf.tobytes())) as im:
        return to_channels(np.asarray(im), channels)


class JpegDecoder:
    """Decodes a batch of JPEGs to HWC uint8 tensors on ``device``, in one call where it can."""
    name = ""

    def __init__(self, device: torch.device, threads: int = 1):
        self.device, self.threads = torch.device(device), max(1, threads)

    def decode(self, samples: list[np.ndarray], channels: int) -> list[torch.Tensor]:
        raise NotImplementedError


class CpuDecoder(JpegDecoder):
    """OpenCV over ``threads`` threads (it releases the GIL): the stand-in on a CPU loader."""
    name = "cpu (OpenCV)"
    _pool = None

    def decode(self, samples, channels):
        one = lambda s: torch.from_numpy(np.ascontiguousarray(decode_cpu(s, channels)))  # noqa: E731
        if self.threads == 1 or len(samples) < 16:
            return [one(s) for s in samples]
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="sluice-decode")
        return list(self._pool.map(one, samples))


class TorchvisionDecoder(JpegDecoder):
    """nvJPEG, batched: ``torchvision.io.decode_jpeg(list, device=cuda)``."""
    name = "nvjpeg (torchvision)"

    def decode(self, samples, channels):
        from torchvision.io import ImageReadMode, decode_jpeg
        mode = ImageReadMode.GRAY if channels == 1 else ImageReadMode.RGB
        out = decode_jpeg([torch.from_numpy(np.ascontiguousarray(s)) for s in samples], mode=mode,
                          device=self.device)
        return [t.permute(1, 2, 0) for t in out]  # CHW -> HWC views


class DaliDecoder(JpegDecoder):
    """DALI's ``mixed`` decoder in a small pipeline fed one batch per run."""
    name = "dali mixed"

    def __init__(self, device, threads=1):
        super().__init__(device, threads)
        self._pipes: dict[tuple[int, int], tuple] = {}  # (max batch, channels) -> (pipe, feed)

    def _pipe(self, n: int, channels: int):
        for (mb, c), entry in self._pipes.items():
            if c == channels and mb >= n:
                return entry
        from nvidia.dali import fn, pipeline_def, types
        feed: list = [None]

        @pipeline_def(batch_size=max(n, 1), num_threads=self.threads, device_id=self.device.index or 0,
                      prefetch_queue_depth=1, exec_async=False, exec_pipelined=False)
        def pipe():
            x = fn.external_source(source=lambda: feed[0], batch=True, dtype=types.UINT8, cycle=None)
            return fn.decoders.image(x, device="mixed", output_type=types.GRAY if channels == 1 else types.RGB)
        p = pipe()
        p.build()
        self._pipes[(n, channels)] = (p, feed)
        return p, feed

    def decode(self, samples, channels):
        from nvidia.dali.plugin.pytorch import feed_ndarray
        p, feed = self._pipe(len(samples), channels)
        feed[0] = [np.ascontiguousarray(s) for s in samples]
        (out,) = p.run()
        stream = torch.cuda.current_stream(self.device)
        res = []
        for k in range(len(samples)):
            t = out[k]
            x = torch.empty(tuple(t.shape()), dtype=torch.uint8, device=self.device)
            feed_ndarray(t, x, cuda_stream=stream)
            res.append(x)
        return res


def available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


# The device decoders in order of preference: (name, importable?, class).
DEVICE_DECODERS: list[tuple[str, Callable[[], bool], type[JpegDecoder]]] = [
    ("torchvision", lambda: available("torchvision"), TorchvisionDecoder),
    ("nvidia-dali", lambda: available("nvidia.dali"), DaliDecoder),
]


@dataclass
class DecodeChoice:
    """Where a loader decodes (``cpu``: the backend's workers; ``device``: here, with ``decoder``)."""
    mode: str
    decoder: JpegDecoder | None
    reason: str


def choose_decode(setting: str, device: torch.device, encoding: str, threads: int = 1) -> DecodeChoice:
    """``loader.decode`` resolved for a loader making batches on ``device`` from images stored as
    ``encoding``. ``auto``: the device decoder when ``device`` is CUDA, the images are JPEG and a
    device decoder is importable; else the CPU. ``device``: that decoder, OpenCV on a CPU loader;
    where nothing can decode on the GPU it says so once and decodes on the CPU."""
    device = torch.device(device)
    if setting == "cpu":
        return DecodeChoice("cpu", None, "decode: cpu, as configured")
    if encoding not in ("jpg", "jpeg"):
        why = f"decode: cpu (the images are stored as {encoding}; only JPEG is decoded on the device)"
        if setting == "device":
            say_once(f"loader.decode=device: {why}")
        return DecodeChoice("cpu", None, why)
    if device.type != "cuda":
        if setting == "auto":
            return DecodeChoice("cpu", None, "decode: auto → cpu (the loader's device is the CPU)")
        return DecodeChoice("device", CpuDecoder(device, threads),
                            "decode: device on a CPU loader: batched in the loader with OpenCV")
    for name, importable, cls in DEVICE_DECODERS:
        if importable():
            return DecodeChoice("device", cls(device, threads), f"decode: {setting} → {cls.name} on {device}")
    why = "no device JPEG decoder is installed (torchvision or nvidia-dali): decoding on the CPU"
    if setting == "device":
        say_once(f"loader.decode=device: {why}")
    return DecodeChoice("cpu", None, f"decode: {setting} → cpu ({why})")


def decode_encoded(decoder: JpegDecoder, batch: Encoded, channels: int
                   ) -> tuple[list[torch.Tensor], list[int], list[tuple[int, str]]]:
    """A batch's images (HWC uint8 on the decoder's device), the positions they came from, and
    (position, reason) of each sample that cannot be decoded. One batched call; where it fails,
    one call per sample, then the CPU decoder, so only samples no decoder reads are lost."""
    samples = batch.samples()
    try:
        return decoder.decode(samples, channels), list(range(len(samples))), []
    except Exception:  # noqa: BLE001 - some sample of the batch: find which, below
        pass
    imgs, keep, bad = [], [], []
    for k, s in enumerate(samples):
        try:
            img = decoder.decode([s], channels)[0]
        except Exception:  # noqa: BLE001 - the device decoder refuses it: does the CPU path read it?
            try:
                img = torch.from_numpy(np.ascontiguousarray(decode_cpu(s, channels))).to(decoder.device)
            except Exception as e:  # noqa: BLE001 - bytes no decoder reads are damage, named
                bad.append((k, f"cannot decode its jpg bytes ({type(e).__name__}: {e})"))
                continue
        imgs.append(img)
        keep.append(k)
    return imgs, keep, bad


def decode_batch(decoder: JpegDecoder, batch: Encoded, labels, idx, guard, where: Callable[[int], str],
                 channels: int, empty: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor | None, object, object]:
    """An encoded batch as (uint8 NHWC images on the decoder's device, per-sample sizes or None
    where they share one, labels, indices). Undecodable samples go to ``guard`` (``fail`` raises
    here, before the batch is yielded; ``skip`` drops them), named by ``where(index)``, their file."""
    from sluice.stages.load.integrity import Damage
    imgs, keep, bad = decode_encoded(decoder, batch, channels)
    if bad:
        ind = np.asarray(idx).reshape(-1)
        guard.take([Damage(int(ind[k]), where(int(ind[k])), reason) for k, reason in bad])
        labels, idx = np.asarray(labels)[keep], ind[keep]
    if not imgs:
        return torch.empty((0, *empty), dtype=torch.uint8, device=decoder.device), None, labels, idx
    if all(im.shape == imgs[0].shape for im in imgs):
        return torch.stack(imgs), None, labels, idx
    from sluice.stages.load.canvas import canvas
    c = canvas(imgs)
    return c.pixels, torch.from_numpy(c.sizes), labels, idx
