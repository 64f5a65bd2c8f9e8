"""The warm-start budget sweep (#28): which ``warm.*`` settings keep a warm nightly run within 0.2
points of plain scratch, night after night, for the least training.

One seed of ``benchmarks.nightly_growth``'s schedule (the same source, night by night), the
``sluice nightly`` arm with ``warm.init=auto`` once per setting in the grid, each
with its own data root (registry, champion, dataset versions) carried from night to night; the
settings interleaved night by night, as the host drifts over minutes. The reference is that
seed's ``plain scratch`` from ``nightly_growth.json`` when the file holds it for the same schedule
and plain recipe, else it is run here first.

Kept: the setting with the fewest training steps over nights 1 on (warm nights; steps, not
seconds, as the host's load drifts) among those within 0.2 points of plain scratch on every
night; when none is, the one closest on its worst night.

    python -m benchmarks.nightly_warm_sweep [--quick] [--seed 0] [--nights N] [--only I ...]

Writes ``benchmarks/results/nightly_growth_warm_sweep.json`` (quick: ``..._quick.json``) after
every night, so an interrupted sweep keeps what it measured. Settings the file already holds for
the same seed, schedule and plain recipe, all nights measured, and not run again (``--only``
picks a part of the grid) stay in it with the commit they were measured at.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, table, write_result
from benchmarks.hostinfo import describe_run, load_average, results_name
from benchmarks.nightly_growth_arms import plain_recipe, run_plain, run_sluice
from benchmarks.nightly_growth_source import FULL, QUICK, fashion_mnist, plan_nights, write_night
from benchmarks.nightly_growth_summary import WITHIN, seconds_to
from benchmarks.results_page import _pts, provenance

# warm.* settings tried. A first grid around the defaults (lr_scale 0.5 and 1.0, replay_ratio 1-5;
# seed 0, commit dde1fef) ended night 1 below the champion it started from (-0.75 points against
# plain scratch at the defaults, -0.39 with replay_ratio 3): a trained model kicked to half the
# recipe's peak does not settle again within ~170 steps. This grid looks at lower peaks.
EARLIER = {"commit": "dde1fef", "seed": 0, "night": 1, "plain_scratch_test_acc": 0.9238,
           "champion_night0_test_acc": 0.9195, "stopped": "after night 1 of two settings (the grid was replaced)",
           "settings": [{"warm": {}, "test_acc": 0.9163, "points_vs_scratch": -0.75, "new": 5382, "replayed": 5382},
                        {"warm": {"replay_ratio": 3.0}, "test_acc": 0.9199, "points_vs_scratch": -0.39,
                         "new": 5382, "replayed": 16146}]}
GRID: list[dict[str, Any]] = [
    {"lr_scale": 0.2},
    {"lr_scale": 0.2, "replay_ratio": 3.0},
    {"lr_scale": 0.1, "replay_ratio": 3.0},
    {"lr_scale": 0.2, "replay_ratio": 3.0, "epochs": 1.0},
    {"lr_scale": 0.3, "replay_ratio": 5.0, "epochs": 1.0},
    # second grid: the settings above (commit 03f3d36) all ended near the champion's accuracy,
    # never gaining what the new data gives; plain fine-tune (2 epochs over all data at half the
    # peak) did, so these replay every old sample (replay_ratio above old/new) or five per new one
    {"lr_scale": 0.5, "replay_ratio": 100.0, "epochs": 2.0},
    {"lr_scale": 0.3, "replay_ratio": 100.0, "epochs": 2.0},
    {"lr_scale": 0.5, "replay_ratio": 5.0, "epochs": 2.0},
]


def scratch_reference(seed: int, sch: dict[str, int], recipe: dict[str, Any], quick: bool) -> list[dict[str, Any]] | None:
    """That seed's plain scratch nights from the nightly_growth file, when it ran this schedule and recipe."""
    name = results_name("nightly_growth", bare_on="avx512_bf16") + ("_quick" if quick else "")
    p = RESULTS / f"{name}.json"
    if not p.exists():
        return None
    d = json.loads(p.read_text())
    s = d.get("settings") or {}
    same = ({k: v for k, v in s.get("schedule", {}).items() if k != "nights"}
            == {k: v for k, v in sch.items() if k != "nights"}) and (s.get("plain") or {}).get("args") == recipe["args"]
    runs = ((d.get("runs") or {}).get("plain scratch") or {}).get(str(seed))
    if not same or not runs or len(runs["nights"]) < sch["nights"]:
        return None
    return [{"night": r["night"], "test_acc": r["test_acc"], "wall_s": r["wall_s"],
             "from": f"{p.name} (commit {str(runs['provenance'].get('commit'))[:12]})"} for r in runs["nights"]]


