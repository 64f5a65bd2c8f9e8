"""(c) of ``benchmarks.gpu``: time to 93% test accuracy on Fashion-MNIST on one GPU, Sluice's default
recipe against the strong plain baseline (``benchmarks/baselines/plain_bn_cnn.py --device cuda``),
each in a fresh process timed from its start, as ``benchmarks.time_to_accuracy`` does on CPU.

The Sluice arm runs the pipeline's stages without Prefect (the GPU image has none): shard all
70,000 images, then the default ``PipelineConfig`` as ``training_job`` builds it, on one torchrun
rank on the GPU (``train.device: cuda``; the loader on the GPU too, so augmentation runs there),
evaluating on the test split once an epoch.

    python -m benchmarks.gpu_tta EPOCHS SEED     # one Sluice run; prints one JSON line
"""
from __future__ import annotations

import time

START = time.time()  # before any import: the run pays its own start-up

import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

TARGET = 0.93
TRAIN_SOURCE = 60_000


def sluice_once(epochs: float, seed: int, batch_size: int | None = None) -> dict[str, Any]:
    from sluice.flows.pipeline import PipelineConfig, prepare_data, training_job
    from sluice.stages.run.launch import launch
    root = Path(tempfile.mkdtemp(prefix="sluice-gpu-tta-"))
    try:
        c = PipelineConfig.model_validate({
            "data_root": str(root), "nproc": 1,
            "train": {"epochs": epochs, "seed": seed, "device": "cuda", "progress": False,
                      **({"batch_size": batch_size} if batch_size else {})},
            "data": {"loader": {"seed": seed, "device": "cuda", "sampler": {"seed": seed}},
                     "shard": {"progress": False}},
            "selection": {"seed": seed}})
        data = prepare_data(c)  # the default recipe's one source, under datasets/fashion-mnist
        c.train.eval_every_steps = max(1, data.counts["train"] // c.train.batch_size)
        job = training_job(c, data, None)
        r = launch(job, nproc=1, out_dir=root / "run", timeout_s=c.train_timeout_s)
        evals = [{"step": e["step"], "acc": e["acc"], "wall_s": e["wall_time"] - START} for e in r.evals]
        return {"evals": evals, "wall_s": time.time() - START, "final_acc": r.final_acc,
                "amp": r.summary.get("amp"), "loader": r.summary.get("loader"),
                "data_wait_frac": r.summary.get("data_wait_frac"),
                "shard_s": sum(v.seconds for v in data.sources),
                "batch_size": c.train.batch_size, "steps": max((e["step"] for e in r.evals), default=None),
                "seconds_per_step": r.summary.get("seconds_per_step"), "host": r.summary.get("host"),
                "train_elapsed_s": r.summary.get("elapsed_s")}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_sluice(epochs: float, seed: int, batch_size: int | None = None) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "benchmarks.gpu_tta", str(epochs), str(seed),
                          *([str(batch_size)] if batch_size else [])], capture_output=True,
                         text=True, timeout=3600, cwd=Path(__file__).resolve().parents[1])
    if out.returncode != 0:
        raise RuntimeError(f"sluice run failed:\n{out.stderr[-3000:]}")
    return json.loads([x for x in out.stdout.splitlines() if x.startswith('{"evals"')][-1])


def time_to_accuracy(quick: bool) -> dict[str, Any]:
    """Each arm once per seed (interleaved) at a fixed budget: the plain baseline at 6 epochs (its
    CPU sweep's budget for 93%), Sluice's default at its own 5.5."""
    from benchmarks.time_to_accuracy import run_baseline, seconds_to, summarize
    seeds = [0] if quick else [0, 1, 2]
    arms: dict[str, dict[str, Any]] = {"baseline": {"epochs": 6.0, "runs": []}, "sluice": {"epochs": 5.5, "runs": []}}
    for seed in seeds:
        for arm, a in arms.items():
            r = (run_baseline(a["epochs"], seed, threads=4, channels_last=True, amp="bf16",
                              extra=("--device", "cuda")) if arm == "baseline" else run_sluice(a["epochs"], seed))
            r.update(seed=seed, seconds_to_93=seconds_to(r["evals"], TARGET))
            a["runs"].append(r)
            print(f"  (c) {arm} seed {seed}: final {r['final_acc']:.4f}, 93% at {r['seconds_to_93']} s", flush=True)
    for a in arms.values():
        a["summary"] = summarize([r["seconds_to_93"] for r in a["runs"]])
    b, s = arms["baseline"]["summary"]["median"], arms["sluice"]["summary"]["median"]
    return {"target": TARGET, "seeds": seeds, "arms": arms, "sluice_vs_baseline": s / b if b and s else None}


if __name__ == "__main__":
    print(json.dumps(sluice_once(float(sys.argv[1]), int(sys.argv[2]),
                                 int(sys.argv[3]) if len(sys.argv) > 3 else None)), flush=True)
