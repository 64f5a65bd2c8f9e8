"""Nightly retraining on a growing source (#28): the 60,000 Fashion-MNIST training images revealed
over 6 nights, each arm carrying its own state from night to night.

The source, per seed: a seeded reveal order of the training images; night 0 holds 30,000 of them
and every later night 6,000 more. 300 of night 0's arrive with a wrong label and night 3 corrects
them; night 4 deletes 300 others (a deletion request), for good. Each night is an ``.npz`` source
with stable keys (``fm-<original index>``, so a deletion re-keys nothing) and the 10,000 test
images as its test split.

Arms (``--arms``), each night in a fresh process, in this order:

* ``plain scratch``: the strong plain baseline (``benchmarks/baselines/plain_bn_cnn.py``, its
  fastest variant, settings and budget from ``time_to_accuracy.json``) trained from scratch on every
  image revealed so far;
* ``plain fine-tune``: the same script from its own previous night's weights, on every image so
  far, for the budget its recorded sweep chose (``--sweep-finetune``; its night 0 is plain
  scratch's night 0, reused when both run);
* ``sluice nightly``: the ``nightly-retrain`` flow with the deployment's default parameters (one
  data root per seed for every night: datasets, registry, champion).

Warm starts (``warm.init=auto``) are swept apart, on one seed, by ``benchmarks.nightly_warm_sweep``
(``nightly_growth_warm_sweep.json``); a ``sluice warm`` arm measured here at commit ec5de73 with
the warm settings of the time was dropped from the file when that sweep replaced it.

Beyond the defaults every Sluice run sets only its seeds, the night's source, an evaluation on the
test split about once an epoch (for the curve) and, in quick mode, its epochs.

Recorded per night, arm and seed: shard seconds and bytes written (Sluice: every file of the new
dataset version, 0 when the version is reused; plain: none), training seconds, the process's wall
time (Sluice: from its start, less starting Prefect's embedded API, as in time_to_accuracy), test
accuracy and its curve, the seconds until the model reaches that night's ``plain scratch`` test
accuracy (and that accuracy less 0.2 points), and for Sluice the promotion's ``unseen`` and
``warm`` records plus an overlap count of our own: each model's recorded training keys against the
val split its promotion was decided on.

    python -m benchmarks.nightly_growth --sweep-finetune [--quick]   # the fine-tune budget, first
    python -m benchmarks.nightly_growth [--quick] [--seeds 0 1 2] [--arms ...] [--nights N]

Writes ``benchmarks/results/nightly_growth.json`` (quick: ``nightly_growth_quick.json``; the sweep:
``nightly_growth_finetune_sweep[_quick].json``). A run of some arms or seeds merges into an
existing file of the same settings (and refuses one of other settings), so a full run can be
taken in several sittings. Quick mode: a tenth of the scale (3,000 + 600 a night, 30 mislabelled
and corrected on night 1, 30 deleted on night 2), 3 nights, 6 epochs, graded on the first 2,000
test images: a smoke run, not the measurement the goals ask for.

This module runs the nights and the sweep and writes the file; the growing source is
``benchmarks.nightly_growth_source``, the arms ``benchmarks.nightly_growth_arms``, and the summary
per night, the goals and the section of docs/results.md ``benchmarks.nightly_growth_summary``.
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

import numpy as np

from benchmarks.common import RESULTS, table, write_result
from benchmarks.hostinfo import describe_run, load_average, results_name
from benchmarks.nightly_growth_arms import ARMS, QUICK_EPOCHS, SLUICE_ARMS, plain_recipe, run_plain, run_sluice
from benchmarks.nightly_growth_source import FULL, QUICK, fashion_mnist, plan_nights, write_night
from benchmarks.nightly_growth_summary import GOALS, WITHIN, _med, summarise

SWEEP_EPOCHS, SWEEP_LRS = (1, 2, 3), (0.2, 0.1)  # fine-tune budgets tried (the recipe's peak lr, half)
QUICK_SWEEP_EPOCHS = (1, 2)


# ------------------------------------------------------------------ running the nights

def slug(arm: str) -> str:
    return arm.replace(" ", "-")


def _brief(arm: str, r: dict[str, Any]) -> str:
    s = (f"  night {r['night']} {arm:<16} seed {r['seed']}: test {r['test_acc']:.4f}, wall {r['wall_s']:.0f} s, "
         f"training {r['train_s']:.0f} s")
    if "promotion" in r:
        w = r["promotion"]["warm"]
        s += (f", shard {r['shard_s']:.1f} s / {r['bytes_written'] / 1e6:.1f} MB, "
              f"{'promoted' if r['promotion']['promoted'] else 'not promoted'}, overlap "
              f"{r['overlap']['candidate']}/{r['overlap']['champion']}, weights: {w.get('init')}"
              + (f" ({w.get('new')} new + {w.get('replayed')} replayed)" if w.get("parent_model") else ""))
    return s


def run_seed(seed: int, arms: list[str], sch: dict[str, int], recipe: dict[str, Any], budget: dict[str, Any],
             quick: bool, work: Path, fm: dict[str, np.ndarray]) -> dict[str, list[dict[str, Any]]]:
    """Every night of one seed, the arms interleaved night by night (the host drifts over minutes),
    each carrying its own state: a data root (Sluice) or its previous night's weights (fine-tune)."""
    d = work / f"seed{seed}"
    dirs = {arm: d / slug(arm) for arm in arms}
    for p in dirs.values():
        p.mkdir(parents=True, exist_ok=True)
    out: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    for night in plan_nights(seed, sch, fm["y"]):
        n = night["night"]
        npz = d / "fashion-mnist.npz"  # one path, rewritten each night: a growing source, as a user's is
        write_night(npz, night, fm, sch["test_images"])
        for arm in arms:
            la = load_average()
            weights = dirs[arm] / f"night{n}.pt"
            if arm == "plain scratch" or (arm == "plain fine-tune" and n == 0 and "plain scratch" not in arms):
                r = run_plain(recipe, npz, seed, recipe["epochs"], weights)
            elif arm == "plain fine-tune" and n == 0:  # the same command as plain scratch's night 0
                shutil.copyfile(dirs["plain scratch"] / "night0.pt", weights)
                r = {**out["plain scratch"][-1], "reused": "plain scratch's night 0 (the same command)"}
            elif arm == "plain fine-tune":
                r = run_plain(recipe, npz, seed, budget["epochs"], weights, init=dirs[arm] / f"night{n - 1}.pt",
                              lr=budget["lr"])
            else:
                r = run_sluice(arm, dirs[arm], npz, night, seed, quick)
            r.update(night=n, seed=seed, load_average=la, samples=int(night["shown"].size),
                     **{k: night[k] for k in ("added", "removed", "relabelled", "mislabelled")})
            out[arm].append(r)
            print(_brief(arm, r), flush=True)
        npz.unlink()
    return out


