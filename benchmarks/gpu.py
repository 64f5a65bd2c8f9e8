"""The GPU benchmark, on one GPU:

(a) loader throughput into GPU memory on RGB JPEG at 32, 64 and 224 px, with random-resized-crop +
    flip + normalise on the device, per Sluice backend, against a plain ``torch.utils.data.DataLoader``
    (PIL decoding, the same augmentation on the CPU, one worker per core, pinned memory) and against
    the GPU's own ceiling for the same batch (the decoded images already on the GPU: only the
    augmentation runs);
(b) a training step of a ResNet-18 at 64 px in bf16 fed by each loader: the share of the step spent
    waiting for data;
(c) time to 93% on Fashion-MNIST: Sluice's default recipe against the strong plain baseline, both on
    this GPU (``benchmarks/gpu_tta.py``).

    python -m benchmarks.gpu [--quick] [--out FILE] [--backends memory webdataset ffcv dali]

Writes ``benchmarks/results/gpu.json`` (``gpu_quick.json`` with ``--quick``) with the GPU's name, the
driver, torch and CUDA versions. Without CUDA it runs the CPU-side arms only (the PIL DataLoader
and Sluice's backends decoding and augmenting on the CPU), lists every GPU arm under ``skipped``
with the reason, and never writes under ``benchmarks/results/`` (default
``gpu-check-results/gpu-cpu-dry-run.json``): a CPU run is never mistaken for GPU figures.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import RESULTS, table
from benchmarks.hostinfo import ROOT, describe_run

SIZES = (32, 64, 224)
BACKENDS = ("memory", "webdataset", "ffcv", "dali")
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
GOALS = {"best_sluice_vs_pil_224": 3.0, "best_sluice_vs_ceiling_32": 0.8, "data_wait_frac_max": 0.10}


def gpu_info() -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
    if not torch.cuda.is_available():
        return {**info, "gpu": None}
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=torch.cuda.get_device_name(0), capability=f"{p.major}.{p.minor}",
                memory_gib=round(p.total_memory / 2**30, 1), bf16=torch.cuda.is_bf16_supported())
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            info["driver"] = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            info["driver"] = None
    return info


# ------------------------------------------------------------------ data

def write_jpegs(folder: Path, n: int, size: int, classes: int = 10, seed: int = 0) -> None:
    """``n`` photo-like RGB JPEGs (smooth colour fields and detail, quality 90) in class folders."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    for c in range(classes):
        (folder / f"c{c}").mkdir(parents=True, exist_ok=True)
    for k in range(n):
        low = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)).resize((size, size), Image.BICUBIC)
        img = np.asarray(low, np.int16) + rng.integers(-24, 25, (size, size, 3))
        Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(folder / f"c{k % classes}" / f"{k:06d}.jpg", quality=90)


def make_artifact(root: Path, size: int, n: int, workers: int):
    from sluice.stages.data.config import IngestConfig
    from sluice.stages.data.shard import ShardConfig, shard_dataset
    from sluice.storage.artifact import open_artifact
    write_jpegs(root / "src", n, size)
    s = shard_dataset(IngestConfig(source=str(root / "src"), holdout_fraction=0, val_fraction=0, test_fraction=0),
                      root / "art", ShardConfig(encoding="jpg", jpeg_quality=90, shard_samples=1024,
                                                workers=workers, progress=False))
    return open_artifact(s.root)


# ------------------------------------------------------------------ loaders

class PilFolder(torch.utils.data.Dataset):
    """What a plain PyTorch user writes: PIL decode, random-resized-crop, flip and normalise on the
    CPU, per sample (torchvision's sampling; no torchvision import)."""

    def __init__(self, folder: Path, size: int):
        self.files = sorted(folder.glob("*/*.jpg"))
        self.size = size
        self.mean = np.array(MEAN, np.float32).reshape(3, 1, 1)
        self.std = np.array(STD, np.float32).reshape(3, 1, 1)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        import math
        import random
        from PIL import Image
        img = Image.open(self.files[i]).convert("RGB")
        w, h = img.size
        for _ in range(10):
            area = random.uniform(0.35, 1.0) * w * h
            r = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
            cw, ch = round(math.sqrt(area * r)), round(math.sqrt(area / r))
            if 0 < cw <= w and 0 < ch <= h:
                break
        else:
            cw, ch = w, h
        x0, y0 = random.randint(0, w - cw), random.randint(0, h - ch)
        img = img.resize((self.size, self.size), Image.BILINEAR, box=(x0, y0, x0 + cw, y0 + ch))
        if random.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        x = (np.asarray(img, np.float32).transpose(2, 0, 1) / 255 - self.mean) / self.std
        return torch.from_numpy(x), int(self.files[i].parent.name[1:])


