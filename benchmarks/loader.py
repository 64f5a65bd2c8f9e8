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
import os
import statistics
import time
import traceback
import warnings

import torch

from benchmarks.common import paired_overhead, table, write_result
from benchmarks.loader_rows import BATCH, CHECKS_OFF, DATASETS, RATIO, SCALE, WORKERS, make_artifacts, row_builders

OURS_RAW = {"sluice memory": "raw numpy+torch", "sluice ffcv": "raw ffcv", "sluice dali": "raw dali",
            "sluice webdataset": "raw webdataset"}
RAW_LIBS = ("raw ffcv", "raw dali", "raw webdataset")  # the libraries (numpy+torch is a reference)


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