# ------------------------------------------------------------------ the fine-tune budget sweep

def sweep_name(quick: bool) -> str:
    return "nightly_growth_finetune_sweep" + ("_quick" if quick else "")


def sweep(seed: int, sch: dict[str, int], recipe: dict[str, Any], quick: bool, work: Path,
          fm: dict[str, np.ndarray], argv: list[str] | None) -> dict[str, Any]:
    """Plain scratch on nights 0-2 of ``seed``, and fine-tuning from its night-0 weights through
    nights 1 and 2 at each budget (epochs x peak lr); the budget kept is the cheapest (fewest
    epochs, then the first lr) within 0.2 points of plain scratch on both nights."""
    about = describe_run("benchmarks.nightly_growth", argv)
    nights = plan_nights(seed, sch, fm["y"])[:3]
    grid = [{"epochs": e, "lr": lr} for e in (QUICK_SWEEP_EPOCHS if quick else SWEEP_EPOCHS) for lr in SWEEP_LRS]
    d = work / f"sweep-seed{seed}"
    d.mkdir(parents=True, exist_ok=True)
    scratch, tried = [], [{**b, "nights": []} for b in grid]
    for night in nights:
        n = night["night"]
        npz = d / f"night{n}.npz"
        write_night(npz, night, fm, sch["test_images"])
        s = run_plain(recipe, npz, seed, recipe["epochs"], d / f"scratch{n}.pt")
        scratch.append({"night": n, "test_acc": s["test_acc"], "wall_s": s["wall_s"]})
        print(f"  night {n} plain scratch: {s['test_acc']:.4f} in {s['wall_s']:.0f} s", flush=True)
        for i, b in enumerate(tried):
            if n == 0:
                continue
            init = d / ("scratch0.pt" if n == 1 else f"ft{i}-{n - 1}.pt")
            r = run_plain(recipe, npz, seed, b["epochs"], d / f"ft{i}-{n}.pt", init=init, lr=b["lr"])
            b["nights"].append({"night": n, "test_acc": r["test_acc"], "wall_s": r["wall_s"],
                                "points_vs_scratch": 100 * (r["test_acc"] - s["test_acc"])})
            print(f"  night {n} fine-tune {b['epochs']} epochs lr {b['lr']}: {r['test_acc']:.4f} "
                  f"({b['nights'][-1]['points_vs_scratch']:+.2f} points) in {r['wall_s']:.0f} s", flush=True)
        npz.unlink()
    for b in tried:
        b["within"] = all(x["points_vs_scratch"] >= -100 * WITHIN for x in b["nights"])
    ok = [b for b in tried if b["within"]]
    best = ok[0] if ok else max(tried, key=lambda b: min(x["points_vs_scratch"] for x in b["nights"]))
    return {**about, "mode": "quick" if quick else "full", "seeds": [seed], "schedule": sch, "plain": recipe,
            "scratch": scratch, "budgets": tried,
            "chosen": {"epochs": best["epochs"], "lr": best["lr"]},
            "rule": "the fewest epochs (then the first lr) within 0.2 points of plain scratch on nights 1 and 2"
                    + ("" if ok else "; none was, so the one closest on its worse night"),
            "load_average_end": load_average()}


