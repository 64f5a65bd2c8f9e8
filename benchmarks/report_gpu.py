"""The GPU section of docs/results.md, generated from benchmarks/results/gpu.json (and its repeat,
gpu-repeat.json) and gpu_batch_ab.json: time to 93% on one GPU against the plain baseline, the
loader-throughput goals with the caveat their short timing windows need, and the batch-size A/B."""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
RUNS = ("gpu.json", "gpu-repeat.json")


def _fmt(v: float | None, digits: int = 1) -> str:
    return "never" if v is None else f"{v:.{digits}f}"


def _acc(runs: list[dict[str, Any]]) -> str:
    accs = [r["final_acc"] for r in runs if r.get("final_acc") is not None]
    return f"{statistics.median(accs):.4f} ({min(accs):.4f}–{max(accs):.4f})" if accs else "–"


def _tta_rows(name: str, d: dict[str, Any]) -> list[str]:
    rows = []
    for arm, a in d["time_to_accuracy"]["arms"].items():
        s = a["summary"]
        rows.append(f"| {name} | {arm} | {a['epochs']:g} | {_fmt(s['median'])} ({_fmt(s['min'])}–{_fmt(s['max'])}) | "
                    f"{s['misses']} | {_acc(a['runs'])} |")
    return rows


def render_gpu() -> str:
    """The section's markdown; says so plainly when no GPU results are committed."""
    files = [(n, json.loads((RESULTS / n).read_text())) for n in RUNS if (RESULTS / n).exists()]
    if not files:
        return "No GPU results are committed: this page claims none.\n"
    first = files[0][1]
    out = [f"Device: {first['gpu']['gpu']}, torch {first['gpu']['torch']} (CUDA {first['gpu']['cuda']}), host class "
           f"`{first['_meta']['host_class']}`; mode `{first['mode']}`, seeds {first['time_to_accuracy']['seeds']}. "
           "Each file is one run of `make gpu-check GPU_CHECK_ARGS=--full` (`python -m benchmarks.gpu`), "
           + ", ".join(f"`{n}` at commit {d['commit'][:7]} ({d['_meta']['when'][:16]} UTC)" for n, d in files) + ".",
           "", "Time to 93% test accuracy on Fashion-MNIST, each run a fresh process timed from its start "
           "(Sluice's includes sharding the 70,000 images):", "",
           "| file | arm | epochs | seconds to 93%: median (min–max) | misses | final accuracy: median (min–max) |",
           "|---|---|---|---|---|---|"]
    for name, d in files:
        out += _tta_rows(name, d)
    ratios = ", ".join(f"{d['time_to_accuracy']['sluice_vs_baseline']:.2f}× ({n})" for n, d in files)
    waits = [r["data_wait_frac"] for _, d in files for r in d["time_to_accuracy"]["arms"]["sluice"]["runs"]
             if r.get("data_wait_frac") is not None]
    verdicts = sorted({r["loader"]["verdict"] for _, d in files for r in d["time_to_accuracy"]["arms"]["sluice"]["runs"]
                       if isinstance(r.get("loader"), dict)})
    out += ["", f"Sluice's default recipe takes {ratios} the plain baseline's median time: **a miss**. "
            f"Its loader is not the cause (verdict {', '.join(verdicts)}; data wait {min(waits):.2f}–{max(waits):.2f} "
            "of the step time); it trains 64 samples per rank on CUDA (`stages/host.py`, not measured there) "
            "against the baseline's 256, and its start-up (process, sharding, torchrun) is longer.", "",
            "Loader-throughput goals (met / missed per file). Each arm times a single pass of a few thousand samples after one "
            "warm-up batch, and the two runs disagree: read these as unmeasured, not as wins or misses.", "",
            "| goal | wanted | " + " | ".join(n for n, _ in files) + " |", "|---|---|" + "---|" * len(files)]
    wanted = {"best_sluice_vs_ceiling_32": f"≥ {first['goals_wanted']['best_sluice_vs_ceiling_32']}",
              "best_sluice_vs_pil_224": f"≥ {first['goals_wanted']['best_sluice_vs_pil_224']}",
              "data_wait_frac_resnet18_64": f"< {first['goals_wanted']['data_wait_frac_max']}"}
    for goal, want in wanted.items():
        cells = []
        for _, d in files:
            g = d["goals"].get(goal, {})
            v = g.get("ratio", g.get("best"))
            cells.append(f"{_fmt(v, 2)} ({'met' if g.get('met') else 'missed'})")
        out.append(f"| {goal} | {want} | " + " | ".join(cells) + " |")
    ab = RESULTS / "gpu_batch_ab.json"
    if ab.exists():
        d = json.loads(ab.read_text())
        out += ["", f"Batch per rank on the GPU (`gpu_batch_ab.json`: {d['info']['command']}, {d['info']['commit']}; "
                f"{d['info']['device']}; seeds {d['seeds']}, arms interleaved):", "",
                "| arm | seconds to 93% per seed | final accuracy: median (min–max) |", "|---|---|---|"]
        for arm in dict.fromkeys(r["arm"] for r in d["runs"]):
            runs = [r for r in d["runs"] if r["arm"] == arm]
            out.append(f"| {arm} | {', '.join(_fmt(r['seconds_to_93']) for r in runs)} | {_acc(runs)} |")
        out += ["", "At 256 per rank an epoch costs about a third of the time, but 5.5 epochs reach 93% on one "
                "seed of three: the recipe keeps 64 per rank on CUDA (`stages/host.py`) until a budget that "
                "reaches 93% at 256 on every seed is measured."]
    return "\n".join(out) + "\n"
