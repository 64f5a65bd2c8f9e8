"""The nightly pipeline per stage, and what orchestrating it with Prefect costs.

Two runs of the default pipeline on the same data, in one process:
  1. direct: the stages called in turn (shard → IL scores where the method needs them →
     torchrun training → evaluation), no Prefect;
  2. via Prefect: the ``nightly-retrain`` flow (embedded local API, started beforehand so its
     ~20 s start-up is reported on its own line, not as overhead).
Orchestration overhead (goal ≤ 5%) is measured inside the Prefect run, free of this host's drift
(15-45% over minutes): the flow's wall minus the stage calls timed inside its tasks (task and
flow bookkeeping, caching, result persistence, the report), plus every CPU-second Prefect's
processes took beside the stages (its API server, and the flow process beyond what the direct
run's used), each counted as a second lost; over the stages' own time. Time to accuracy against
a plain-PyTorch recipe is ``benchmarks.time_to_accuracy``'s job.

    python -m benchmarks.pipeline [--quick]

Writes benchmarks/results/pipeline.json (quick: pipeline_quick.json).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from benchmarks.common import table, write_result
from benchmarks.hostinfo import describe_run, load_average


def pipeline_config(root: Path, quick: bool) -> dict[str, Any]:
    """The default pipeline on a fresh data root (quick: 20k samples a split, one epoch)."""
    cfg: dict[str, Any] = {"data_root": str(root), "data": {"shard": {"progress": False}},
                           "train": {"progress": False}}
    if quick:
        cfg["data"]["ingest"] = {"limit": 20000}
        cfg["train"]["epochs"] = 1
    return cfg


def direct(cfg: dict[str, Any]) -> dict[str, Any]:
    """The stages called in turn, timed one by one."""
    from sluice.flows.pipeline import PipelineConfig, prepare_data, training_job
    from sluice.stages.load import split_arrays
    from sluice.stages.select.il_model import irreducible_loss_scores
    from sluice.stages.train.evaluate import evaluate_checkpoint
    from sluice.stages.run.launch import launch
    c = PipelineConfig.model_validate(cfg)
    sec: dict[str, float] = {}
    cpu0 = _cpu(psutil.Process())
    t0 = time.perf_counter()
    version = prepare_data(c)  # the recipe's one source, sharded into datasets/<its name>
    sec["shard"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    il_path = None
    if c.selection.needs_il:  # as the flow: the IL model only where it is used
        hx, hy = split_arrays(version.root, "holdout", live_only=True)
        tx, ty = split_arrays(version.root, "train")
        il_path = irreducible_loss_scores(c.selection.il, hx, hy, tx, ty, version.fingerprint,
                                          c.scores_dir()).path
    sec["irreducible_loss"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    result = launch(training_job(c, version, il_path), nproc=c.ranks(),
                    out_dir=str(c.runs_dir() / "direct"), on_line=lambda line: None)
    sec["train"] = time.perf_counter() - t2
    t3 = time.perf_counter()
    acc = evaluate_checkpoint(result.checkpoint, version.root, c.promotion.report_split)["acc"]
    sec["evaluate"] = time.perf_counter() - t3
    return {"seconds_per_stage": sec, "seconds": sum(sec.values()), "test_acc": acc,
            "cpu_seconds": {"flow_process": _cpu(psutil.Process()) - cpu0},
            "train_clock_s": result.evals[-1]["elapsed_s"] if result.evals else None}


def via_prefect(cfg: dict[str, Any]) -> dict[str, Any]:
    import sluice.flows.nightly as fl
    server, me = _api_server(), psutil.Process()
    cpu0 = (_cpu(server), _cpu(me))
    t0 = time.perf_counter()
    r = fl.nightly(cfg)
    wall = time.perf_counter() - t0
    cpu = {"api_server": _cpu(server) - cpu0[0], "flow_process": _cpu(me) - cpu0[1]}
    il = r.get("il") or {}
    sec = {"shard": sum(v.seconds for v in r["dataset"].sources), "irreducible_loss": il.get("wall_s", 0.0),
           "train": r["train"]["wall_s"], "evaluate": r["promotion"]["wall_s"]}
    evals = [json.loads(line)["eval"] for line in
             Path(r["train"]["metrics_path"]).read_text().splitlines() if '"eval"' in line]
    return {"seconds_per_stage": sec, "seconds": wall, "test_acc": r["promotion"]["report"]["acc"],
            "cpu_seconds": cpu, "train_clock_s": evals[-1]["elapsed_s"] if evals else None}


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
    ap.add_argument("--quick", action="store_true", help="20k samples a split, one epoch (~3-5 min)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary data directory")
    args = ap.parse_args(argv)
    about = describe_run("benchmarks.pipeline", argv)
    os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="sluice-bench-prefect-"))
    tmp = Path(tempfile.mkdtemp(prefix="sluice-bench-pipeline-"))
    try:
        d = direct(pipeline_config(tmp / "direct", args.quick))
        startup = start_embedded_api()
        p = via_prefect(pipeline_config(tmp / "prefect", args.quick))
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    over = attributable_overhead(p, d)
    rows = [{"run": name, "seconds": r["seconds"], "test_acc": r["test_acc"], **r["seconds_per_stage"],
             "train_clock": r["train_clock_s"]} for name, r in (("direct (no Prefect)", d), ("via Prefect", p))]
    print(table(rows, ["run", "seconds", "test_acc", "shard", "irreducible_loss", "train", "train_clock",
                       "evaluate"]))
    print(f"\nembedded Prefect API start-up: {startup:.1f} s (once per process; none with a running server)")
    print(f"orchestration overhead, attributable: {100 * over['overhead']:.1f}% (goal <= 5%): "
          f"{over['outside_stages_s']:.1f} s outside the stages + {over['prefect_cpu_s']:.1f} CPU-s of "
          f"Prefect's processes, over the stages' {over['stages_s']:.0f} s")
    result = {**about, "mode": "quick" if args.quick else "full", "direct": d, "prefect": p,
              "prefect_startup_seconds": startup, "orchestration_overhead": over["overhead"],
              "orchestration_detail": over, "goal_overhead_at_most_5pct": over["overhead"] <= 0.05,
              "load_average_end": load_average()}
    print(f"wrote {write_result('pipeline_quick' if args.quick else 'pipeline', result)}")
    return result


if __name__ == "__main__":
    main()
