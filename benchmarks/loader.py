"""Loader throughput: our Loader on every backend beside the raw libraries, on two artifacts.

Datasets (both sharded by our own stage; every row reads the same samples):
  * ``fmnist``: Fashion-MNIST train, raw uint8 28×28×1 (``.npy`` members / FFCV ndarray),
    random resized crop to 28, flip, normalise.
  * ``crops``: ≥ 20,000 64×64 JPEG crops of scikit-learn's sample photos (``benchmarks.photo_crops``,
    4 classes), random resized crop to 64, flip, normalise. The tar shards hold the original JPEG
    bytes; FFCV's ``.beton`` holds FFCV's own re-encoding (quality 90).

Rows (same batch size 256 and worker count 2 everywhere; each yields float32 NCHW normalised
images plus int64 labels to the caller; RRC scale (0.35, 1), ratio (3/4, 4/3), flip p=0.5):
  * ``sluice <backend>``: ``sluice.stages.load.loader.Loader`` with ``AugmentSpec`` RRC+flip+normalise.
  * ``raw numpy+torch``: a reference, not a library: the split decoded into one uint8 array,
    fancy-indexed per batch, then ``TorchAugment`` — what ``sluice memory`` does, without us.
  * ``raw ffcv``: ``ffcv.loader.Loader`` over the artifact's ``.beton``, ``OrderOption.RANDOM``;
    JPEG: ``RandomResizedCropRGBImageDecoder`` + ``RandomHorizontalFlip`` + ``ToTensor`` +
    ``ToTorchImage``; ndarray (FMNIST): ``NDArrayDecoder`` + ``ToTensor`` then the same batched
    torch RRC+flip as ours (FFCV has no RRC for ndarrays); then float/normalise in torch.
  * ``raw dali``: ``fn.readers.webdataset`` over the artifact's tars + DALI index files
    (random shuffle), ``fn.decoders.image`` (CPU) or ``fn.decoders.numpy``,
    ``fn.random_resized_crop``, ``fn.flip``, ``fn.crop_mirror_normalize`` (float CHW), CPU only
    (``device_id=None``), ``DALIGenericIterator`` (partial last batch). Labels: the ``idx``
    member (int64) looked up in ``labels.npy``.
  * ``raw webdataset``: ``WebDataset(tars, shardshuffle=...)`` + ``shuffle(1000)`` + decode (PIL /
    npy) + per-sample PIL crop-resize + flip + ``batched(256)`` in a ``WebLoader`` (a torch
    ``DataLoader``) with persistent workers; float/normalise in the main process.
  * ``pil DataLoader``: crops: a map-style ``Dataset`` over the image-folder files, PIL decode +
    crop-resize + flip per sample; FMNIST: torchvision-style, the uint8 array in memory and
    ``Image.fromarray`` per sample. ``DataLoader(shuffle=True, persistent_workers=True)``; float/
    normalise in the main process.

Torch intra-op threads: ``--torch-threads`` (default 1; the two decode workers already hold the
two cores), set again before every row and epoch, because FFCV's ``Compiler.set_num_threads``
(called by FFCV's ``Loader`` and by our ffcv backend every epoch) sets torch's thread count
process-wide, after which torch ops on the calling thread ran 5-40× slower here.

Each row is built and run for ``--warmup`` untimed epochs (FFCV compiles with numba then), then
``--epochs`` timed epochs, interleaved across rows, in this one process; samples/s counts the
samples actually delivered. Goals, per dataset: each ``sluice`` backend ≥ 0.9× its raw library;
best ``sluice`` ≥ 5× the PIL baseline (JPEG set); stretch: best ``sluice`` > best raw library.

    python -m benchmarks.loader [--quick]
"""
from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import time
import traceback
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from benchmarks.common import paired_overhead, table, write_result
from benchmarks.photo_crops import CACHE, folder_files, make_photo_crops

