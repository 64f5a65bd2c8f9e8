"""What a ``benchmarks.nightly_growth`` results file says: each arm's night against that seed's plain
scratch (and fine-tune) night, the medians over the seeds per night, the goals, and the
benchmark's section of docs/results.md.
"""
from __future__ import annotations

import math
import statistics
from typing import Any

from benchmarks.nightly_growth_arms import SLUICE_ARMS
from benchmarks.results_page import _pct, _pts, _s, provenance

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


# ------------------------------------------------------------------ its section of docs/results.md

def _xs(v: float | None) -> str:
    """A ratio of times: None is a run that never got there, 0 one whose reference never did."""
    return "never" if v is None else "fine-tune never did" if v == 0 else f"{v:.2f}×"


def results_section(d: dict[str, Any], name: str = "nightly_growth.json") -> list[str]:
    """Nightly retraining on a growing source: per night and arm, medians over the seeds."""
    st, sch = d["settings"], d["settings"]["schedule"]
    ft, plain = st["finetune"], st["plain"]
    lines = [f"The {sch['first'] + sch['per_night'] * (sch['nights'] - 1):,} training images revealed over "
             f"{sch['nights']} nights ({sch['first']:,} on night 0, +{sch['per_night']:,} a night; "
             f"{sch['mislabelled']} of night 0's mislabelled until night {sch['corrected_on']}, "
             f"{sch['deleted']} deleted on night {sch['deleted_on']}), graded on {sch['test_images']:,} test images. "
             f"`plain scratch`: {plain['variant']}, {plain['epochs']:g} epochs on every image so far; "
             f"`plain fine-tune`: the same from its previous night's weights, {ft['epochs']:g} epochs at peak lr "
             f"{ft['lr']:g} ({st['finetune_from']}); `sluice nightly`: the deployment's flow, default parameters. Medians over the seeds (test accuracy: min–max "
             "beside it); wall: the process from its start (Sluice's less starting Prefect's embedded API); "
             "\"to −0.2\": seconds until the model is within 0.2 points of that night's `plain scratch`, "
             "and that against `plain scratch`'s wall time and `plain fine-tune`'s time to the same accuracy; "
             "written: every file of the night's dataset version, against the bytes of its new samples; "
             "overlap: the most samples any seed's candidate or champion trained on of the val split "
             "that decided its promotion.", "",
             "| night (images) | arm | test accuracy | vs scratch (points) | wall | training | written (vs new) "
             "| to −0.2 | vs scratch wall | vs fine-tune | promoted | overlap |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = d.get("arms") or []  # the benchmark's order (the file's keys are sorted)
    for night in d["nights"]:
        for arm in sorted(night["arms"], key=lambda x: order.index(x) if x in order else len(order)):
            a = night["arms"][arm]
            med = lambda k, a=a: (a.get(k) or {}).get("median")  # noqa: E731
            acc = a["test_acc"]
            rng = f" ({_pct(acc['min'])}–{_pct(acc['max'])})" if acc.get("n", 0) > 1 else ""
            wrote = "—" if "bytes_vs_new" not in a else \
                f"{(med('bytes_written') or 0) / 1e6:,.1f} MB ({_xs(med('bytes_vs_new'))})"
            tw = a.get("to_within_s") or {}
            reach = (f"never ({tw['misses']} of {tw['n']} seeds)" if tw.get("median") is None else
                     _s(tw["median"]) + (f", {tw['misses']} of {tw['n']} seeds never" if tw.get("misses") else ""))
            promoted = f"{sum(a['promoted'])}/{len(a['promoted'])}" if "promoted" in a else "—"
            lines.append(
                f"| {night['night']} ({night['samples']:,}) | {arm} | {_pct(acc['median'])}{rng} | "
                f"{'—' if arm == 'plain scratch' else _pts(med('points_vs_scratch'))} | {_s(med('wall_s'))} | "
                f"{_s(med('train_s'))} | {wrote} | "
                f"{'—' if arm == 'plain scratch' else reach} | "
                f"{'—' if arm == 'plain scratch' else _xs(med('vs_scratch_wall'))} | "
                f"{_xs(med('vs_finetune')) if 'vs_finetune' in a else '—'} | "
                f"{promoted} | "
                f"{max(a['overlap']) if 'overlap' in a else '—'} |")
    for arm, g in (d.get("goals") or {}).items():
        word = lambda ok: "met" if ok else "missed"  # noqa: E731
        nights = g["per_night"]
        bad = lambda key: [str(r["night"]) for r in nights if not r[key]]  # noqa: E731
        lines += ["", f"Goals for `{arm}` (every night, medians of the seeds): writes ≤ 1.2× the bytes of the "
                      f"night's new samples (plus manifest): **{word(g['bytes'])}**"
                      + (f" (missed on nights {', '.join(bad('bytes_met'))})" if bad("bytes_met") else "")
                      + "; within 0.2 points of `plain scratch` in ≤ 0.25× its wall time and ≤ 0.5× `plain "
                      f"fine-tune`'s time to that accuracy: **{word(g['accuracy_and_time'])}**"
                      + (f" (missed on nights {', '.join(bad('time_met'))})" if bad("time_met") else "")
                      + f"; on the last night (night {g['last_night']['night']}) no more than 0.2 points below "
                      f"`plain scratch`: **{word(g['last_night']['met'])}** "
                      f"({_pts(g['last_night']['points_vs_scratch'])} points); zero overlap every night: "
                      f"**{word(g['zero_overlap'])}**."]
    seeds = sorted({int(s) for a in d["runs"].values() for s in a})
    if len(seeds) < 3:
        lines += ["", f"**{len(seeds)} seed{'s' if len(seeds) != 1 else ''} measured ({', '.join(map(str, seeds))}) of "
                      "the 3 the goals ask for**: the medians above are of those alone, so no goal counts as met "
                      "or missed for good until the other seeds run (`--seeds N` merges into this file)."]
    if st.get("mode") == "quick":
        lines += ["", "Quick mode: a tenth of the scale and fewer nights and epochs: a check that everything "
                      "runs, not the measurement the goals ask for."]
    prov = {(p["commit"], p["when"][:10]) for a in d["runs"].values() for r in a.values()
            for p in [r["provenance"]]}
    if len(prov) > 1:
        lines += ["", "Arms and seeds measured in separate runs (merged; the time ratios compare runs made at "
                      "different times, not interleaved, so they carry the host's drift between them): " + "; ".join(
            f"{arm} seed {s}: commit `{str(r['provenance']['commit'])[:12]}`, {r['provenance']['when']}"
            for arm, a in d["runs"].items() for s, r in a.items()) + "."]
    return lines + ["", provenance(d, name)]
