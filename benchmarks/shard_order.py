"""Does the shard-block shuffle cost accuracy? Fashion-MNIST trained with the exact global shuffle
and with ``shard_block`` (shard order shuffled, samples shuffled within a window of shards).

Same model, recipe, budget (``--epochs`` passes), augmentation and evaluation on both sides; only
the sampler differs. The artifact is sharded at 2,000 samples a shard (30 train shards), window 4:
8,000 of 60,000 samples in play at a time. Seeds are interleaved (shuffle, shard_block per seed);
the table reports the median test accuracy and its min-max over the seeds. Goal, fixed before
the run: the shard-block median within 0.5 points of the global shuffle's.

    flock /tmp/sluice-bench.lock python -m benchmarks.shard_order [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import table, write_result
from benchmarks.photo_crops import CACHE

ARMS = ("shuffle", "shard_block")
WINDOW = 4


def artifact() -> str:
    from sluice.stages.data.config import IngestConfig
    from sluice.stages.data.shard import ShardConfig, shard_dataset
    s = shard_dataset(IngestConfig(source="fashion-mnist", holdout_fraction=0.0, val_fraction=0.0),
                      CACHE / "artifacts" / "fmnist-2k", ShardConfig(encoding="npy", shard_samples=2000, progress=False))
    return s.root


def run(root: str, kind: str, seed: int, epochs: float) -> dict:
    from sluice.stages.load import AugmentSpec, Loader, SamplerConfig
    from sluice.stages.load.augment import Flip, RandomResizedCrop
    from sluice.stages.train import TrainConfig, train
    torch.manual_seed(seed)
    tr = Loader(root, split="train", batch_size=128, backend="memory", workers=2, seed=seed,
                sampler=SamplerConfig(kind=kind, seed=seed, window=WINDOW),
                augment=AugmentSpec(ops=[RandomResizedCrop(size=28, scale=(0.35, 1)), Flip()]))
    ev = Loader(root, split="test", batch_size=512, backend="memory", workers=2,
                sampler=SamplerConfig(kind="sequential"))
    t = time.perf_counter()
    r = train(TrainConfig(epochs=epochs, batch_size=128, normalize_mean=[0.286], normalize_std=[0.353],
                          progress=False, torch_threads=2, seed=seed), tr, ev)
    return {"sampler": kind, "seed": seed, "test_acc": r.final_acc, "train_s": time.perf_counter() - t}


def main(argv: list[str] | None = None) -> dict:
    from benchmarks.hostinfo import describe_run
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--epochs", type=float, default=None, help="default: 5 (quick: 1)")
    a = ap.parse_args(argv)
    epochs = a.epochs or (1.0 if a.quick else 5.0)
    prov = describe_run("benchmarks.shard_order", argv)
    root = artifact()
    rows = []
    for seed in range(a.seeds):
        for kind in ARMS:
            r = run(root, kind, seed, epochs)
            rows.append(r)
            print(f"  seed {seed} {kind:<12} test acc {r['test_acc']:.4f}  ({r['train_s']:.0f} s)", flush=True)
    summary = {}
    for kind in ARMS:
        accs = [r["test_acc"] for r in rows if r["sampler"] == kind]
        summary[kind] = {"median": statistics.median(accs), "min": min(accs), "max": max(accs)}
    gap = summary["shuffle"]["median"] - summary["shard_block"]["median"]
    print(table([{"sampler": k, "median": v["median"], "min": v["min"], "max": v["max"]} for k, v in summary.items()],
                ["sampler", "median", "min", "max"]))
    goal = {"gap_points": 100 * gap, "target_points": 0.5, "met": 100 * gap <= 0.5}
    print(f"shuffle − shard_block: {100 * gap:+.2f} points; goal (≤ 0.5) {'met' if goal['met'] else 'MISSED'}")
    payload = {**prov, "mode": "quick" if a.quick else "full", "seeds": list(range(a.seeds)), "epochs": epochs,
               "shard_samples": 2000, "window": WINDOW, "summary": summary, "goal": goal, "runs": rows}
    path = write_result("shard_order_quick" if a.quick else "shard_order", payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
