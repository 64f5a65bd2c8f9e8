"""Can the loader keep one GPU busy training ResNet-50 on ImageNet-like JPEGs?

Data: ``benchmarks.imagenet_like`` (JPEGs with ImageNet's sizes, about 500×375 and 110 KB on
average, quality 90, 1,000 classes), sharded by Sluice's own shard stage into every format with
each image at its own size. Every arm reads the same images and makes the same batches: a random
resized crop (torchvision's sampling: area 8-100%, aspect 3/4-4/3) to ``px`` × ``px``, a
horizontal flip and ImageNet's normalisation, float32 NCHW on the GPU.

On one GPU (``gpu`` mode) each arm feeds torchvision's ResNet-50 (``benchmarks/resnet50.py``
where torchvision is missing: the same network), 1,000 classes, bf16 autocast, channels-last,
SGD (momentum 0.9), batch 256, at 224 and 128 px. The arms:

* ``synthetic``: one fixed batch already on the GPU: the model's own ceiling;
* ``pil_dataloader``: what most users run: ``torch.utils.data.DataLoader`` over the JPEG folder,
  PIL decode, torchvision's ``RandomResizedCrop``, ``RandomHorizontalFlip``, ``ToTensor``,
  ``Normalize`` per sample (an equivalent PIL/NumPy version where torchvision is missing), one
  worker per core, ``pin_memory``, the batch copied to the GPU;
* ``sluice-<backend>-cpu``: Sluice's loader, ``decode: cpu``, for the webdataset, ffcv and dali
  backends (``memory`` needs one image shape, and this data keeps ImageNet's sizes: skipped);
* ``sluice-device``: Sluice's loader with ``decode: device``: the workers read the bytes and the
  batch is decoded where it is made (nvJPEG on the GPU), then cropped, flipped and normalised there.

Per arm: trained images/s over a window (``--window-s``, 30 s in full mode) after a warm-up
(``--warmup-s``; the workers' start, the JIT, cuDNN's autotuning), ``--repeats`` (3) interleaved
repeats, the arm order rotated each repeat, min-max and median reported; the share of the window's
wall time spent blocked in ``next(loader)`` (the host runs at most one step ahead of the GPU: after
it launches step k it waits on step k-1's CUDA event, as a loop that logs the loss a step late
does, so a batch that is not ready when asked for is time the GPU can run dry); the CPU cores busy
(user + system CPU time of this process and every process under it, over the window's wall time).

Goals, per size (``GOALS``): the best Sluice arm ≥ 0.9× the synthetic ceiling and ≥ 1.5× the PIL
DataLoader in trained images/s; its data wait < 5% of the window; its CPU cores busy ≤ half the
PIL DataLoader's. Written beside the figures in the JSON.

Without CUDA (``cpu`` mode) there is no training: each arm's input path runs on the CPU on the
same data (the PIL DataLoader; Sluice's backends decoding on the CPU; ``decode: device``, which on
a CPU loader decodes each batch in one OpenCV call), and the figure is decode + augmentation
throughput: images/s and images/s per busy core. It writes
``benchmarks/results/gpu_loader_cpu-<host class>.json`` (``..._quick.json`` with ``--quick``); the GPU mode writes
``benchmarks/results/gpu_loader.json`` (``gpu_loader_quick.json`` with ``--quick``).

    python -m benchmarks.gpu_loader [--quick] [--n N] [--window-s S] [--warmup-s S] [--repeats R]
                                    [--sizes 224 128] [--arms ...] [--out FILE] [--time-budget S]
                                    [--cache DIR] [--workers W] [--data-workers W]

``--time-budget``: no window starts once that many seconds have passed since the start (data
included); what did not run is listed under ``skipped``. The results file is rewritten after
every window, so a run that is killed still leaves what it measured.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from benchmarks.common import RESULTS, table
from benchmarks.hostinfo import describe_run, results_name
from benchmarks.imagenet_like import CACHE, default_root, describe, make_imagenet_like, shard_imagenet_like, stats

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
SCALE, RATIO = (0.08, 1.0), (3 / 4, 4 / 3)  # torchvision's RandomResizedCrop defaults
SIZES = (224, 128)
BACKENDS = ("webdataset", "ffcv", "dali")
ARMS = ("synthetic", "pil_dataloader", *(f"sluice-{b}-cpu" for b in BACKENDS), "sluice-device")
GOALS = {"best_sluice_vs_synthetic_min": 0.9, "best_sluice_vs_pil_min": 1.5, "data_wait_frac_max": 0.05,
         "cores_busy_vs_pil_max": 0.5}
# mode -> (images, window s, warm-up s, repeats, batch)
SETTINGS = {"gpu": (20_000, 30.0, 10.0, 3, 256), "gpu-quick": (10_000, 6.0, 3.0, 3, 256),
            "cpu": (2_000, 20.0, 5.0, 3, 64), "cpu-quick": (600, 3.0, 1.0, 3, 32)}


# ------------------------------------------------------------------ measuring

def cpu_seconds() -> float | None:
    """User + system CPU seconds of this process and every live process under it, each with its
    reaped children's (so a worker that exits between two readings keeps its time counted)."""
    try:
        import psutil
    except ImportError:
        return _proc_cpu_seconds()
    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def _proc_cpu_seconds() -> float | None:
    """``cpu_seconds`` from /proc where psutil is missing (Linux); None elsewhere."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    stat: dict[int, tuple[int, float]] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
            stat[int(d.name)] = (int(f[1]), sum(int(v) for v in f[11:15]) / tick)
        except (OSError, ValueError, IndexError):
            continue
    if os.getpid() not in stat:
        return None
    total, todo = 0.0, [os.getpid()]
    while todo:
        pid = todo.pop()
        total += stat[pid][1]
        todo += [c for c, (pp, _) in stat.items() if pp == pid]
    return total


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forever(make: Callable[[], Iterator], closers: list) -> Iterator:
    """Batches from ``make()`` epoch after epoch (an epoch's end and the next one's start count in
    the time they take, as in training)."""
    while True:
        it = make()
        closers.append(it)
        yield from it


# ------------------------------------------------------------------ the arms' input paths

class PilFolder(torch.utils.data.Dataset):
    """What a plain PyTorch user writes: PIL decode and torchvision's transforms per sample
    (``RandomResizedCrop`` + ``RandomHorizontalFlip`` + ``ToTensor`` + ``Normalize``), or the
    same thing in PIL and NumPy where torchvision is not installed."""

    def __init__(self, folder: Path, size: int):
        self.files = sorted(folder.glob("*/*.jpg"))
        self.labels = [int(f.parent.name[1:]) for f in self.files]
        self.size = size
        try:
            from torchvision import transforms as T
            self.tf = T.Compose([T.RandomResizedCrop(size, scale=SCALE, ratio=RATIO), T.RandomHorizontalFlip(),
                                 T.ToTensor(), T.Normalize(MEAN, STD)])
            self.how = "torchvision.transforms"
        except ImportError:
            self.tf = self._own
            self.how = "PIL + NumPy (torchvision's sampling; torchvision is not installed)"
        self.mean = np.array(MEAN, np.float32).reshape(3, 1, 1)
        self.std = np.array(STD, np.float32).reshape(3, 1, 1)

    def __len__(self) -> int:
        return len(self.files)

    def _own(self, img):
        from PIL import Image
        w, h = img.size
        area = w * h
        for _ in range(10):  # torchvision's RandomResizedCrop.get_params
            a = area * random.uniform(*SCALE)
            r = math.exp(random.uniform(math.log(RATIO[0]), math.log(RATIO[1])))
            cw, ch = round(math.sqrt(a * r)), round(math.sqrt(a / r))
            if 0 < cw <= w and 0 < ch <= h:
                x0, y0 = random.randint(0, w - cw), random.randint(0, h - ch)
                break
        else:  # torchvision's fallback: the central crop at the nearest allowed ratio, inside the image
            r = w / h
            cw, ch = (w, round(w / RATIO[0])) if r < RATIO[0] else (round(h * RATIO[1]), h) if r > RATIO[1] else (w, h)
            x0, y0 = (w - cw) // 2, (h - ch) // 2
        img = img.resize((self.size, self.size), Image.BILINEAR, box=(x0, y0, x0 + cw, y0 + ch))
        if random.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        x = (np.asarray(img, np.float32).transpose(2, 0, 1) / 255 - self.mean) / self.std
        return torch.from_numpy(x)

    def __getitem__(self, i: int):
        from PIL import Image
        with Image.open(self.files[i]) as im:
            img = im.convert("RGB")
        return self.tf(img), self.labels[i]


def pil_feed(folder: Path, size: int, batch: int, device: torch.device, workers: int, closers: list,
             info: dict) -> Iterator:
    ds = PilFolder(folder, size)
    info["transforms"] = ds.how
    dl = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, drop_last=True, num_workers=workers,
                                     pin_memory=device.type == "cuda", persistent_workers=workers > 0)
    closers.append(_Shutdown(dl))

    def epoch() -> Iterator:
        for x, y in dl:
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    return forever(epoch, closers)


def sluice_feed(art: str, backend: str, decode: str, size: int, batch: int, device: torch.device, workers: int,
                closers: list, info: dict) -> Iterator:
    from sluice.stages.load import AugmentSpec, Loader
    from sluice.stages.load.augment import Flip, Normalize, RandomResizedCrop
    spec = AugmentSpec(ops=[RandomResizedCrop(size=size, scale=SCALE, ratio=RATIO), Flip(),
                            Normalize(mean=MEAN, std=STD)])
    ld = Loader(art, split="train", batch_size=batch, backend=backend, device=str(device), decode=decode,
                augment=spec, workers=workers, drop_last=True, prefetch=3, verify="none")

    def epoch() -> Iterator:
        for x, y, _ in ld:
            if "backend_reason" not in info:  # complete once the backend is open (decode's choice too)
                info["backend_reason"] = ld.backend_reason
                info["decode"] = getattr(getattr(ld, "decoding", None), "reason", None)
            yield x, y
    return forever(epoch, closers)


def synthetic_feed(size: int, batch: int, device: torch.device) -> Iterator:
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(batch, 3, size, size, generator=g).to(device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), generator=g).to(device)
    while True:
        yield x, y


class _Shutdown:
    """Stops a DataLoader's persistent workers when the window ends (not when it is collected)."""

    def __init__(self, dl):
        self.dl = dl

    def close(self) -> None:
        it = getattr(self.dl, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        self.dl._iterator = None


def close_all(closers: list) -> None:
    for it in closers:
        try:
            it.close()
        except Exception:  # noqa: BLE001 - best effort: the workers are shut down with it
            pass
    closers.clear()


# ------------------------------------------------------------------ one window

class Trainer:
    """ResNet-50, bf16 autocast, channels-last, SGD with momentum 0.9; one step at a time."""

    def __init__(self, device: torch.device, model: torch.nn.Module | None = None):
        from benchmarks.resnet50 import resnet50
        self.model, self.source = (model, "given") if model is not None else resnet50(1000)
        self.model = self.model.to(device, memory_format=torch.channels_last)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-5)
        self.device = device

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(
                self.model(x.contiguous(memory_format=torch.channels_last)), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()


def window(feed: Iterator, batch: int, device: torch.device, warmup_s: float, window_s: float,
           trainer: Trainer | None) -> dict[str, Any]:
    """Warm up for ``warmup_s`` (at least 2 batches), then time ``window_s`` seconds: images/s
    (trained, or only made in cpu mode), the data-wait share, the CPU cores busy."""
    cuda = device.type == "cuda"
    t0, k = time.perf_counter(), 0
    prev = None
    while k < 2 or time.perf_counter() - t0 < warmup_s:
        x, y = next(feed)
        if trainer is not None:
            trainer.step(x, y)
        k += 1
    sync(device)
    warm = time.perf_counter() - t0
    c0, start = cpu_seconds(), time.perf_counter()
    wait, steps, n = 0.0, 0, 0
    while True:
        a = time.perf_counter()
        x, y = next(feed)
        wait += time.perf_counter() - a
        n += len(y)
        if trainer is not None:
            trainer.step(x, y)
            if cuda:  # run at most one step ahead of the GPU
                ev = torch.cuda.Event()
                ev.record()
                if prev is not None:
                    prev.synchronize()
                prev = ev
        steps += 1
        if time.perf_counter() - start >= window_s and steps >= 3:
            break
    sync(device)
    wall = time.perf_counter() - start
    c1 = cpu_seconds()
    busy = (c1 - c0) / wall if c0 is not None and c1 is not None else None
    return {"images_per_s": n / wall, "images": n, "steps": steps, "seconds": round(wall, 2),
            "data_wait_frac": wait / wall if trainer is not None else None, "cores_busy": busy,
            "images_per_s_per_core": n / wall / busy if busy else None, "warmup_s": round(warm, 2),
            "warmup_batches": k}


# ------------------------------------------------------------------ the benchmark

def unavailable(arm: str, cuda: bool) -> str | None:
    """Why ``arm`` cannot run here (None: it can)."""
    import importlib.util
    if arm == "synthetic" and not cuda:
        return "needs CUDA: the model's own ceiling on a GPU; cpu mode measures the input paths only"
    mod = {"sluice-ffcv-cpu": "ffcv", "sluice-dali-cpu": "nvidia.dali"}.get(arm)
    if mod:
        try:
            found = importlib.util.find_spec(mod) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return f"{mod} is not installed (not in the wheelhouse: see scripts/gpu-wheelhouse.txt)"
    return None


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def mmm(key: str) -> dict[str, float | None]:
        v = [r[key] for r in runs if r.get(key) is not None]
        return {"median": statistics.median(v), "min": min(v), "max": max(v)} if v else \
            {"median": None, "min": None, "max": None}
    return {"images_per_s": mmm("images_per_s"), "data_wait_frac": mmm("data_wait_frac"),
            "cores_busy": mmm("cores_busy"), "images_per_s_per_core": mmm("images_per_s_per_core"),
            "repeats": len(runs)}


def goals(arms: dict[str, Any], mode: str) -> dict[str, Any]:
    """The goals at one size, from the medians; None where an arm is missing. In cpu mode there
    is no training, so no ceiling and no data wait, and every arm keeps all cores as busy as it
    can: the figures there are ratios of throughput and of images per busy core (the CPU cost of
    an image, the cores-busy goal's analogue), indicative only, never met or missed."""
    def med(a: str, key: str) -> float | None:
        sm = (arms.get(a) or {}).get("summary")
        return sm[key]["median"] if sm else None

    def ratio(x, y):
        return x / y if x is not None and y else None
    sluice = {a: med(a, "images_per_s") for a in arms if a.startswith("sluice") and med(a, "images_per_s")}
    if not sluice:
        return {"best_sluice": None, "note": "no Sluice arm ran"}
    if mode == "cpu":
        per = {a: med(a, "images_per_s_per_core") for a in arms}
        best = max(sluice, key=lambda a: per.get(a) or 0)
        return {"best_sluice": best, "indicative": True,
                "images_per_s_vs_pil": ratio(sluice[best], med("pil_dataloader", "images_per_s")),
                "images_per_core_vs_pil": ratio(per.get(best), per.get("pil_dataloader")),
                "images_per_s_per_core": per,
                "note": "cpu mode: decode + augmentation only (no training): no ceiling, no data wait; the "
                        "GPU goals are judged in gpu mode only"}
    best = max(sluice, key=sluice.get)
    r_syn = ratio(sluice[best], med("synthetic", "images_per_s"))
    r_pil = ratio(sluice[best], med("pil_dataloader", "images_per_s"))
    wait = med(best, "data_wait_frac")
    cores = ratio(med(best, "cores_busy"), med("pil_dataloader", "cores_busy"))

    def goal(v, wanted: str, ok: Callable[[float], bool]) -> dict[str, Any]:
        return {"value": v, "wanted": wanted, "met": None if v is None else bool(ok(v))}
    g = GOALS
    return {"best_sluice": best,
            "vs_synthetic": goal(r_syn, f">= {g['best_sluice_vs_synthetic_min']}",
                                 lambda v: v >= g["best_sluice_vs_synthetic_min"]),
            "vs_pil": goal(r_pil, f">= {g['best_sluice_vs_pil_min']}", lambda v: v >= g["best_sluice_vs_pil_min"]),
            "data_wait": goal(wait, f"< {g['data_wait_frac_max']}", lambda v: v < g["data_wait_frac_max"]),
            "cores_busy_vs_pil": goal(cores, f"<= {g['cores_busy_vs_pil_max']}",
                                      lambda v: v <= g["cores_busy_vs_pil_max"])}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer images, shorter windows (a few minutes)")
    ap.add_argument("--n", type=int, default=None, help="images (default: by mode, see SETTINGS)")
    ap.add_argument("--window-s", type=float, default=None)
    ap.add_argument("--warmup-s", type=float, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--workers", type=int, default=None, help="decode workers (default: one per core)")
    ap.add_argument("--data-workers", type=int, default=None, help="processes writing the dataset")
    ap.add_argument("--cache", default=str(CACHE), help="where the dataset and its artifact are kept")
    ap.add_argument("--out", default=None, help="results file (default: under benchmarks/results/)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="no window starts after this many seconds from the start (data included)")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    mode = "gpu" if cuda else "cpu"
    n, window_s, warmup_s, repeats, batch = SETTINGS[mode + ("-quick" if args.quick else "")]
    n, window_s = args.n or n, args.window_s or window_s
    warmup_s = args.warmup_s if args.warmup_s is not None else warmup_s
    repeats, batch = args.repeats or repeats, args.batch or batch
    workers = args.workers or os.cpu_count() or 1
    if cuda:
        torch.backends.cudnn.benchmark = True
    about = describe_run("benchmarks.gpu_loader", argv)
    if os.environ.get("GPU_CHECK_COMMIT"):  # run by scripts/gpu_check.py from a copy outside git
        about["commit"] = os.environ["GPU_CHECK_COMMIT"]
    out = Path(args.out) if args.out else RESULTS / (
        ("gpu_loader_quick.json" if args.quick else "gpu_loader.json") if cuda
        else results_name("gpu_loader_cpu") + ("_quick" if args.quick else "") + ".json")
    if not cuda and out.resolve().parent == RESULTS.resolve() and not out.name.startswith("gpu_loader_cpu"):
        raise SystemExit(f"refusing to write a CPU run as {out.name}: CPU figures go to gpu_loader_cpu-*.json")
    # the data first: its processes fork before CUDA is initialised here
    t = time.perf_counter()
    folder = make_imagenet_like(n, default_root(n, cache=args.cache), workers=args.data_workers)
    data = {"folder_stats": stats(folder), "generate_s": round(time.perf_counter() - t, 1)}
    print(f"data: {describe(folder)} ({data['generate_s']} s here)", flush=True)
    t = time.perf_counter()
    art = shard_imagenet_like(folder, workers=args.data_workers)
    data["shard_s"] = round(time.perf_counter() - t, 1)
    data["artifact"] = str(art)
    print(f"sharded into every format in {data['shard_s']} s: {art}", flush=True)

    from benchmarks.gpu import gpu_info
    res: dict[str, Any] = {**about, "mode": f"{mode}{' quick' if args.quick else ''}", "gpu": gpu_info(),
                           "device": str(device), "batch": batch, "workers": workers, "window_s": window_s,
                           "warmup_s": warmup_s, "repeats": repeats, "seeds": [0],
                           "goals_wanted": GOALS, "sizes": {}, "skipped": {}}
    if mode == "gpu" and window_s < 30:
        res["note"] = f"windows of {window_s:g} s, shorter than the 30 s the full benchmark uses"

    res["data"] = data
    arms = []
    for a in args.arms:
        why = unavailable(a, cuda)
        if why:
            res["skipped"][a] = why
        else:
            arms.append(a)
    res["skipped"]["sluice-memory-cpu"] = ("the memory backend needs one image shape; this dataset keeps "
                                           "ImageNet's variable sizes")
    trainer = Trainer(device) if cuda else None
    if trainer:
        res["model"] = f"ResNet-50 ({trainer.source}), bf16 autocast, channels-last, SGD momentum 0.9"

    def write() -> Path:
        from benchmarks.common import write_result
        path = write_result(out.stem, res) if out.parent.resolve() == RESULTS.resolve() else _write_to(out, res)
        return path

    for px in args.sizes:
        res["sizes"][str(px)] = {"arms": {a: {"runs": []} for a in arms}}
    # repeat by repeat, each size in turn, the arms' order rotated: a time budget cuts the last repeat
    for r in range(repeats):
        for px in args.sizes:
            per = res["sizes"][str(px)]["arms"]
            order = arms[r % len(arms):] + arms[:r % len(arms)] if arms else []
            for arm in order:
                if args.time_budget and time.perf_counter() - started > args.time_budget:
                    res["skipped"][f"{arm} at {px} px, repeat {r + 1}"] = \
                        f"not started: the {args.time_budget:g} s time budget was spent"
                    continue
                closers: list = []
                info: dict[str, Any] = {}
                try:
                    if arm == "synthetic":
                        feed = synthetic_feed(px, batch, device)
                    elif arm == "pil_dataloader":
                        feed = pil_feed(folder, px, batch, device, workers, closers, info)
                    else:
                        backend = arm.split("-")[1] if arm != "sluice-device" else "webdataset"
                        decode = "device" if arm == "sluice-device" else "cpu"
                        feed = sluice_feed(art, backend, decode, px, batch, device, workers, closers, info)
                    run = {"repeat": r + 1, **window(feed, batch, device, warmup_s, window_s, trainer)}
                except Exception as e:  # noqa: BLE001 - recorded, the other arms run on
                    run = {"repeat": r + 1, "error": f"{type(e).__name__}: {e}"[:2000]}
                    print(f"  {px} px {arm}: FAILED: {run['error'][:500]}", flush=True)
                finally:
                    close_all(closers)
                    feed = None
                per[arm]["runs"].append(run)
                per[arm].update(info)
                if "images_per_s" in run:
                    print(f"  {px} px, repeat {r + 1}, {arm}: {run['images_per_s']:,.1f} images/s"
                          + ("" if run["data_wait_frac"] is None else f", data wait {100 * run['data_wait_frac']:.1f}%")
                          + (f", {run['cores_busy']:.2f} cores busy" if run["cores_busy"] is not None else "")
                          + f" ({run['seconds']:.1f} s after {run['warmup_s']:.1f} s warm-up)", flush=True)
                write()
            for arm, a in per.items():
                ok = [x for x in a["runs"] if "images_per_s" in x]
                a["summary"] = summarise(ok) if ok else None
            res["sizes"][str(px)]["goals"] = goals(per, mode)
            write()
    print()
    print(report_table(res))
    for what, why in res["skipped"].items():
        print(f"skipped: {what}: {why}")
    res["seconds"] = round(time.perf_counter() - started, 1)
    print(f"wrote {write()}")
    return res


def report_table(res: dict[str, Any]) -> str:
    """The medians (min-max) per size and arm, and the goals beside them."""
    rows, lines = [], []
    for px, s in res["sizes"].items():
        for arm, a in s["arms"].items():
            sm = a.get("summary")
            if not sm:
                failed = any("error" in r for r in a["runs"])
                rows.append({"px": px, "arm": arm, "images/s (median)": "failed" if failed else "not run"})
                continue
            ips = sm["images_per_s"]
            rows.append({"px": px, "arm": arm, "images/s (median)": ips["median"],
                         "min-max": f"{ips['min']:,.0f}-{ips['max']:,.0f}",
                         "data wait": sm["data_wait_frac"]["median"], "cores busy": sm["cores_busy"]["median"],
                         "img/s per core": sm["images_per_s_per_core"]["median"]})
        g = s.get("goals") or {}
        parts = [f"best Sluice arm {g.get('best_sluice')}"]
        for k, v in g.items():
            if isinstance(v, dict) and "met" in v:
                state = "not measured" if v["met"] is None else "met" if v["met"] else "MISSED"
                shown = "-" if v["value"] is None else f"{v['value']:.3f}"
                parts.append(f"{k} {shown} (wanted {v['wanted']}: {state})")
            elif isinstance(v, float):
                parts.append(f"{k} {v:.2f}")
        lines.append(f"{px} px: " + "; ".join(parts) + (" (indicative: cpu mode)" if g.get("indicative") else ""))
    cols = ["px", "arm", "images/s (median)", "min-max", "data wait", "cores busy", "img/s per core"]
    return table(rows, cols) + "\n" + "\n".join(lines)


def _write_to(path: Path, res: dict[str, Any]) -> Path:
    from datetime import datetime, timezone

    from benchmarks.hostinfo import cpu, host_class_record, load_average
    from sluice.storage.atomic import write_json
    path.parent.mkdir(parents=True, exist_ok=True)
    res["_meta"] = {"when": datetime.now(timezone.utc).isoformat(), "commit": res.get("commit"), "host": cpu(),
                    **host_class_record(), "load_average": load_average(), "python": res["host"]["python"]}
    write_json(path, res)
    return path


if __name__ == "__main__":
    main()
