"""What a ``benchmarks.nightly_growth`` results file says: each arm's night against that seed's plain
scratch (and fine-tune) night, the medians over the seeds per night, and the goals.
"""
from __future__ import annotations

import math
import statistics
from typing import Any

from benchmarks.nightly_growth_arms import SLUICE_ARMS

WITHIN = 0.002  # "within 0.2 points"
GOALS = {"bytes_vs_new_at_most": 1.2, "points_below_scratch_at_most": 0.2,
         "time_vs_scratch_wall_at_most": 0.25, "time_vs_finetune_at_most": 0.5}


# ------------------------------------------------------------------ summaries and goals

def seconds_to(evals: list[dict[str, Any]], target: float) -> float | None:
    return next((e["wall_s"] for e in evals if e["acc"] >= target - 1e-12), None)


def _stats(values: list[float | None]) -> dict[str, Any]:
    """Median and min-max of the seeds; None (never reached) counts as infinitely slow."""
    keyed = sorted(math.inf if v is None else v for v in values)
    if not keyed:
        return {"median": None, "min": None, "max": None, "misses": 0, "n": 0}
    fin = lambda v: None if math.isinf(v) else v  # noqa: E731
    return {"median": fin(statistics.median(keyed)), "min": fin(keyed[0]), "max": fin(keyed[-1]),
            "misses": sum(v is None for v in values), "n": len(values)}


def _ratio(a: float | None, b: float | None) -> float | None:
    """a / b, a miss being infinitely slow: None when ``a`` missed, 0 when only ``b`` did."""
    if a is None:
        return None
    return 0.0 if b is None else a / b


def derived(result: dict[str, Any], arm: str, seed: str, n: int) -> dict[str, Any]:
    """One arm's night measured against that seed's plain scratch (and fine-tune) night."""
    runs = result["runs"]
    r = runs[arm][seed]["nights"][n]
    base = (runs.get("plain scratch", {}).get(seed) or {}).get("nights", [])
    ft = (runs.get("plain fine-tune", {}).get(seed) or {}).get("nights", [])
    out: dict[str, Any] = {"test_acc": r["test_acc"], "wall_s": r["wall_s"], "train_s": r["train_s"],
                           "shard_s": r["shard_s"], "bytes_written": r["bytes_written"]}
    if "new_sample_bytes" in r:
        out["bytes_vs_new"] = ((r["bytes_written"] - r["manifest_bytes"]) / r["new_sample_bytes"]
                               if r["new_sample_bytes"] else None)
        out["overlap"] = max(v or 0 for v in (r["overlap"]["candidate"], r["overlap"]["champion"]))
        out["promoted"] = r["promotion"]["promoted"]
        out["champion_test_acc"] = r["overlap"]["champion_test_acc"]
    if len(base) > n:
        acc, target = base[n]["test_acc"], base[n]["test_acc"] - WITHIN
        out["to_scratch_acc_s"] = seconds_to(r["evals"], acc)
        out["to_within_s"] = seconds_to(r["evals"], target)
        out["points_vs_scratch"] = 100 * (r["test_acc"] - acc)
        out["vs_scratch_wall"] = _ratio(out["to_within_s"], base[n]["wall_s"])
        if len(ft) > n and arm in SLUICE_ARMS:  # 0: fine-tune never got there
            out["vs_finetune"] = _ratio(out["to_within_s"], seconds_to(ft[n]["evals"], target))
    return out


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    """Per night and arm, medians and min-max over the seeds; the goals per Sluice arm."""
    nights_n = result["settings"]["schedule"]["nights"]
    per_night = []
    for n in range(nights_n):
        arms = {}
        for arm, seeds in result["runs"].items():
            rows = [derived(result, arm, s, n) for s in sorted(seeds, key=int) if len(seeds[s]["nights"]) > n]
            if not rows:
                continue
            keys = dict.fromkeys(k for row in rows for k in row)
            arms[arm] = {k: ([row.get(k) for row in rows] if k in ("promoted", "overlap") else _stats([row.get(k) for row in rows]))
                         for k in keys}
            arms[arm]["seeds"] = [int(s) for s in sorted(seeds, key=int) if len(seeds[s]["nights"]) > n]
        first = next((runs["nights"][n] for runs in next(iter(result["runs"].values())).values()
                      if len(runs["nights"]) > n), {})
        per_night.append({"night": n, **{k: first.get(k) for k in ("samples", "added", "removed", "relabelled",
                                                                    "mislabelled")}, "arms": arms})
    return {"nights": per_night, "goals": goals(per_night)}


def _med(a: dict[str, Any], key: str) -> float | None:
    return (a.get(key) or {}).get("median")


def goals(per_night: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for arm in SLUICE_ARMS:
        rows = []
        for night in per_night:
            a = night["arms"].get(arm)
            if not a or "points_vs_scratch" not in a:
                continue
            b, gap = _med(a, "bytes_vs_new"), _med(a, "points_vs_scratch")
            wall, ft = _med(a, "vs_scratch_wall"), _med(a, "vs_finetune")
            acc_ok = gap is not None and gap >= -100 * WITHIN
            rows.append({"night": night["night"], "bytes_vs_new": b,
                         "bytes_met": b is not None and b <= GOALS["bytes_vs_new_at_most"],
                         "points_vs_scratch": gap, "accuracy_met": acc_ok,
                         "vs_scratch_wall": wall, "vs_finetune": ft,
                         "time_met": acc_ok and wall is not None and wall <= GOALS["time_vs_scratch_wall_at_most"]
                         and ft is not None and ft <= GOALS["time_vs_finetune_at_most"],
                         "overlap_max": max(a["overlap"])})
        if not rows:
            continue
        last = rows[-1]
        out[arm] = {"per_night": rows,
                    "bytes": all(r["bytes_met"] for r in rows),
                    "accuracy_and_time": all(r["time_met"] for r in rows),
                    "last_night": {"night": last["night"], "points_vs_scratch": last["points_vs_scratch"],
                                   "met": last["accuracy_met"]},
                    "zero_overlap": all(r["overlap_max"] == 0 for r in rows)}
    return out