BATCH = 256
WORKERS = 2
SCALE = (0.35, 1.0)
RATIO = (3 / 4, 4 / 3)
DATASETS = {
    "fmnist": {"size": 28, "mean": [0.2860], "std": [0.3530], "encoding": "npy"},
    "crops": {"size": 64, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "encoding": "jpg"},
}
OURS_RAW = {"sluice memory": "raw numpy+torch", "sluice ffcv": "raw ffcv", "sluice dali": "raw dali",
            "sluice webdataset": "raw webdataset"}
RAW_LIBS = ("raw ffcv", "raw dali", "raw webdataset")
CHECKS_OFF = " (checks off)"  # the libraries (numpy+torch is a reference)


# ---------------------------------------------------------------------------- data

def make_artifacts(fmnist_limit: int | None, crops: int) -> dict[str, dict]:
    from sluice.stages.data.config import IngestConfig
    from sluice.stages.data.shard import ShardConfig, shard_dataset
    no_split = dict(holdout_fraction=0.0, val_fraction=0.0, test_fraction=0.0)
    out = {}
    t = time.perf_counter()
    s = shard_dataset(IngestConfig(source="fashion-mnist", limit=fmnist_limit, **no_split),
                      CACHE / "artifacts" / "fmnist", ShardConfig(encoding="npy", shard_samples=5000, progress=False))
    out["fmnist"] = {"root": s.root, "folder": None, "prep_s": time.perf_counter() - t, "reused": s.reused}
    t = time.perf_counter()
    folder = make_photo_crops(crops)
    s = shard_dataset(IngestConfig(source=str(folder), kind="folder", **no_split), CACHE / "artifacts" / "crops",
                      ShardConfig(encoding="jpg", jpeg_quality=90, shard_samples=5000, progress=False))
    out["crops"] = {"root": s.root, "folder": folder, "prep_s": time.perf_counter() - t, "reused": s.reused}
    return out


def spec_for(ds: str):
    from sluice.stages.load.augment import AugmentSpec, Flip, Normalize, RandomResizedCrop
    d = DATASETS[ds]
    return AugmentSpec(ops=[RandomResizedCrop(size=d["size"], scale=SCALE, ratio=RATIO), Flip(),
                            Normalize(mean=d["mean"], std=d["std"])])


