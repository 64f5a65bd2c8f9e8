"""Does the default recipe learn on a tiny budget? The deployment test's config (1,500 samples,
RHO-LOSS with a one-epoch IL model, 20 steps of 32 per rank on 2 ranks, PowerSGD from step 5),
with the default recipe's lr, schedule and EMA, run as the nightly flow in a fresh process per
seed. The deployment test's threshold (``tests/test_prefect_deploy.py``) is set well under the
lowest validation accuracy here, on each host class.

    python -m benchmarks.tiny_budget [--quick] [--seeds 0 1 2 3 4] [--set train.KEY=VALUE ...]

Writes benchmarks/results/tiny_budget-<host class>.json (quick: ..._quick.json, 2 seeds). To
measure the AVX2 class on a newer CPU: ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``
(recorded as simulated).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import table, write_result
from benchmarks.hostinfo import class_of, describe_run, load_average, results_name
from benchmarks.results_page import _pct, provenance

# The deployment test's config (tests/test_prefect_deploy.py::_tiny), minus its data root.
TINY: dict[str, Any] = {
    "data": {"ingest": {"limit": 1500}, "shard": {"shard_samples": 500, "workers": 1, "progress": False}},
    "selection": {"method": "rho_loss", "ratio": 0.5, "il": {"epochs": 1}},
    "train": {"max_steps": 20, "batch_size": 32, "comm": {"mode": "powersgd", "params": {"start_iter": 5}}},
    "promotion": {"margin": 0.05}, "nproc": 2}

RUN = """
import json, sys
import sluice.flows.nightly as fl
from sluice.flows.pipeline import PipelineConfig
r = fl.nightly(PipelineConfig.model_validate(json.loads(sys.argv[1])))
p = r["promotion"]
print("RESULT " + json.dumps({"val_acc": p["candidate_value"], "test_acc": p["report"]["acc"],
                              "host": r["train"]["summary"].get("host")}))
"""


def config(root: Path, seed: int, overrides: list[str]) -> dict[str, Any]:
    from sluice.flows.config import apply_overrides  # the CLI's --set
    return apply_overrides(TINY, [f"data_root={root}", f"train.seed={seed}", *overrides])


def one(seed: int, overrides: list[str]) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="sluice-bench-tiny-"))
    try:
        out = subprocess.run([sys.executable, "-c", RUN, json.dumps(config(root, seed, overrides))],
                             capture_output=True, text=True, timeout=900)
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        if out.returncode != 0 or line is None:
            raise RuntimeError(f"seed {seed} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
        return {"seed": seed, **json.loads(line[len("RESULT "):])}
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------ its section of docs/results.md

def results_section(d: dict[str, Any], name: str) -> list[str]:
    runs = d["runs"]
    return [f"#### A tiny budget learns ({class_of(d)})", "",
            "The deployment test's config (1,500 samples, RHO-LOSS, 20 steps of 32 per rank on 2 ranks) "
            f"with the default recipe: validation accuracy median {_pct(d['median_val_acc'])} "
            f"({_pct(d['min_val_acc'])}–{_pct(d['max_val_acc'])}, seeds {', '.join(str(r['seed']) for r in runs)}), test "
            f"{_pct(d['median_test_acc'])}; chance is 10%. Trained as: {runs[0].get('host') or 'not recorded'}.",
            "", provenance(d, name)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="seeds 0 and 1 only")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="as sluice's --set, e.g. train.warmup_min_steps=50")
    args = ap.parse_args(argv)
    about = describe_run("benchmarks.tiny_budget", argv)
    seeds = [0, 1] if args.quick else args.seeds
    runs = []
    for s in seeds:
        runs.append(one(s, args.overrides))
        print(f"  seed {s}: val {runs[-1]['val_acc']:.4f}, test {runs[-1]['test_acc']:.4f} "
              f"({runs[-1]['host']})", flush=True)
    vals = [r["val_acc"] for r in runs]
    summary = {"median_val_acc": statistics.median(vals), "min_val_acc": min(vals), "max_val_acc": max(vals),
               "median_test_acc": statistics.median(r["test_acc"] for r in runs)}
    print(table([{"host class": about["host_class"], "seeds": len(runs), "median val": summary["median_val_acc"],
                  "min val": summary["min_val_acc"], "max val": summary["max_val_acc"],
                  "median test": summary["median_test_acc"]}],
                ["host class", "seeds", "median val", "min val", "max val", "median test"]))
    result = {**about, "mode": "quick" if args.quick else "full", "config": TINY, "seeds": seeds,
              "overrides": args.overrides, "runs": runs, **summary, "load_average_end": load_average()}
    name = results_name("tiny_budget") + ("_quick" if args.quick else "")
    print(f"wrote {write_result(name, result)}")
    return result


if __name__ == "__main__":
    main()