def finetune_budget(sch: dict[str, int], recipe: dict[str, Any], quick: bool) -> dict[str, Any]:
    """The recorded sweep's choice (its schedule and plain recipe must be this run's)."""
    p = RESULTS / f"{sweep_name(quick)}.json"
    if not p.exists():
        if quick:
            return {"epochs": 1, "lr": 0.1, "from": "fixed: quick mode without a quick sweep file"}
        raise SystemExit(f"no {p.name}: run `python -m benchmarks.nightly_growth --sweep-finetune` first")
    s = json.loads(p.read_text())
    same = {k: v for k, v in sch.items() if k != "nights"} == {k: v for k, v in s["schedule"].items() if k != "nights"}
    if not same or s["plain"]["args"] != recipe["args"] or s["plain"]["epochs"] != recipe["epochs"]:
        raise SystemExit(f"{p.name} swept another schedule or plain recipe; run --sweep-finetune again")
    return {**s["chosen"], "from": f"{p.name} (commit {str(s.get('commit'))[:12]}, seed {s['seeds'][0]})"}


# ------------------------------------------------------------------ results file

def settings_of(sch: dict[str, int], recipe: dict[str, Any], budget: dict[str, Any], quick: bool) -> dict[str, Any]:
    return {"mode": "quick" if quick else "full", "schedule": sch, "plain": recipe,
            "finetune": {k: budget[k] for k in ("epochs", "lr")}, "finetune_from": budget["from"],
            "sluice": {arm: SLUICE_ARMS[arm] for arm in SLUICE_ARMS},
            "sluice_epochs": QUICK_EPOCHS if quick else "default", "within_points": 100 * WITHIN}


SAME = ("mode", "schedule", "plain", "finetune", "sluice", "sluice_epochs", "within_points")


def check_same_settings(old: dict[str, Any], new: dict[str, Any], name: str) -> None:
    differ = [k for k in SAME if json.dumps(old.get(k), sort_keys=True) != json.dumps(new.get(k), sort_keys=True)]
    if differ:
        raise SystemExit(f"{name} holds runs of other settings ({', '.join(differ)}): they cannot be merged; "
                         "--fresh starts a new file")