def to_float(x: torch.Tensor, mean: list[float], std: list[float]) -> torch.Tensor:
    """uint8 NHWC -> normalised float32 contiguous NCHW (what our loader hands the caller)."""
    x = x.permute(0, 3, 1, 2).contiguous().float()
    c = x.shape[1]
    m = torch.tensor(mean * (c // len(mean)), dtype=torch.float32).view(1, c, 1, 1) * 255.0
    s = torch.tensor(std * (c // len(std)), dtype=torch.float32).view(1, c, 1, 1) * 255.0
    return x.sub_(m).div_(s)


def sample_box(w: int, h: int, rnd: random.Random) -> tuple[int, int, int, int]:
    """torchvision-style RRC box (left, top, right, bottom): ten tries, then the whole image."""
    area = w * h
    for _ in range(10):
        a = area * rnd.uniform(*SCALE)
        r = math.exp(rnd.uniform(math.log(RATIO[0]), math.log(RATIO[1])))
        cw, ch = round(math.sqrt(a * r)), round(math.sqrt(a / r))
        if 0 < cw <= w and 0 < ch <= h:
            top, left = rnd.randint(0, h - ch), rnd.randint(0, w - cw)
            return left, top, left + cw, top + ch
    return 0, 0, w, h


def pil_rrc_flip(im, size: int, rnd: random.Random) -> np.ndarray:
    """Per-sample RRC (one PIL resize with a source box) + flip -> uint8 HWC."""
    from PIL import Image
    im = im.resize((size, size), Image.BILINEAR, box=sample_box(*im.size, rnd))
    if rnd.random() < 0.5:
        im = im.transpose(Image.FLIP_LEFT_RIGHT)
    a = np.asarray(im)
    return a[:, :, None] if a.ndim == 2 else a


def _worker_rng() -> random.Random:
    # Python's module RNG is reseeded per DataLoader worker by torch; numpy's global RNG is not.
    return random._inst  # noqa: SLF001


# ---------------------------------------------------------------------------- rows
# A row's builder returns (run_epoch(epoch) -> samples delivered, close(), extra info).

EpochFn = Callable[[int], int]


def build_sluice(backend: str, art: dict, ds: str, checks: bool = True):
    from sluice.stages.load import Loader
    loader = Loader(art["root"], split="train", batch_size=BATCH, backend=backend, workers=WORKERS,
                    augment=spec_for(ds), verify="size", check_samples=checks)

    def run(epoch: int) -> int:
        loader.set_epoch(epoch)
        n = 0
        want = (3 if DATASETS[ds]["encoding"] == "jpg" else 1, DATASETS[ds]["size"], DATASETS[ds]["size"])
        for x, y, _ in loader:
            if x.dtype != torch.float32 or tuple(x.shape[1:]) != want:  # a wrong batch is no result
                raise AssertionError(f"{backend} backend yielded {x.dtype} {tuple(x.shape)}, expected float32 (N, *{want})")
            n += len(y)
        return n

    def close():
        be = loader._backend
        if be is not None and hasattr(be, "close"):
            be.close()
    return run, close, {"loader": loader, "resolved": loader.backend_name}


def build_numpy(art: dict, ds: str):
    from sluice.stages.load.augment import TorchAugment
    from sluice.stages.load.backends.memory import decode_split
    from sluice.storage.artifact import open_artifact
    a = open_artifact(art["root"])
    images = decode_split(a, "train", a.manifest.fields.image.shape, WORKERS)
    labels = a.labels("train")
    aug = TorchAugment(spec_for(ds), seed=0)

    def run(epoch: int) -> int:
        order = np.random.default_rng(epoch).permutation(len(labels))
        n = 0
        for lo in range(0, len(order), BATCH):
            idx = order[lo:lo + BATCH]
            x = aug(torch.from_numpy(images[idx]))
            y = torch.from_numpy(labels[idx])
            n += len(y)
        return n
    return run, lambda: None, {}


def build_raw_ffcv(art: dict, ds: str):
    import contextlib
    import io
    from ffcv.fields.basics import IntDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import Squeeze, ToTensor
    from sluice.stages.load.augment import TorchAugment
    from sluice.storage.artifact import open_artifact
    a = open_artifact(art["root"])
    path = str(a.local(a.manifest.split("train").ffcv))
    d = DATASETS[ds]
    label = [IntDecoder(), ToTensor(), Squeeze()]
    if a.manifest.fields.image.ffcv_field == "ndarray":
        from ffcv.fields.ndarray import NDArrayDecoder
        image = [NDArrayDecoder(), ToTensor()]
        aug = TorchAugment(spec_for(ds), seed=0)
        finish = aug  # uint8 NHWC -> RRC + flip + normalise, batched in torch (as ours)
    else:
        from ffcv.fields.rgb_image import RandomResizedCropRGBImageDecoder
        from ffcv.transforms import RandomHorizontalFlip, ToTorchImage
        image = [RandomResizedCropRGBImageDecoder((d["size"], d["size"]), scale=SCALE, ratio=RATIO),
                 RandomHorizontalFlip(), ToTensor(), ToTorchImage()]

        def finish(x):  # ToTorchImage gives an NCHW view of NHWC memory
            return to_float(x.permute(0, 2, 3, 1), d["mean"], d["std"])
    with contextlib.redirect_stderr(io.StringIO()):
        loader = Loader(path, batch_size=BATCH, num_workers=WORKERS, order=OrderOption.RANDOM, drop_last=False,
                        pipelines={"image": image, "label": label, "index": None, "key": None}, seed=0)

    threads = torch.get_num_threads()

    def run(epoch: int) -> int:
        n = 0
        it = iter(loader)
        # FFCV's Loader.__iter__ sets torch's thread count to num_workers process-wide
        # (Compiler.set_num_threads); torch ops on this thread then crawl on 2 busy cores.
        torch.set_num_threads(threads)
        for x, y in it:
            x = finish(x)
            n += len(y)
        return n
    return run, lambda: None, {}


def build_raw_dali(art: dict, ds: str):
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy
    from sluice.storage.artifact import open_artifact
    a = open_artifact(art["root"])
    rec = a.manifest.split("train")
    tars = [str(a.local(sh.tar)) for sh in rec.shards]
    idxs = [str(a.local(sh.dali_index)) for sh in rec.shards]
    labels = torch.from_numpy(a.labels("train").astype(np.int64))
    d = DATASETS[ds]
    enc = d["encoding"]
    c = 3 if enc == "jpg" else 1
    mean = [m * 255 for m in d["mean"]] * (c // len(d["mean"]))
    std = [s * 255 for s in d["std"]] * (c // len(d["std"]))

    @pipeline_def(batch_size=BATCH, num_threads=WORKERS, device_id=None, seed=0, prefetch_queue_depth=2)
    def pipe():
        raw, idx = fn.readers.webdataset(paths=tars, index_paths=idxs, ext=[enc, "idx"],
                                         dtypes=[types.UINT8, types.INT64], random_shuffle=True,
                                         initial_fill=1024, pad_last_batch=False, name="reader")
        if enc == "jpg":
            x = fn.decoders.image(raw, device="cpu", output_type=types.RGB)
        else:
            x = fn.reshape(fn.decoders.numpy(raw), layout="HWC")
        x = fn.random_resized_crop(x, size=[d["size"], d["size"]], random_area=list(SCALE),
                                   random_aspect_ratio=list(RATIO))
        x = fn.flip(x, horizontal=fn.random.coin_flip(probability=0.5))
        x = fn.crop_mirror_normalize(x, dtype=types.FLOAT, output_layout="CHW", mean=mean, std=std)
        return x, idx

    p = pipe()
    it = DALIGenericIterator([p], ["x", "idx"], reader_name="reader", last_batch_policy=LastBatchPolicy.PARTIAL,
                             auto_reset=True)

    def run(epoch: int) -> int:
        n = 0
        for out in it:
            x, idx = out[0]["x"], out[0]["idx"]
            y = labels[idx.view(-1)]
            n += len(y)
        return n
    return run, lambda: None, {}


class _WdsAug:
    """webdataset map: (decoded image, label) -> (uint8 HWC after RRC + flip, label)."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, sample):
        from PIL import Image
        img, label = sample
        if isinstance(img, np.ndarray):  # npy member
            img = Image.fromarray(img[:, :, 0] if img.shape[2] == 1 else img)
        return pil_rrc_flip(img, self.size, _worker_rng()), label


def build_raw_webdataset(art: dict, ds: str):
    import webdataset as wds
    from sluice.storage.artifact import open_artifact
    a = open_artifact(art["root"])
    urls = [str(a.local(sh.tar)) for sh in a.manifest.split("train").shards]
    d = DATASETS[ds]
    enc = d["encoding"]
    dataset = (wds.WebDataset(urls, shardshuffle=len(urls), seed=0, empty_check=False)
               .shuffle(1000).decode("pil").to_tuple(enc, "cls").map(_WdsAug(d["size"]))
               .batched(BATCH, partial=True))
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=WORKERS, persistent_workers=True,
                           prefetch_factor=4)

    def run(epoch: int) -> int:
        n = 0
        for imgs, labels in loader:
            x = to_float(torch.as_tensor(imgs), d["mean"], d["std"])
            y = torch.as_tensor(labels, dtype=torch.int64)
            n += len(y)
        return n
    return run, lambda: None, {}


class _FolderPIL(torch.utils.data.Dataset):
    def __init__(self, paths, labels, size):
        self.paths, self.labels, self.size = paths, labels, size

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        from PIL import Image
        with Image.open(self.paths[i]) as im:
            arr = pil_rrc_flip(im.convert("RGB"), self.size, _worker_rng())
        return torch.from_numpy(arr.copy()), int(self.labels[i])


class _ArrayPIL(torch.utils.data.Dataset):
    """torchvision's FashionMNIST idiom: uint8 array in memory, a PIL image per sample."""

    def __init__(self, images, labels, size):
        self.images, self.labels, self.size = images, labels, size

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        from PIL import Image
        arr = pil_rrc_flip(Image.fromarray(self.images[i], mode="L"), self.size, _worker_rng())
        return torch.from_numpy(arr.copy()), int(self.labels[i])


def build_pil(art: dict, ds: str):
    d = DATASETS[ds]
    if art["folder"] is not None:
        paths, labels = folder_files(Path(art["folder"]))
        dataset = _FolderPIL(paths, labels, d["size"])
    else:
        from sluice.stages.load.backends.memory import decode_split
        from sluice.storage.artifact import open_artifact
        a = open_artifact(art["root"])
        images = decode_split(a, "train", a.manifest.fields.image.shape, WORKERS)[:, :, :, 0]
        dataset = _ArrayPIL(images, a.labels("train"), d["size"])
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=WORKERS,
                                         persistent_workers=True, prefetch_factor=4)

    def run(epoch: int) -> int:
        n = 0
        for imgs, labels in loader:
            x = to_float(imgs, d["mean"], d["std"])
            n += len(labels)
        return n
    return run, lambda: None, {}


def row_builders(ds: str, backends: list[str], only: list[str] | None = None,
                 checks: bool = False, off_first: bool = False) -> dict[str, Callable]:
    if checks:  # per-sample checksum checks on (the default) and off, per backend, side by side
        pair = (("", True), (CHECKS_OFF, False))
        return {f"sluice {b}{suffix}": (lambda art, ds, b=b, on=on: build_sluice(b, art, ds, on))
                for b in backends for suffix, on in (pair[::-1] if off_first else pair)}
    pil_name = "pil DataLoader (image folder)" if ds == "crops" else "pil DataLoader (uint8 in RAM, torchvision-style)"
    rows: dict[str, Callable] = {}
    for b in backends:
        rows[f"sluice {b}"] = (lambda art, ds, b=b: build_sluice(b, art, ds))
    rows["raw numpy+torch"] = build_numpy
    rows["raw ffcv"] = build_raw_ffcv
    rows["raw dali"] = build_raw_dali
    rows["raw webdataset"] = build_raw_webdataset
    rows[pil_name] = build_pil
    if only:
        rows = {k: v for k, v in rows.items() if any(o in k for o in only)}
    return rows


# ---------------------------------------------------------------------------- run

def bench_dataset(ds: str, art: dict, backends: list[str], warmup: int, epochs: int, log,
                  only: list[str] | None = None, torch_threads: int = 1, checks: bool = False,
                  off_first: bool = False) -> list[dict]:
    def fresh():
        # FFCV's Compiler.set_num_threads(n) also calls torch.set_num_threads(n), process-wide
        # (ffcv/pipeline/compiler.py): every row starts from the same torch thread count.
        torch.set_num_threads(torch_threads)

    rows: dict[str, dict] = {}
    live: dict[str, tuple] = {}
    for name, build in row_builders(ds, backends, only, checks, off_first).items():
        row = rows[name] = {"dataset": ds, "name": name}
        t = time.perf_counter()
        try:
            fresh()
            run, close, info = build(art, ds)
            row["setup_s"] = time.perf_counter() - t
            t = time.perf_counter()
            for e in range(warmup):
                fresh()
                run(e)
            row["warmup_s"] = time.perf_counter() - t
            live[name] = (run, close, info)
            log(f"  [{ds}] {name}: setup {row['setup_s']:.1f} s, warm-up {row['warmup_s']:.1f} s")
        except Exception as e:  # noqa: BLE001 - a broken row is reported, the rest still run
            row["skipped"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            row["traceback"] = traceback.format_exc(limit=6)
            log(f"  [{ds}] {name}: SKIPPED ({row['skipped']})")
    times: dict[str, list[float]] = {k: [] for k in live}
    counts: dict[str, list[int]] = {k: [] for k in live}
    for r in range(epochs):  # interleaved: drift on a shared machine hits every row alike, and the
        # order reverses every other round, so no row always runs right after the same neighbour
        for name, (run, _, _) in (list(live.items()) if r % 2 == 0 else list(live.items())[::-1]):
            if "skipped" in rows[name]:
                continue
            fresh()
            t = time.perf_counter()
            try:
                n = run(warmup + r)
            except Exception as e:  # noqa: BLE001
                rows[name]["skipped"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                continue
            times[name].append(time.perf_counter() - t)
            counts[name].append(n)
    for name, (run, close, info) in live.items():
        row = rows[name]
        if times[name]:
            rates = [n / s for n, s in zip(counts[name], times[name])]
            row.update(samples=counts[name][0], epoch_s=statistics.median(times[name]),
                       samples_per_s=statistics.median(rates), epoch_s_all=[round(t, 4) for t in times[name]])
        if "loader" in info:
            row["resolved_backend"] = info["resolved"]
            row["profile"] = info["loader"].profile()
            row["profile_report"] = info["loader"].profile_report()
        try:
            close()
        except Exception:  # noqa: BLE001
            pass
    live.clear()
    out = list(rows.values())
    pil = next((r for r in out if "pil" in r["name"] and r.get("samples_per_s")), None)
    for r in out:
        sps = r.get("samples_per_s")
        if not sps:
            continue
        r["x_pil"] = sps / pil["samples_per_s"] if pil else None
        raw = next((x for x in out if x["name"] == OURS_RAW.get(r["name"]) and x.get("samples_per_s")), None)
        r["x_raw"] = sps / raw["samples_per_s"] if raw else None
    return out


def check_costs(rows: list[dict]) -> dict:
    """Per dataset and backend: samples/s with the per-sample checks on and off (medians of the
    interleaved epochs) and the checks' overhead, 1 - on/off (goal: <= 5%)."""
    out: dict = {}
    for r in rows:
        if r["name"].endswith(CHECKS_OFF) or not r.get("samples_per_s"):
            continue
        off = next((x for x in rows if x["dataset"] == r["dataset"] and x["name"] == r["name"] + CHECKS_OFF
                    and x.get("samples_per_s")), None)
        if off is None:
            continue
        over = 1 - r["samples_per_s"] / off["samples_per_s"]
        out.setdefault(r["dataset"], {})[r["name"].removeprefix("sluice ")] = {
            "on": r["samples_per_s"], "off": off["samples_per_s"], "overhead": over, "met": over <= 0.05,
            "overhead_paired": paired_overhead(r["epoch_s_all"], off["epoch_s_all"])}
    return out


def goals(rows: list[dict], ds: str) -> dict:
    rs = [r for r in rows if r["dataset"] == ds and r.get("samples_per_s")]
    by = {r["name"]: r for r in rs}
    ours = [r for r in rs if r["name"].startswith("sluice")]
    raws = [r for r in rs if r["name"] in RAW_LIBS]
    pil = next((r for r in rs if "pil" in r["name"]), None)
    g: dict = {"ours_vs_raw": {}}
    for o, raw in OURS_RAW.items():
        if o in by and raw in by:
            ratio = by[o]["samples_per_s"] / by[raw]["samples_per_s"]
            g["ours_vs_raw"][o] = {"raw": raw, "ratio": ratio, "goal": 0.9, "met": ratio >= 0.9}
        elif o in {r["name"] for r in rows if r["dataset"] == ds}:
            g["ours_vs_raw"][o] = {"raw": raw, "ratio": None, "goal": 0.9, "met": False,
                                   "note": "a row was skipped"}
    if ours:
        best = max(ours, key=lambda r: r["samples_per_s"])
        g["best_ours"] = best["name"]
        if pil:
            ratio = best["samples_per_s"] / pil["samples_per_s"]
            g["best_ours_vs_pil"] = {"ratio": ratio, "goal": 5.0, "met": ratio >= 5.0,
                                     "applies": ds == "crops"}
        if raws:
            braw = max(raws, key=lambda r: r["samples_per_s"])
            ratio = best["samples_per_s"] / braw["samples_per_s"]
            g["stretch_best_ours_vs_best_raw"] = {"best_raw": braw["name"], "ratio": ratio, "goal": 1.0,
                                                  "met": ratio > 1.0}
    return g


def pool_passes(passes: list[list[dict]]) -> list[dict]:
    """One row per arm from several passes of the same rows: medians over every timed epoch."""
    out = []
    for first in passes[0]:
        rows = [next(r for r in p if r["name"] == first["name"]) for p in passes]
        row = dict(first)
        timed = [r for r in rows if r.get("epoch_s_all")]
        if timed:
            epochs = [t for r in timed for t in r["epoch_s_all"]]
            row.update(epoch_s_all=epochs, epoch_s=statistics.median(epochs),
                       samples_per_s=statistics.median([r["samples"] / t for r in timed for t in r["epoch_s_all"]]),
                       passes=len(rows))
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="FMNIST limited to 20k, 1 warm-up + 1 timed epoch (~3 min)")
    ap.add_argument("--epochs", type=int, default=None, help="timed epochs per row (default 3; quick 1)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed epochs per row first (FFCV compiles here)")
    ap.add_argument("--fmnist-limit", type=int, default=None, help="default: all 60,000 (quick: 20,000)")
    ap.add_argument("--crops", type=int, default=20_000, help="number of 64×64 JPEG photo crops (>= 20,000)")
    ap.add_argument("--datasets", default="fmnist,crops")
    ap.add_argument("--backends", default="memory,ffcv,dali,webdataset", help="our backends to run")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads in this process (default 1: the decode workers hold the cores)")
    ap.add_argument("--only", default="", help="comma list of substrings: run only rows whose name has one")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--checks", action="store_true", help="only our backends, per-sample checks on and off "
                    "(interleaved; writes loader_checks.json)")
    args = ap.parse_args(argv)
    from benchmarks.hostinfo import describe_run
    about = describe_run("benchmarks.loader", argv)  # command, commit, host, load average at the start
    epochs = args.epochs or (1 if args.quick else 3)
    limit = args.fmnist_limit or (20_000 if args.quick else None)
    log = (lambda *_: None) if args.quiet else (lambda m: print(m, flush=True))
    warnings.filterwarnings("ignore", message=".*shardshuffle.*")
    torch.set_num_threads(args.torch_threads)
    t0 = time.perf_counter()
    arts = make_artifacts(limit, args.crops)
    for ds, a in arts.items():
        log(f"{ds}: {a['root']} ({'reused' if a['reused'] else 'written'} in {a['prep_s']:.1f} s)")
    import ffcv.loader  # noqa: F401 - imports cost seconds once per process; keep them out of every row
    import nvidia.dali  # noqa: F401
    import webdataset  # noqa: F401
    backends = [b for b in args.backends.split(",") if b]
    rows: list[dict] = []
    for ds in [d for d in args.datasets.split(",") if d]:
        only = [o for o in args.only.split(",") if o] or None
        if args.checks:  # two passes, the on-arm built first and then the off-arm: build order is not a factor
            rows += pool_passes([bench_dataset(ds, arts[ds], backends, args.warmup, epochs, log, only,
                                               args.torch_threads, True, off_first)
                                 for off_first in (False, True)])
        else:
            rows += bench_dataset(ds, arts[ds], backends, args.warmup, epochs, log, only, args.torch_threads)
    cols = ["dataset", "name", "samples", "epoch_s", "samples_per_s", "x_pil", "x_raw", "warmup_s"]
    print()
    print(table(rows, cols))
    skipped = [r for r in rows if "skipped" in r]
    for r in skipped:
        print(f"skipped [{r['dataset']}] {r['name']}: {r['skipped']}")
    if args.checks:
        costs = check_costs(rows)
        for ds, per in costs.items():
            for b, v in per.items():
                print(f"[{ds}] {b}: checks on {v['on']:.0f}/s, off {v['off']:.0f}/s, overhead "
                      f"{100 * v['overhead']:.1f}% (goal <= 5%) -> {'MET' if v['met'] else 'NOT MET'}")
        result = {**about, "mode": "quick" if args.quick else "full", "batch_size": BATCH, "workers": WORKERS,
                  "load_avg_1m": os.getloadavg()[0], "warmup_epochs": args.warmup, "timed_epochs": epochs,
                  "fmnist_limit": limit, "crops": args.crops, "checks": costs, "total_s": time.perf_counter() - t0,
                  "rows": [{k: v for k, v in r.items() if k not in ("traceback", "profile_report")} for r in rows]}
        print(f"\nwrote {write_result('loader_checks', result)} in {time.perf_counter() - t0:.0f} s")
        return result
    result_goals = {ds: goals(rows, ds) for ds in dict.fromkeys(r["dataset"] for r in rows)}
    print()
    for ds, g in result_goals.items():
        for o, v in g["ours_vs_raw"].items():
            ratio = "-" if v["ratio"] is None else f"{v['ratio']:.2f}"
            print(f"[{ds}] {o} vs {v['raw']}: {ratio} (goal >= 0.9) -> {'MET' if v['met'] else 'NOT MET'}")
        if "best_ours_vs_pil" in g:
            v = g["best_ours_vs_pil"]
            print(f"[{ds}] best ours ({g['best_ours']}) vs PIL: {v['ratio']:.1f}x (goal >= 5"
                  f"{'' if v['applies'] else ', informational'}) -> {'MET' if v['met'] else 'NOT MET'}")
        if "stretch_best_ours_vs_best_raw" in g:
            v = g["stretch_best_ours_vs_best_raw"]
            print(f"[{ds}] stretch: best ours vs best raw ({v['best_raw']}): {v['ratio']:.2f} (goal > 1) -> "
                  f"{'MET' if v['met'] else 'NOT MET'}")
    for r in rows:
        if r.get("profile_report") and not args.quiet:
            print(f"\n[{r['dataset']}] {r['name']} " + r["profile_report"])
    result = {"mode": "quick" if args.quick else "full", "batch_size": BATCH, "workers": WORKERS,
              "torch_threads": args.torch_threads, "load_avg_1m": os.getloadavg()[0],
              "warmup_epochs": args.warmup, "timed_epochs": epochs, "fmnist_limit": limit, "crops": args.crops,
              "augment": {"rrc_scale": SCALE, "rrc_ratio": RATIO, "flip_p": 0.5, "sizes": {k: v["size"] for k, v in DATASETS.items()}},
              "artifacts": {k: str(v["root"]) for k, v in arts.items()},
              "rows": [{k: v for k, v in r.items() if k not in ("traceback", "profile_report")} for r in rows],
              "goals": result_goals, "total_s": time.perf_counter() - t0}
    print(f"\nwrote {write_result('loader', result)} in {time.perf_counter() - t0:.0f} s")
    return result


if __name__ == "__main__":
    main()
