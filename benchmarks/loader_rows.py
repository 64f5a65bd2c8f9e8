"""The rows of ``benchmarks.loader``: its two datasets (Fashion-MNIST and the JPEG photo crops,
sharded by Sluice's own stage) and, per row, a builder that returns ``(run_epoch(epoch) -> samples
delivered, close(), extra info)``: Sluice's ``Loader`` on a backend, the raw numpy+torch reference,
raw FFCV, raw DALI, raw WebDataset and a PIL ``DataLoader``, each making the same batch (random
resized crop, flip, normalise; float32 NCHW). What each row does is in ``benchmarks.loader``'s
docstring; timing them is ``benchmarks.loader``'s.
"""
from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from benchmarks.photo_crops import CACHE, folder_files, make_photo_crops

BATCH = 256
WORKERS = 2
SCALE = (0.35, 1.0)
RATIO = (3 / 4, 4 / 3)
DATASETS = {
    "fmnist": {"size": 28, "mean": [0.2860], "std": [0.3530], "encoding": "npy"},
    "crops": {"size": 64, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "encoding": "jpg"},
}
CHECKS_OFF = " (checks off)"  # a row name's suffix: the same backend with per-sample checks off


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
