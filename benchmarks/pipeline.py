"""The full nightly pipeline on Fashion-MNIST: wall time per stage, test accuracy, the cost of
orchestration, and time to 93% test accuracy against a plain hand-written PyTorch loop.

Three runs in one process, on the same data and model family:
  1. baseline: one process, uniform shuffling, a plain loop (decoded arrays, flip+translate,
     SGD + one-cycle), evaluated on the test split as it trains;
  2. sluice direct: the pipeline's stages called directly (shard → IL scores where the method
     needs them → torchrun training with the selection method and PowerSGD on 2 ranks →
     evaluate), no Prefect;
  3. sluice via Prefect: the `nightly-retrain` flow (embedded local API, started beforehand so
     its ~20 s start-up is reported on its own line, not as orchestration overhead).
Runs 1 and 2 train in alternating chunks (``--chunk-steps``, default 200): the pipeline halts
at a checkpoint (exact resume, selector state included), the plain loop trains as many steps,
and so on. This host's speed drifts by 15-45% over minutes (same work, same code), more than
the effects measured here, so only training clocks that share the same minutes compare.
Orchestration overhead (goal ≤ 5%) is measured inside the Prefect run, free of that drift: the
flow's wall minus the stage calls timed inside its tasks (task and flow bookkeeping, caching,
result persistence, the report), plus every CPU-second Prefect's processes took beside the
stages (its API server, and the flow process beyond what the direct run's used), each counted as
a second lost; over the stages' own time. (Prefect's training clock against the direct one is
printed too: identical work minutes apart, it is a measure of the drift.)
Goal: ≥ 93% test accuracy, reached in less wall time than the baseline; sluice's time is the
direct run's (shard + IL + training clock) plus the attributable orchestration overhead.

    python -m benchmarks.pipeline [--quick]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from benchmarks.common import table, write_result

TARGET = 0.93


def pipeline_config(root: Path, quick: bool, selection: str = "rho_loss",
                    epochs: float | None = None, resolution: str | None = None) -> dict[str, Any]:
    """The demo's pipeline with a budget for 93%: SmallCNN with the dense head (871k parameters,
    the shape PowerSGD is for), ``amp: auto`` (bf16 only where the CPU has it) + channels-last,
    RHO-LOSS at 50% (or another ``selection`` method), PowerSGD rank 2, and progressive resizing when ``resolution`` is
    ``"START:END_EPOCH"`` (side START px rising to the stored 28 px at END_EPOCH). The baseline
    trains the same model for as many epochs at full size."""
    epochs = epochs or (1.5 if quick else 12)
    loader: dict[str, Any] = {}
    if resolution:
        start, end_epoch = (int(v) for v in resolution.split(":"))
        if quick:  # 1.5 epochs: the ramp must end within the first
            end_epoch = min(end_epoch, 1)
        loader["resolution"] = {"start": start, "end": 28, "end_epoch": end_epoch}
    return {
        "data_root": str(root),
        "loader": loader,
        "prepare": {"ingest": {"limit": 20000 if quick else None}, "shard": {"progress": False}},
        "selection": {"method": selection, "ratio": 0.5, "il": {"epochs": 3 if quick else 10}},
        "augment": {"ops": [{"op": "translate", "pad": 2}, {"op": "flip"}]},
        "train": {"model": "small_cnn", "model_kwargs": {"width": 32, "hidden": 256}, "epochs": epochs,
                  "batch_size": 128, "lr": 0.1, "schedule": "onecycle", "amp": "auto", "channels_last": True,
                  "label_smoothing": 0.05, "normalize_mean": [0.2860], "normalize_std": [0.3530],
                  "comm": {"mode": "powersgd", "powersgd_rank": 2, "start_iter": 20},
                  "eval_every_steps": 40 if quick else 100, "progress": False},
        "nproc": 2,
    }


def time_to(evals: list[dict[str, Any]], target: float, offset: float = 0.0) -> float | None:
    """Seconds (training clock plus ``offset`` for earlier stages) at the first eval ≥ target."""
    for e in evals:
        if e["acc"] >= target:
            return offset + e["elapsed_s"]
    return None


# ------------------------------------------------------------------ 1. the baseline
class PlainLoop:
    """What a user writes by hand: arrays in RAM, uniform shuffle, one process, same model family.
    A stepper (``run_until``), so its training can alternate with the pipeline's in chunks."""

    def __init__(self, cfg: dict[str, Any], artifact_root: str):
        import torch
        from sluice.stages.load import split_arrays
        from sluice.stages.models import build_model
        from sluice.stages.compute import resolve_amp
        self.t = t = cfg["train"]
        torch.manual_seed(0)
        x, y = split_arrays(artifact_root, "train")
        tx, ty = split_arrays(artifact_root, "test")
        mean, std = t["normalize_mean"][0], t["normalize_std"][0]
        self.X = torch.from_numpy(x).permute(0, 3, 1, 2).float().div_(255).sub_(mean).div_(std)
        self.Y = torch.from_numpy(y)
        self.TX = torch.from_numpy(tx).permute(0, 3, 1, 2).float().div_(255).sub_(mean).div_(std)
        self.TY = torch.from_numpy(ty)
        self.model = build_model(t["model"], 1, 10, **t["model_kwargs"])
        self.bf16 = resolve_amp(t["amp"]) == "bf16"  # the pipeline's precision, as it resolves here
        if t["channels_last"]:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.bs = t["batch_size"] * cfg["nproc"]  # the same global batch as the 2-rank run
        self.steps = int(math.ceil(t["epochs"] * len(self.Y) / self.bs))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=t["lr"], momentum=0.9, nesterov=True,
                                   weight_decay=5e-4)
        self.sched = torch.optim.lr_scheduler.OneCycleLR(self.opt, max_lr=t["lr"], total_steps=self.steps,
                                                         pct_start=0.1)
        self.evals: list[dict[str, Any]] = []
        self.elapsed, self.step = 0.0, 0
        self.rng = np.random.default_rng(0)
        self._batches = self._epochs()

    def _epochs(self):
        while True:
            yield from np.array_split(self.rng.permutation(len(self.Y)), len(self.Y) // self.bs)

    def run_until(self, step: int | None = None) -> None:
        """Train to ``step`` (default: the whole budget), evaluating every ``eval_every_steps``."""
        import torch
        import torch.nn.functional as F
        torch.set_num_threads(os.cpu_count() or 1)
        t, model = self.t, self.model
        stop = min(step or self.steps, self.steps)
        while self.step < stop:
            idx = next(self._batches)
            t0 = time.perf_counter()
            xb, yb = self.X[idx], self.Y[idx]
            flip = torch.rand(len(idx)) < 0.5
            xb[flip] = xb[flip].flip(-1)
            xb = torch.roll(xb, shifts=(int(self.rng.integers(-2, 3)), int(self.rng.integers(-2, 3))), dims=(2, 3))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
                loss = F.cross_entropy(model(xb).float(), yb, label_smoothing=t["label_smoothing"])
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            self.sched.step()
            self.step += 1
            self.elapsed += time.perf_counter() - t0
            if self.step % t["eval_every_steps"] == 0 or self.step == self.steps:
                model.eval()
                with torch.no_grad():
                    acc = sum(int((model(self.TX[k:k + 2000]).argmax(1) == self.TY[k:k + 2000]).sum())
                              for k in range(0, len(self.TY), 2000)) / len(self.TY)
                model.train()
                self.evals.append({"step": self.step, "elapsed_s": self.elapsed, "acc": acc})

    def result(self) -> dict[str, Any]:
        return {"seconds": self.elapsed, "test_acc": self.evals[-1]["acc"], "evals": self.evals,
                "seconds_to_target": time_to(self.evals, TARGET)}


# ------------------------------------------------------------------ 2. stages without Prefect
def direct(cfg: dict[str, Any], chunk_steps: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """The stages called in turn; returns (pipeline, baseline) results. With ``chunk_steps``
    the pipeline's training halts every ``chunk_steps`` steps (checkpoint, exact resume) and the
    plain loop trains as many steps in between, so both training clocks see the same stretch of
    the host's speed; without, the plain loop runs after the pipeline."""
    from sluice.flows.pipeline import PipelineConfig, dataset_info, training_job
    from sluice.stages.train.evaluate import evaluate_checkpoint
    from sluice.stages.train.launch import launch
    from sluice.stages.load import split_arrays
    from sluice.stages.select.il_model import irreducible_loss_scores
    from sluice.stages.data.shard import shard_dataset
    c = PipelineConfig.model_validate(cfg)
    sec: dict[str, float] = {}
    cpu0 = _cpu(psutil.Process())
    t0 = time.perf_counter()
    s = shard_dataset(c.prepare.ingest, c.dataset_dir(), c.prepare.shard)
    sec["shard"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    il_path = None
    if c.selection.method == "rho_loss":  # as the flow: the IL model only where it is used
        hx, hy = split_arrays(s.root, "holdout")
        tx, ty = split_arrays(s.root, "train")
        il_path = irreducible_loss_scores(c.selection.il, hx, hy, tx, ty, s.manifest.fingerprint,
                                          c.scores_dir()).path
    sec["irreducible_loss"] = time.perf_counter() - t1
    job = training_job(c, dataset_info(s), il_path)
    c0 = _cpu(psutil.Process())
    base = PlainLoop(cfg, s.root)
    train_s, launches, k, base_cpu = 0.0, 0, 0, _cpu(psutil.Process()) - c0
    while True:
        k += 1
        halt = k * chunk_steps if chunk_steps else None
        t2 = time.perf_counter()
        result = launch(job.model_copy(update={"config": job.config.model_copy(update={"halt_at_step": halt})}),
                        nproc=c.nproc, out_dir=str(c.runs_dir() / "direct"))
        train_s += time.perf_counter() - t2
        launches += 1
        if not result.halted:
            break
        c0 = _cpu(psutil.Process())
        base.run_until(result.steps)
        base_cpu += _cpu(psutil.Process()) - c0
    sec["train"] = train_s
    c0 = _cpu(psutil.Process())
    base.run_until()
    base_cpu += _cpu(psutil.Process()) - c0
    t3 = time.perf_counter()
    acc = evaluate_checkpoint(result.checkpoint, s.root, "test")["acc"]
    sec["evaluate"] = time.perf_counter() - t3
    pipeline_cpu = _cpu(psutil.Process()) - cpu0 - base_cpu  # this process's share of the stages
    before_train = sec["shard"] + sec["irreducible_loss"]
    return {"seconds_per_stage": sec, "seconds": sum(sec.values()), "test_acc": acc, "evals": result.evals,
            "cpu_seconds": {"flow_process": pipeline_cpu}, "launches": launches,
            "train_clock_s": result.evals[-1]["elapsed_s"] if result.evals else None,
            "epochs": c.train.epochs, "summary": result.summary,
            "artifact": s.root, "seconds_to_target": time_to(result.evals, TARGET, before_train),
            "seconds_to_target_wall": time_to(result.evals, TARGET, before_train + _startup(sec["train"], result.evals))}, \
        base.result()


# ------------------------------------------------------------------ 3. through Prefect
def via_prefect(cfg: dict[str, Any]) -> dict[str, Any]:
    import sluice.flows.nightly as fl
    server, me = _api_server(), psutil.Process()
    cpu0 = (_cpu(server), _cpu(me))
    t0 = time.perf_counter()
    r = fl.nightly(cfg)
    wall = time.perf_counter() - t0
    cpu = {"api_server": _cpu(server) - cpu0[0], "flow_process": _cpu(me) - cpu0[1]}
    il = r.get("il") or {}
    sec = {"shard": r["dataset"]["seconds"], "irreducible_loss": il.get("wall_s", 0.0),
           "train": r["train"]["wall_s"], "evaluate": r["promotion"]["wall_s"]}
    evals = json.loads(json.dumps([json.loads(line)["eval"] for line in
                                   Path(r["train"]["metrics_path"]).read_text().splitlines() if '"eval"' in line]))
    return {"seconds_per_stage": sec, "seconds": wall, "test_acc": r["promotion"]["candidate_value"],
            "evals": evals, "cpu_seconds": cpu, "summary": r["train"].get("summary") or {}, "seconds_to_target": time_to(evals, TARGET, sec["shard"] + sec["irreducible_loss"]),
            "seconds_to_target_wall": time_to(evals, TARGET, sec["shard"] + sec["irreducible_loss"]
                                              + _startup(sec["train"], evals))}


def _cpu(p: "psutil.Process | None") -> float:
    """User + system CPU seconds of one process (all its threads; not its children)."""
    if p is None:
        return 0.0
    t = p.cpu_times()
    return t.user + t.system


def _api_server() -> "psutil.Process | None":
    """The embedded Prefect API server: this process's uvicorn child, once it has started."""
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "uvicorn" in " ".join(child.cmdline()):
                return child
    return None


def attributable_overhead(prefect: dict[str, Any], direct: dict[str, Any]) -> dict[str, float]:
    """What Prefect adds, measured inside its own run (see the module docstring): over the time
    the same stages took inside its tasks."""
    stages = sum(prefect["seconds_per_stage"].values())
    outside = prefect["seconds"] - stages
    cpu = prefect["cpu_seconds"]
    extra_cpu = cpu.get("api_server", 0.0) + max(0.0, cpu["flow_process"] - direct["cpu_seconds"]["flow_process"])
    return {"outside_stages_s": outside, "prefect_cpu_s": extra_cpu, "stages_s": stages,
            "overhead": (max(0.0, outside) + extra_cpu) / stages}


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.0f} s"


def _startup(train_wall: float, evals: list[dict[str, Any]]) -> float:
    """Train-stage time outside the training clock (torchrun start, imports, decoding the split,
    the final evaluation), all charged before the first step: an upper bound for the wall clock."""
    return max(0.0, train_wall - (evals[-1]["elapsed_s"] if evals else 0.0))


def start_embedded_api() -> float:
    """Start Prefect's embedded server with a trivial flow; return how long that took."""
    import sluice.flows  # noqa: F401  (its environment defaults must precede Prefect's import)
    from prefect import flow

    @flow(name="warm-up")
    def warm() -> int:
        return 1
    t = time.perf_counter()
    warm()
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="20k samples, 1.5 epochs (about 3-5 minutes here)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary data directory")
    ap.add_argument("--selection", default="rho_loss",
                    choices=["rho_loss", "loss", "selective_backprop", "importance", "infobatch", "none"],
                    help="the pipeline's selection method (default rho_loss, as in the demo)")
    ap.add_argument("--epochs", type=float, help="training epochs for every run (default 12; quick 1.5)")
    ap.add_argument("--resolution", default="none", metavar="START:END_EPOCH",
                    help="progressive resizing in the pipeline: START px rising to 28 px by END_EPOCH, "
                         "e.g. 20:5 (default none: full size throughout; on 28 px Fashion-MNIST "
                         "20:5, 20:8 and 24:6 each cost ~0.6 points of test accuracy, see README)")
    ap.add_argument("--prune", type=float, default=0.5,
                    help="infobatch: probability of skipping a well-learnt sample (default 0.5)")
    ap.add_argument("--chunk-steps", type=int, default=None,
                    help="alternate the pipeline's and the plain loop's training every N steps so "
                         "both see the same stretch of a noisy host (default 200; quick 40; 0 = "
                         "one after the other)")
    args = ap.parse_args(argv)
    res = None if args.resolution in ("none", "") else args.resolution
    chunk = args.chunk_steps if args.chunk_steps is not None else (40 if args.quick else 200)

    def config(root: Path) -> dict[str, Any]:
        cfg = pipeline_config(root, args.quick, args.selection, args.epochs, res)
        if args.selection == "infobatch":
            cfg["selection"]["prune"] = args.prune
        return cfg
    os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="sluice-bench-prefect-"))
    tmp = Path(tempfile.mkdtemp(prefix="sluice-bench-pipeline-"))
    try:
        d, b = direct(config(tmp / "direct"), chunk)
        print(f"direct: {d['seconds']:.1f} s ({d['launches']} launches), test acc {d['test_acc']:.4f}; "
              f"baseline: {b['seconds']:.1f} s, test acc {b['test_acc']:.4f}", flush=True)
        startup = start_embedded_api()
        p = via_prefect(config(tmp / "prefect"))
        print(f"prefect: {p['seconds']:.1f} s, test acc {p['test_acc']:.4f}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    attributable = attributable_overhead(p, d)
    p_clock = p["evals"][-1]["elapsed_s"] if p["evals"] else None
    rows = [{"run": "baseline (plain loop, 1 process)", "seconds": b["seconds"], "test_acc": b["test_acc"],
             "seconds_to_93": b["seconds_to_target"], "train": b["seconds"]},
            {"run": "sluice direct (no Prefect)", "seconds": d["seconds"], "test_acc": d["test_acc"],
             "seconds_to_93": d["seconds_to_target"], **d["seconds_per_stage"], "train_clock": d["train_clock_s"]},
            {"run": "sluice via Prefect", "seconds": p["seconds"], "test_acc": p["test_acc"],
             "seconds_to_93": p["seconds_to_target"], **p["seconds_per_stage"], "train_clock": p_clock}]
    print(table(rows, ["run", "seconds", "test_acc", "seconds_to_93", "shard", "irreducible_loss", "train",
                       "train_clock", "evaluate"]))
    print(f"\nembedded Prefect API start-up: {startup:.1f} s (once per process; none with a running server)")
    print(f"orchestration overhead, attributable: {100 * attributable['overhead']:.1f}% (goal <= 5%): "
          f"{attributable['outside_stages_s']:.1f} s outside the stages + {attributable['prefect_cpu_s']:.1f} "
          f"CPU-s of Prefect's processes, over the stages' {attributable['stages_s']:.0f} s")
    if d["train_clock_s"] and p_clock:
        print(f"the same training steps took {p_clock / d['train_clock_s']:.2f}x as long in the Prefect run as "
              "in the direct one (minutes apart: the host's run-to-run noise, not Prefect's work)")
    interleaved = bool(chunk) and d["launches"] > 1
    sluice = d["seconds_to_target"] * (1 + attributable["overhead"]) if d["seconds_to_target"] else None
    goal = sluice is not None and (b["seconds_to_target"] is None or sluice < b["seconds_to_target"])
    print(f"time to {TARGET:.0%}: sluice {_s(sluice)} (direct {_s(d['seconds_to_target'])}, shard + IL + "
          f"training clock, plus Prefect's attributable overhead), plain loop {_s(b['seconds_to_target'])}"
          f"{', interleaved every %d steps' % chunk if interleaved else ''} -> {'MET' if goal else 'NOT MET'}")
    print(f"  the Prefect run on its own clock: {_s(p['seconds_to_target'])}; counting start-up as training "
          f"(upper bound): {_s(p['seconds_to_target_wall'])}")
    result = {"mode": "quick" if args.quick else "full", "selection": args.selection,
              "prune": args.prune if args.selection == "infobatch" else None,
              "resolution": res, "chunk_steps": chunk if interleaved else 0,
              "epochs": d["epochs"],
              "seconds_per_stage": p["seconds_per_stage"],
              "seconds_per_stage_direct": d["seconds_per_stage"], "test_acc": p["test_acc"],
              "direct_test_acc": d["test_acc"],
              "seconds_to_93": sluice, "baseline_seconds_to_93": b["seconds_to_target"],
              "direct_seconds_to_93": d["seconds_to_target"],
              "prefect_run_seconds_to_93": p["seconds_to_target"],
              "seconds_to_93_wall_upper_bound": p["seconds_to_target_wall"],
              "baseline_test_acc": b["test_acc"], "orchestration_overhead": attributable["overhead"],
              "orchestration_detail": attributable,
              "train_clock_s": {"baseline": b["seconds"], "direct": d["train_clock_s"], "prefect": p_clock},
              "selection_trained_fraction": p["summary"].get("selection_trained_fraction"),  # one launch: whole run
              "cpu_seconds": {"direct": d["cpu_seconds"], "prefect": p["cpu_seconds"]},
              "prefect_startup_seconds": startup, "direct_seconds": d["seconds"], "prefect_seconds": p["seconds"],
              "baseline_seconds": b["seconds"], "goal_93_faster_than_baseline": goal,
              "evals": {"baseline": b["evals"], "direct": d["evals"], "prefect": p["evals"]}}
    print(f"wrote {write_result('pipeline', result)}")
    return result


if __name__ == "__main__":
    main()