def earlier_settings(name: str, seed: int, sch: dict[str, int], recipe: dict[str, Any],
                     grid: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The settings an earlier run of this sweep measured on the same seed, schedule and plain
    recipe that this run does not repeat, each with the commit it was measured at."""
    p = RESULTS / f"{name}.json"
    if not p.exists():
        return []
    d = json.loads(p.read_text())
    if d.get("seeds") != [seed] or d.get("schedule") != sch or (d.get("plain") or {}).get("args") != recipe["args"]:
        return []
    return [{**t, "commit": t.get("commit") or d.get("commit")} for t in d.get("settings", [])
            if t["warm"] not in grid and len(t["nights"]) == sch["nights"]]


def choose(tried: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """The cheapest setting within 0.2 points on every night, else the closest on its worst night."""
    done = [t for t in tried if t["nights"]]
    for t in done:
        gaps = [x["points_vs_scratch"] for x in t["nights"]]
        t["worst_points"] = min(gaps)
        t["within"] = all(g >= -100 * WITHIN for g in gaps)
        t["warm_train_s"] = sum(x["train_s"] for x in t["nights"] if x["night"] > 0)
        t["warm_steps"] = sum(x["steps"] for x in t["nights"] if x["night"] > 0)
    ok = [t for t in done if t["within"]]
    if ok:
        best = min(ok, key=lambda t: t["warm_steps"])
        return best, "the fewest training steps on warm nights among those within 0.2 points on every night"
    best = max(done, key=lambda t: t["worst_points"])
    return best, "none was within 0.2 points on every night: the one closest on its worst night"


# ------------------------------------------------------------------ its section of docs/results.md

THEN_DEFAULTS = "that commit's defaults (lr_scale 0.5, replay_ratio 1)"


def results_section(d: dict[str, Any], name: str = "nightly_growth_warm_sweep.json") -> list[str]:
    """The warm-start settings sweep: each setting's points against plain scratch, night by night."""
    nights = sorted({x["night"] for t in d["settings"] for x in t["nights"]})
    lines = [f"Warm-start settings swept on seed {d['seeds'][0]} of the same schedule (the nightly flow with "
             "`warm.init=auto` and each `warm.*` setting, its own data root night after night; points against "
             f"that seed's `plain scratch`; night 0 has no champion yet, so it is one run for all):", "",
             "| warm setting | " + " | ".join(f"night {n}" for n in nights) + " | steps, warm nights | within 0.2 every night "
             "| commit |",
             "|---|" + "---|" * len(nights) + "---|---|---|"]
    for t in d["settings"]:
        by = {x["night"]: x for x in t["nights"]}
        cells = [_pts(by[n]["points_vs_scratch"]) if n in by else "—" for n in nights]
        label = ", ".join(f"{k} {v:g}" for k, v in t["warm"].items()) or "defaults"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {t.get('warm_steps', '—')} | "
                     f"{'yes' if t.get('within') else 'no'} | `{str(t.get('commit') or d['commit'])[:7]}` |")
    e = d.get("earlier_grid")
    if e:
        lines += ["", f"An earlier grid (commit `{e['commit']}`, stopped {e['stopped']}) had night {e['night']} at "
                      + "; ".join(f"{', '.join(f'{k} {v:g}' for k, v in x['warm'].items()) or THEN_DEFAULTS}: "
                                  f"{_pts(x['points_vs_scratch'])} points" for x in e["settings"]) + "."]
    chosen = ", ".join(f"{k} {v:g}" for k, v in d["chosen"].items()) or "the defaults"
    lines += ["", f"Kept by the sweep's rule ({d['rule']}): {chosen}. The rule reads seed {d['seeds'][0]}'s test "
                  "accuracy, so that seed's figures above are not an unseen check of the choice; the other seeds "
                  "of `nightly_growth` are."]
    if any((t["warm"].get("replay_ratio") or 0) >= 100 for t in d["settings"]):
        lines[-1] += (" A replay_ratio of 100 is above every night's ratio of old to new samples: it replays "
                      "every old sample, which the default (`warm.replay_ratio` unset) does.")
    return lines + ["", provenance(d, name)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="nightly_growth's quick schedule (a smoke run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nights", type=int, default=None)
    ap.add_argument("--only", type=int, nargs="+", default=None, help="indices into the grid")
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args(argv)
    sch = dict(QUICK if args.quick else FULL)
    if args.nights:
        sch["nights"] = min(args.nights, sch["nights"])
    grid = [g for i, g in enumerate(GRID) if args.only is None or i in args.only]
    recipe = plain_recipe(args.quick)
    work = args.work or Path(tempfile.mkdtemp(prefix="sluice-warm-sweep-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", str(work / "prefect"))
    about = describe_run("benchmarks.nightly_warm_sweep", argv)
    name = "nightly_growth_warm_sweep" + ("_quick" if args.quick else "")
    ref = scratch_reference(args.seed, sch, recipe, args.quick)
    fm = fashion_mnist()
    scratch: list[dict[str, Any]] = []
    tried = [{"warm": g, "commit": about["commit"], "nights": []} for g in grid]
    # the settings measured before and not repeated here, then this run's (filled in night by night)
    settings = earlier_settings(name, args.seed, sch, recipe, grid) + tried
    t0 = time.time()
    try:
        for night in plan_nights(args.seed, sch, fm["y"]):
            n = night["night"]
            npz = work / "fashion-mnist.npz"
            write_night(npz, night, fm, sch["test_images"])
            if ref:
                scratch.append(ref[n])
            else:
                r = run_plain(recipe, npz, args.seed, recipe["epochs"], work / f"scratch{n}.pt")
                scratch.append({"night": n, "test_acc": r["test_acc"], "wall_s": r["wall_s"], "from": "run here"})
            target = scratch[-1]["test_acc"]
            for i, t in enumerate(tried):
                if n == 0 and i > 0:  # no champion yet: every setting's night 0 is the same run
                    shutil.copytree(work / "setting0", work / f"setting{i}")
                    t["nights"].append({**tried[0]["nights"][0], "shared": "setting 0's night 0 (no champion yet: "
                                                                           "the same run), its data root copied"})
                    continue
                la = load_average()
                r = run_sluice("sluice nightly", work / f"setting{i}", npz, night, args.seed, args.quick,
                               extra={"warm": {"init": "auto", **t["warm"]}})
                w = r["promotion"]["warm"]
                t["nights"].append({
                    "night": n, "test_acc": r["test_acc"], "points_vs_scratch": 100 * (r["test_acc"] - target),
                    "wall_s": r["wall_s"], "train_s": r["train_s"], "steps": r["steps"],
                    "to_within_s": seconds_to(r["evals"], target - WITHIN), "load_average": la,
                    "promoted": r["promotion"]["promoted"], "init": w.get("init"), "why": w.get("why"),
                    "new": w.get("new"), "replayed": w.get("replayed"),
                    "overlap": max(v or 0 for v in (r["overlap"]["candidate"], r["overlap"]["champion"]))})
                x = t["nights"][-1]
                print(f"  night {n} warm {json.dumps(t['warm'])}: {x['test_acc']:.4f} "
                      f"({x['points_vs_scratch']:+.2f} points vs scratch {target:.4f}), training {x['train_s']:.0f} s, "
                      f"wall {x['wall_s']:.0f} s, {x['init']} ({x['new']} new + {x['replayed']} replayed)", flush=True)
            npz.unlink()
            best, rule = choose(settings)
            result = {**about, "mode": "quick" if args.quick else "full", "seeds": [args.seed], "schedule": sch,
                      "plain": recipe, "scratch": scratch, "settings": settings, "earlier_grid": EARLIER, "chosen": best["warm"], "rule": rule,
                      "nights_done": n + 1, "total_s": time.time() - t0, "load_average_end": load_average()}
            write_result(name, result)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    rows = [{"warm": json.dumps(t["warm"]), "worst points": t.get("worst_points"), "within": t.get("within"),
             "warm steps": t.get("warm_steps"), "warm training s": t.get("warm_train_s"),
             **{f"night {x['night']}": f"{x['points_vs_scratch']:+.2f}" for x in t["nights"]}} for t in settings]
    print(table(rows, list(rows[0])))
    print(f"chosen: {json.dumps(result['chosen'])} ({rule})\nwrote {RESULTS / name}.json")
    return result


if __name__ == "__main__":
    main()