def pil_batches(folder: Path, size: int, batch: int, device: torch.device, workers: int):
    dl = torch.utils.data.DataLoader(PilFolder(folder, size), batch_size=batch, shuffle=True, drop_last=True,
                                     num_workers=workers, pin_memory=device.type == "cuda",
                                     persistent_workers=False, prefetch_factor=4 if workers else None)
    for x, y in dl:
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def sluice_batches(art, backend: str, size: int, batch: int, device: torch.device, workers: int):
    from sluice.stages.load import AugmentSpec, Loader
    from sluice.stages.load.augment import Flip, Normalize, RandomResizedCrop
    spec = AugmentSpec(ops=[RandomResizedCrop(size=size), Flip(), Normalize(mean=MEAN, std=STD)])
    ld = Loader(art, split="train", batch_size=batch, backend=backend, device=str(device), augment=spec,
                workers=workers, drop_last=True, prefetch=3)
    for x, y, _ in ld:
        yield x, y


def ceiling_batches(art, size: int, batch: int, device: torch.device, epochs: int = 1):
    """The GPU's ceiling: the split already decoded on the GPU; each batch is a gather plus the
    same augmentation (TorchAugment) on the device."""
    from sluice.stages.load import AugmentSpec, split_arrays
    from sluice.stages.load.augment import Flip, Normalize, RandomResizedCrop, TorchAugment
    x, y = split_arrays(art, "train")
    xs, ys = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
    aug = TorchAugment(AugmentSpec(ops=[RandomResizedCrop(size=size), Flip(), Normalize(mean=MEAN, std=STD)]))
    for _ in range(epochs):
        perm = torch.randperm(len(ys), device=device)
        for k in range(len(ys) // batch):
            idx = perm[k * batch:(k + 1) * batch]
            yield aug(xs[idx]), ys[idx]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def throughput(batches, device: torch.device, warmup: int = 1) -> dict[str, Any]:
    """Samples/s into ``device`` memory after ``warmup`` batches (the workers' start-up excluded)."""
    n, t0 = 0, None
    for k, (x, _) in enumerate(batches):
        if k == warmup:
            sync(device)
            t0, n = time.perf_counter(), 0
        n += len(x)
    sync(device)
    if t0 is None:
        return {"samples_per_s": None, "samples": 0}
    dt = time.perf_counter() - t0
    return {"samples_per_s": n / dt, "samples": n, "seconds": dt}


# ------------------------------------------------------------------ (b) ResNet-18 step

def resnet18(classes: int = 10) -> torch.nn.Module:
    """ResNet-18 (BasicBlocks 2-2-2-2, widths 64-512; the ImageNet stem, 11.2 M parameters)."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int):
            super().__init__()
            self.f = nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                                   nn.ReLU(inplace=True), nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
                                   nn.BatchNorm2d(cout))
            self.s = nn.Sequential() if stride == 1 and cin == cout else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            return torch.relu(self.f(x) + self.s(x))
    layers, cin = [], 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
        cin = cout
    return nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                         nn.MaxPool2d(3, 2, 1), *layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes))


def train_steps(batches, device: torch.device, steps: int, warmup: int = 3) -> dict[str, Any]:
    """bf16 autocast, channels-last, SGD: seconds per step and the share spent waiting for data."""
    model = resnet18().to(device, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    wait = total = 0.0
    done = 0
    it = iter(batches)
    for k in range(steps + warmup):
        t0 = time.perf_counter()
        try:
            x, y = next(it)
        except StopIteration:
            break
        t1 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x.contiguous(memory_format=torch.channels_last)).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync(device)
        if k >= warmup:
            wait, total, done = wait + t1 - t0, total + time.perf_counter() - t0, done + 1
    return {"steps": done, "step_s": total / max(done, 1), "data_wait_frac": wait / total if total else None}


# ------------------------------------------------------------------ the benchmark

def available(backend: str, cuda: bool) -> str | None:
    """Why ``backend`` cannot run here (None: it can)."""
    mod = {"ffcv": "ffcv", "dali": "nvidia.dali"}.get(backend)
    if mod:
        import importlib.util
        if importlib.util.find_spec(mod.split(".")[0]) is None or importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed (not in the wheelhouse: see scripts/gpu-wheelhouse.txt)"
    if backend == "dali" and not cuda:
        return "DALI's GPU operators need CUDA (its CPU pipeline is measured by benchmarks.loader)"
    return None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer images and steps, one seed (a few minutes)")
    ap.add_argument("--out", default=None, help="results file (default: benchmarks/results/gpu[_quick].json on CUDA)")
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS))
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    workers = os.cpu_count() or 1
    batch = 256 if cuda else 128
    images = {32: 8192, 64: 4096, 224: 2048} if not args.quick else {32: 4096, 64: 2048, 224: 1024}
    if not cuda:
        images = {32: 2048, 64: 1024, 224: 640}
    about = describe_run("benchmarks.gpu", argv)
    if os.environ.get("GPU_CHECK_COMMIT"):  # run by scripts/gpu_check.py from a copy outside git
        about["commit"] = os.environ["GPU_CHECK_COMMIT"]
    res: dict[str, Any] = {**about, "gpu": gpu_info(), "mode": "quick" if args.quick else "full",
                           "device": str(device), "batch": batch, "workers": workers, "goals_wanted": GOALS,
                           "throughput": {}, "train_step": {}, "skipped": {}}
    skip = res["skipped"]
    if not cuda:
        skip["ceiling (pre-loaded tensor)"] = "needs CUDA: the GPU's own ceiling"
        skip["(b) ResNet-18 step at 64 px, bf16"] = "needs CUDA (a CPU step says nothing of a GPU's data wait)"
        skip["(c) time to 93% on Fashion-MNIST"] = "needs CUDA (on CPU: python -m benchmarks.time_to_accuracy)"
    backends = []
    for b in args.backends:
        why = available(b, cuda)
        if why:
            skip[f"sluice {b}"] = why
        else:
            backends.append(b)
    work = Path(tempfile.mkdtemp(prefix="sluice-gpu-bench-"))
    rows = []
    try:
        for size in args.sizes:
            t = time.perf_counter()
            art = make_artifact(work / f"px{size}", size, images.get(size, 1024), workers)
            print(f"{size} px: {images.get(size, 1024)} JPEGs sharded in {time.perf_counter() - t:.1f} s", flush=True)
            arms: dict[str, Any] = {}
            arms["pil_dataloader"] = throughput(pil_batches(work / f"px{size}" / "src", size, batch, device, workers), device)
            for b in backends:
                arms[f"sluice_{b}"] = throughput(sluice_batches(art, b, size, batch, device, workers), device)
            if cuda:
                arms["ceiling"] = throughput(ceiling_batches(art, size, batch, device, epochs=2), device)
            res["throughput"][str(size)] = arms
            for arm, r in arms.items():
                rows.append({"px": size, "arm": arm, "samples/s": r["samples_per_s"], "samples": r["samples"]})
            print(table(rows[-len(arms):], ["px", "arm", "samples/s", "samples"]), flush=True)
            if cuda and size == 64:
                steps = 30 if args.quick else 100
                feeds = {"pil_dataloader": lambda: pil_batches(work / "px64" / "src", 64, batch, device, workers),
                         **{f"sluice_{b}": (lambda b=b: sluice_batches(art, b, 64, batch, device, workers)) for b in backends},
                         "ceiling": lambda: ceiling_batches(art, 64, batch, device, epochs=4)}
                for arm, feed in feeds.items():
                    res["train_step"][arm] = train_steps(feed(), device, steps)
                    print(f"  resnet18 64px bf16 fed by {arm}: {res['train_step'][arm]}", flush=True)
        if cuda:
            from benchmarks.gpu_tta import time_to_accuracy
            res["time_to_accuracy"] = time_to_accuracy(quick=args.quick)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["goals"] = goals(res)
    for what, why in skip.items():
        print(f"skipped: {what}: {why}")
    print(f"wrote {write(res, args.out, cuda, args.quick)}")
    return res


def goals(res: dict[str, Any]) -> dict[str, Any]:
    def best(size: str) -> float | None:
        v = [r["samples_per_s"] for k, r in res["throughput"].get(size, {}).items()
             if k.startswith("sluice_") and r["samples_per_s"]]
        return max(v) if v else None

    def ratio(size: str, other: str) -> float | None:
        o = res["throughput"].get(size, {}).get(other, {}).get("samples_per_s")
        return best(size) / o if best(size) and o else None
    pil, ceil = ratio("224", "pil_dataloader"), ratio("32", "ceiling")
    sluice_waits = [r["data_wait_frac"] for k, r in res["train_step"].items() if k.startswith("sluice_")]
    wait = min(sluice_waits) if sluice_waits and None not in sluice_waits else None
    return {"best_sluice_vs_pil_224": {"ratio": pil, "met": None if pil is None else pil >= GOALS["best_sluice_vs_pil_224"]},
            "best_sluice_vs_ceiling_32": {"ratio": ceil, "met": None if ceil is None else ceil >= GOALS["best_sluice_vs_ceiling_32"]},
            "data_wait_frac_resnet18_64": {"best": wait, "met": None if wait is None else wait < GOALS["data_wait_frac_max"]}}


def write(res: dict[str, Any], out: str | None, cuda: bool, quick: bool) -> Path:
    from benchmarks.hostinfo import cpu, host_class_record, load_average
    from sluice.storage.atomic import write_json
    path = Path(out) if out else (RESULTS / ("gpu_quick.json" if quick else "gpu.json") if cuda
                                  else ROOT / "gpu-check-results" / "gpu-cpu-dry-run.json")
    if not cuda and path.resolve().parent == RESULTS.resolve():
        raise SystemExit(f"refusing to write a CPU dry run into {RESULTS}: it holds GPU figures only")
    path.parent.mkdir(parents=True, exist_ok=True)
    from datetime import datetime, timezone
    res["_meta"] = {"when": datetime.now(timezone.utc).isoformat(), "commit": res.get("commit"),
                    "host": cpu(), **host_class_record(),
                    "load_average": load_average(), "python": res["host"]["python"]}
    write_json(path, res)
    return path


if __name__ == "__main__":
    main()