def merge_runs(old: dict[str, Any] | None, runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``runs`` (arm -> seed -> nights) over an earlier file's of the same settings: a seed run
    again replaces that arm's seed, every other arm and seed is kept."""
    merged = json.loads(json.dumps((old or {}).get("runs", {})))
    for arm, by_seed in runs.items():
        merged.setdefault(arm, {}).update(by_seed)
    return {arm: merged[arm] for arm in ARMS if arm in merged}


def print_tables(summary: dict[str, Any]) -> None:
    for night in summary["nights"]:
        print(f"\nnight {night['night']}: {night['samples']:,} images (+{night['added']:,} -{night['removed']:,}, "
              f"{night['relabelled']} relabelled, {night['mislabelled']} mislabelled)")
        rows = []
        for arm in [x for x in ARMS if x in night["arms"]]:
            a = night["arms"][arm]
            m = lambda k, a=a: _med(a, k)  # noqa: E731
            rng = lambda k, a=a: (f"{(a.get(k) or {}).get('min'):.4f}-{(a.get(k) or {}).get('max'):.4f}"  # noqa: E731
                                  if (a.get(k) or {}).get("min") is not None else "-")
            rows.append({"arm": arm, "test acc": m("test_acc"), "min-max": rng("test_acc"), "wall s": m("wall_s"),
                         "training s": m("train_s"), "shard s": m("shard_s"),
                         "MB written": (m("bytes_written") or 0) / 1e6, "vs new bytes": m("bytes_vs_new"),
                         "to scratch acc s": m("to_scratch_acc_s"), "to -0.2 pt s": m("to_within_s"),
                         "points": m("points_vs_scratch"), "vs scratch wall": m("vs_scratch_wall"),
                         "vs fine-tune": m("vs_finetune"),
                         "promoted": "" if "promoted" not in a else f"{sum(a['promoted'])}/{len(a['promoted'])}",
                         "overlap": "" if "overlap" not in a else max(a["overlap"])})
        print(table(rows, list(rows[0])))
    for arm, g in summary["goals"].items():
        word = lambda ok: "met" if ok else "MISSED"  # noqa: E731
        print(f"\n{arm} goals (median of seeds, every night):")
        for r in g["per_night"]:
            gap = "-" if r["points_vs_scratch"] is None else f"{r['points_vs_scratch']:+.2f} points"
            b = "-" if r["bytes_vs_new"] is None else f"{r['bytes_vs_new']:.2f}x"
            print(f"  night {r['night']}: bytes {word(r['bytes_met'])} ({b} the new samples', "
                  f"goal <= {GOALS['bytes_vs_new_at_most']}x); within 0.2 points of plain scratch "
                  f"{word(r['accuracy_met'])} ({gap}); "
                  f"in <= 0.25x its wall and <= 0.5x fine-tune's time {word(r['time_met'])} "
                  f"({_fmt_x(r['vs_scratch_wall'])}, {_fmt_x(r['vs_finetune'])}); overlap {r['overlap_max']}")
        print(f"  last night within 0.2 points: {word(g['last_night']['met'])}; zero overlap every night: "
              f"{word(g['zero_overlap'])}")


def _fmt_x(v: float | None) -> str:
    """A ratio of times: None is a run that never got there, 0 one whose reference never did."""
    return "never" if v is None else "fine-tune never" if v == 0 else f"{v:.2f}x"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tenth of the scale, 3 nights, 6 epochs (~5 min a seed)")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="default: 0 1 2 (quick: 0)")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--nights", type=int, default=None, help="fewer nights than the schedule's")
    ap.add_argument("--sweep-finetune", action="store_true",
                    help=f"record the fine-tune budget ({sweep_name(False)}.json), on the first seed")
    ap.add_argument("--fresh", action="store_true", help="replace the results file instead of merging into it")
    ap.add_argument("--work", type=Path, default=None, help="working directory (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the working directory")
    args = ap.parse_args(argv)
    sch = dict(QUICK if args.quick else FULL)
    if args.nights:
        sch["nights"] = min(args.nights, sch["nights"])
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    arms = [a for a in ARMS if a in args.arms]
    recipe = plain_recipe(args.quick)
    work = args.work or Path(tempfile.mkdtemp(prefix="sluice-nightly-growth-"))
    os.environ.setdefault("PREFECT_HOME", str(work / "prefect"))
    t0 = time.time()
    print(f"plain recipe: {recipe['variant']}, {recipe['epochs']} epochs, {' '.join(recipe['args'])} "
          f"(from {recipe['from']}); work in {work}", flush=True)
    fm = fashion_mnist()
    try:
        if args.sweep_finetune:
            res = sweep(seeds[0], sch, recipe, args.quick, work, fm, argv)
            print(f"chosen fine-tune budget: {res['chosen']} ({res['rule']})")
            print(f"wrote {write_result(sweep_name(args.quick), res)}")
            return res
        budget = finetune_budget(sch, recipe, args.quick)
        settings = settings_of(sch, recipe, budget, args.quick)
        print(f"fine-tune budget: {budget}", flush=True)
        name = results_name("nightly_growth", bare_on="avx512_bf16") + ("_quick" if args.quick else "")
        path = RESULTS / f"{name}.json"
        old = json.loads(path.read_text()) if path.exists() and not args.fresh else None
        if old is not None:
            check_same_settings(old["settings"], settings, path.name)  # before hours of work, not after
        about = describe_run("benchmarks.nightly_growth", argv)
        runs: dict[str, dict[str, Any]] = {arm: {} for arm in arms}
        for seed in seeds:
            t_seed = time.time()
            la = load_average()
            for arm, nights in run_seed(seed, arms, sch, recipe, budget, args.quick, work, fm).items():
                runs[arm][str(seed)] = {"nights": nights, "provenance": {
                    "command": about["command"], "commit": about["commit"], "load_average_start": la,
                    "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_seed)),
                    "seed_s": time.time() - t_seed}}
            if not args.keep:
                shutil.rmtree(work / f"seed{seed}", ignore_errors=True)  # its dataset versions: GBs
            result = save(name, about, settings, old, runs, t0)  # after every seed: a later failure loses none
    finally:
        if not args.keep and args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print_tables(result)
    print(f"\nwrote {RESULTS / name}.json")
    return result


def save(name: str, about: dict[str, Any], settings: dict[str, Any], old: dict[str, Any] | None,
         runs: dict[str, dict[str, Any]], t0: float) -> dict[str, Any]:
    merged = merge_runs(old, runs)
    result = {**about, "mode": settings["mode"], "settings": settings, "runs": merged,
              "seeds": sorted({int(s) for a in merged.values() for s in a}),
              "arms": list(merged), "total_s": time.time() - t0, "load_average_end": load_average(),
              "merged": old is not None}
    result.update(summarise(result))
    write_result(name, result)
    return result

if __name__ == "__main__":
    main()
