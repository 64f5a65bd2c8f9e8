"""Which rank layout and per-rank batch train fastest on this host class: the default recipe's
trainer (bn_cnn, the class's precision, channels-last, no selection) under torchrun, for each
layout ``ranks x threads, batch per rank``, timed per optimizer step, layouts interleaved over
rounds (this host's speed drifts 15-45% over minutes). Throughput only: a layout that changes the
global batch changes accuracy per sample too, which ``benchmarks.time_to_accuracy`` measures.

    python -m benchmarks.host_layout [--quick] [--rounds 3]

Writes benchmarks/results/host_layout-<host class>.json (quick: ..._quick.json). To measure the
AVX2 class on a newer CPU: ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` (recorded as
simulated).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import table, write_result
from benchmarks.hostinfo import class_of, describe_run, load_average, results_name
from benchmarks.results_page import provenance

# (ranks, threads per rank, batch per rank) on a 2-core host; the first is today's default
LAYOUTS = [(2, 1, 64), (2, 1, 128), (1, 2, 128), (1, 2, 256)]


def one(c_base: dict[str, Any], data: Any, layout: tuple[int, int, int], samples: int,
        out: Path) -> dict[str, Any]:
    from sluice.flows.pipeline import PipelineConfig, training_job
    from sluice.stages.run.launch import launch
    ranks, threads, batch = layout
    steps = max(20, samples // (ranks * batch))
    c = PipelineConfig.model_validate({**c_base, "nproc": ranks, "selection": {"method": "none"},
                                       "train": {"batch_size": batch, "torch_threads": threads,
                                                 "max_steps": steps, "ema_decay": None,
                                                 "progress": False}})
    job = training_job(c, data, None)
    job = job.model_copy(update={"eval_data": None})
    launch(job, nproc=ranks, out_dir=str(out), on_line=lambda line: None)
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [r["samples_per_s"] for r in recs if "samples_per_s" in r][5:]  # past the warm-up
    return {"layout": f"{ranks}x{threads}, {batch}/rank", "ranks": ranks, "threads": threads,
            "batch_per_rank": batch, "steps": steps, "samples_per_s": statistics.median(rates)}


# ------------------------------------------------------------------ its section of docs/results.md

def results_section(d: dict[str, Any], name: str) -> list[str]:
    lines = [f"#### Trainer throughput per rank layout ({class_of(d)})", "",
             "| ranks x threads, batch per rank | samples/s: median (min–max) |", "|---|---|"]
    for row in d["summary"]:
        lines.append(f"| {row['layout']} | {row['median samples/s']:,.0f} ({row['min']:,.0f}–{row['max']:,.0f}) |")
    return lines + ["", provenance(d, name)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 round of 3,000 samples a layout")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=12800, help="trained samples per layout and round")
    args = ap.parse_args(argv)
    from sluice.flows.pipeline import PipelineConfig
    from sluice.stages.data.config import IngestConfig, ShardConfig
    from sluice.stages.data.shard import shard_dataset
    about = describe_run("benchmarks.host_layout", argv)
    rounds, samples = (1, 3000) if args.quick else (args.rounds, args.samples)
    tmp = Path(tempfile.mkdtemp(prefix="sluice-bench-layout-"))
    try:
        s = shard_dataset(IngestConfig(limit=20000), tmp / "data", ShardConfig(progress=False))
        base = {"data_root": str(tmp)}
        data = PipelineConfig.model_validate(base).kind().version_of([s.root], names=["fashion-mnist"])
        runs = []
        for r in range(rounds):
            for i, layout in enumerate(LAYOUTS):
                rec = one(base, data, layout, samples, tmp / f"run-{r}-{i}")
                print(f"  round {r}: {rec['layout']}: {rec['samples_per_s']:.0f} samples/s", flush=True)
                runs.append({**rec, "round": r})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    for ranks, threads, batch in LAYOUTS:
        mine = [x["samples_per_s"] for x in runs if (x["ranks"], x["threads"], x["batch_per_rank"]) == (ranks, threads, batch)]
        rows.append({"layout": f"{ranks}x{threads}, {batch}/rank", "median samples/s": statistics.median(mine),
                     "min": min(mine), "max": max(mine)})
    print(table(rows, ["layout", "median samples/s", "min", "max"]))
    result = {**about, "mode": "quick" if args.quick else "full", "runs": runs, "summary": rows,
              "load_average_end": load_average()}
    name = results_name("host_layout") + ("_quick" if args.quick else "")
    print(f"wrote {write_result(name, result)}")
    return result


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
