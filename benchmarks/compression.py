"""Gradient compression and bf16 autocast on 2 DDP ranks (gloo, CPU) on Fashion-MNIST.

Every mode trains the same model for the same number of steps from the same seed, through
``sluice.stages.run.launch`` (real torchrun, 2 processes on 127.0.0.1), and reports bytes all-reduced per
step (whole run, and the steady state after PowerSGD's plain warm-up), seconds per step and final
test accuracy. The model is SmallCNN (width 32) with the classic dense head (``hidden=256``):
871k parameters, 92% of them in one 256×3136 matrix — the communication-bound shape that
gradient compression is for (the pooled-head SmallCNN is 66k parameters in small conv matrices,
which caps rank-2 PowerSGD near 20×). Full mode: 800 steps of 128 per rank (≈ 3.4 epochs,
≈ 35 minutes on 2 cores). ``--quick``: 120 steps of 64 per rank, the six required modes, 5k
test images (~3 minutes) — a smoke run whose accuracies are not yet comparable.

    python -m benchmarks.compression [--quick]

Writes ``benchmarks/results/compression.json`` keyed by mode.

With ``--link RATE [RATE ...]`` (100mbit, 1gbit, 10gbit) the modes run instead on two simulated
nodes over a link shaped to each rate and report time to the target accuracy
(``benchmarks/compression_links.py``; needs root for the network namespaces):

    python -m benchmarks.compression --link 100mbit 1gbit 10gbit     # compression_links.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sluice.stages.run.launch import launch, make_job

RESULTS = Path(__file__).resolve().parent / "results" / "compression.json"


REQUIRED = ("none", "fp16", "powersgd_rank1", "powersgd_rank2", "powersgd_rank4", "bf16_autocast")


def modes(start_iter: int) -> dict[str, dict[str, Any]]:
    """Config overrides per benchmark key."""
    def psgd(rank: int, dtype: str = "fp32") -> dict[str, Any]:
        return {"mode": "powersgd", "params": {"rank": rank, "dtype": dtype, "start_iter": start_iter,
                                               "error_feedback": True, "warm_start": True}}
    return {
        "none": {"comm": {"mode": "none"}},
        "fp16": {"comm": {"mode": "fp16"}},
        "powersgd_rank1": {"comm": psgd(1)},
        "powersgd_rank2": {"comm": psgd(2)},
        "powersgd_rank4": {"comm": psgd(4)},
        "bf16_autocast": {"comm": {"mode": "none"}, "amp": "bf16"},
        # extra: PowerSGD sending fp16 (half the bytes again)
        "powersgd_rank1_fp16": {"comm": psgd(1, "fp16")},
        "powersgd_rank2_fp16": {"comm": psgd(2, "fp16")},
    }


def run(quick: bool, only: list[str] | None = None, steps: int | None = None,
        start_iter: int | None = None) -> dict[str, dict[str, Any]]:
    steps = steps or (120 if quick else 800)
    start_iter = start_iter or (10 if quick else 50)
    base = {"model": "small_cnn", "model_kwargs": {"width": 32, "hidden": 256}, "max_steps": steps,
            "batch_size": 64 if quick else 128, "lr": 0.1, "schedule": "onecycle", "warmup_fraction": 0.15,
            "weight_decay": 5e-4, "seed": 0, "progress": False, "torch_threads": 1,
            "log_every_steps": 1}
    train_spec = {"kind": "arrays", "path": "fashion-mnist:train"}
    test_spec = {"kind": "arrays", "path": "fashion-mnist:test", "batch_size": 500}
    if quick:
        test_spec["limit"] = 5000
    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as tmp:
        for key, over in modes(start_iter=start_iter).items():
            if (only and key not in only) or (quick and not only and key not in REQUIRED):
                continue
            t0 = time.time()
            r = launch(make_job({**base, **over}, train_spec, test_spec), nproc=2,
                       out_dir=Path(tmp) / key, on_line=lambda line: None, timeout_s=1200)
            s = r.summary
            ms = r.metrics[5:]  # skip the first steps (allocations, DDP bucket rebuild)
            out[key] = {
                "bytes_per_step": s["bytes_per_step"],
                "bytes_per_step_steady": s.get("bytes_per_step_compressed_phase",
                                               s["bytes_per_step"]),
                "uncompressed_bytes": s["uncompressed_bytes"],
                "seconds_per_step": sum(m["step_s"] for m in ms) / len(ms),
                "final_acc": r.final_acc, "steps": r.steps,
                "data_wait_frac": s["data_wait_frac"], "wall_s": time.time() - t0,
                "config": over}
            print(f"  {key}: acc {r.final_acc:.4f} in {time.time() - t0:.0f}s", flush=True)
    return out


def table(res: dict[str, dict[str, Any]]) -> str:
    full = res.get("none", next(iter(res.values())))["uncompressed_bytes"]
    base_acc = res.get("none", {}).get("final_acc")
    rows = [f"{'mode':16} {'bytes/step':>11} {'steady':>9} {'ratio':>7} {'s/step':>8} "
            f"{'acc':>7} {'Δacc':>7}"]
    for k, v in res.items():
        d = "" if base_acc is None else f"{100 * (v['final_acc'] - base_acc):+.2f}"
        rows.append(f"{k:16} {v['bytes_per_step']:11.0f} {v['bytes_per_step_steady']:9.0f} "
                    f"{full / v['bytes_per_step_steady']:6.1f}x {v['seconds_per_step']:8.4f} "
                    f"{v['final_acc']:7.4f} {d:>7}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="120 steps, required modes only (~3 min)")
    ap.add_argument("--only", nargs="*", help="run only these modes")
    ap.add_argument("--steps", type=int, help="override the step budget")
    ap.add_argument("--start-iter", type=int,
                    help="PowerSGD: plain all-reduce steps before compressing (default 50; quick 10)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--link", nargs="+", metavar="RATE",
                    help="run on two simulated nodes over a link of each RATE (100mbit 1gbit 10gbit)")
    ap.add_argument("--models", nargs="+", help="--link: which models (small_cnn_dense, resnet_small)")
    ap.add_argument("--seeds", type=int, default=3, help="--link: seeds 0..N-1 (default 3)")
    ap.add_argument("--merge", action="store_true",
                    help="--link: merge these rates into the existing results file (same settings), keeping its others")
    ap.add_argument("--resummarise", action="store_true",
                    help="--link: recompute the summary and goals of the existing results file from its raw runs")
    a = ap.parse_args(argv)
    if a.link or a.resummarise:
        from benchmarks import compression_links
        return compression_links.main(a, argv if argv is not None else sys.argv[1:])
    a.out = a.out or str(RESULTS)
    res = run(a.quick, a.only, a.steps, a.start_iter)
    print(table(res))
    ratio = {k: round(v["uncompressed_bytes"] / v["bytes_per_step"], 1) for k, v in res.items()}
    about = {"command": "python -m benchmarks.compression " + " ".join(argv if argv is not None else sys.argv[1:]),
             "model": "small_cnn width 32, hidden 256 (871k parameters)", "ranks": 2,
             "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
             "whole_run_compression": ratio,
             "note": "bytes_per_step averages the whole run, including PowerSGD's plain all-reduce "
                     "warm-up (start_iter steps); bytes_per_step_steady is after it"}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"_about": about, **res}, indent=2, sort_keys=True) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
