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
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import RESULTS, table, write_result
from benchmarks.hostinfo import describe_run, load_average, results_name

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("plain scratch", "plain fine-tune", "sluice nightly")
SLUICE_ARMS: dict[str, dict[str, Any]] = {"sluice nightly": {}}
WITHIN = 0.002  # "within 0.2 points"
# the night schedule: first night's images, images a night after, nights, mislabelled on night 0
# and the night that corrects them, deleted and the night that deletes them
# and the test images every arm is graded on (the first of the 10,000)
FULL = {"first": 30_000, "per_night": 6_000, "nights": 6, "mislabelled": 300, "corrected_on": 3,
        "deleted": 300, "deleted_on": 4, "test_images": 10_000}
QUICK = {"first": 3_000, "per_night": 600, "nights": 3, "mislabelled": 30, "corrected_on": 1,
         "deleted": 30, "deleted_on": 2, "test_images": 2_000}
# Quick mode's epochs, both plain arms' scratch budget and Sluice's: BatchNorm's running statistics
# need some 60 steps before an evaluation means anything (3 epochs of 3,000 tested at chance)
QUICK_EPOCHS = 6
SWEEP_EPOCHS, SWEEP_LRS = (1, 2, 3), (0.2, 0.1)  # fine-tune budgets tried (the recipe's peak lr, half)
QUICK_SWEEP_EPOCHS = (1, 2)
GOALS = {"bytes_vs_new_at_most": 1.2, "points_below_scratch_at_most": 0.2,
         "time_vs_scratch_wall_at_most": 0.25, "time_vs_finetune_at_most": 0.5}


# ------------------------------------------------------------------ the growing source

def fashion_mnist() -> dict[str, np.ndarray]:
    from benchmarks.baselines.plain_bn_cnn import DATA, read_idx
    return {k: read_idx(DATA / f"{p}-{what}-idx{d}-ubyte.gz")
            for k, (p, what, d) in {"x": ("train", "images", 3), "y": ("train", "labels", 1),
                                    "tx": ("t10k", "images", 3), "ty": ("t10k", "labels", 1)}.items()}


def plan_nights(seed: int, sch: dict[str, int], labels: np.ndarray) -> list[dict[str, Any]]:
    """Each night's revealed images (original indices, in reveal order), their labels as the
    source has them that night, and the delta from the night before. The draws do not depend on
    the number of nights, so a shorter run sees the same first nights."""
    rng = np.random.default_rng([seed, 28])
    order = rng.permutation(len(labels))
    bad = np.sort(rng.choice(order[:sch["first"]], sch["mislabelled"], replace=False))
    noisy = labels.astype(np.int64)
    noisy[bad] = (noisy[bad] + rng.integers(1, 10, bad.size)) % 10
    shown_before_delete = order[:sch["first"] + sch["per_night"] * max(sch["deleted_on"] - 1, 0)]
    gone = np.sort(rng.choice(np.setdiff1d(shown_before_delete, bad), sch["deleted"], replace=False))
    nights, prev = [], np.empty(0, np.int64)
    for n in range(sch["nights"]):
        shown = order[:sch["first"] + sch["per_night"] * n]
        if n >= sch["deleted_on"]:
            shown = shown[~np.isin(shown, gone)]
        lab = (noisy if n < sch["corrected_on"] else labels.astype(np.int64))[shown]
        relabelled = bad if n == sch["corrected_on"] and n > 0 else np.empty(0, np.int64)
        nights.append({"night": n, "shown": shown, "labels": lab,
                       "added": int(np.setdiff1d(shown, prev).size), "removed": int(np.setdiff1d(prev, shown).size),
                       "relabelled": int(relabelled.size),
                       "mislabelled": int(np.isin(shown, bad).sum()) if n < sch["corrected_on"] else 0})
        prev = shown
    return nights


def write_night(path: Path, night: dict[str, Any], fm: dict[str, np.ndarray], test_images: int) -> None:
    """The night's source: an ``.npz`` with stable keys and the test split (atomic); every arm
    trains on its images and labels and is graded on its test split."""
    tmp = path.with_name(f".{path.stem}.tmp.npz")
    np.savez(tmp, images=fm["x"][night["shown"]], labels=night["labels"],
             keys=np.asarray([f"fm-{i}" for i in night["shown"]]), test_images=fm["tx"][:test_images],
             test_labels=fm["ty"][:test_images].astype(np.int64))
    os.replace(tmp, path)


# ------------------------------------------------------------------ the plain arms

def plain_recipe(quick: bool) -> dict[str, Any]:
    """The strongest plain variant, its fastest settings and its budget from this host class's
    time_to_accuracy file (defaults where there is none)."""
    from benchmarks.time_to_accuracy import BASELINES
    name = results_name("time_to_accuracy", bare_on="avx512_bf16")
    p = RESULTS / f"{name}.json"
    d = json.loads(p.read_text()) if p.exists() else {}
    arm = d.get("strongest_baseline") or "baseline +flip tta -label smoothing"
    chosen = (d.get("baseline_settings") or {}).get("chosen") or {}
    if not chosen:
        from sluice.stages.precision import resolve_amp
        chosen = {"threads": min(2, os.cpu_count() or 1), "channels_last": True, "amp": resolve_amp("auto")}
    epochs = QUICK_EPOCHS if quick else ((d.get("arms") or {}).get(arm) or {}).get("budget_epochs") or 5
    args = ["--threads", str(chosen["threads"]), "--amp", chosen["amp"], "--evals-per-epoch", "1",
            *BASELINES[arm], *([] if chosen["channels_last"] else ["--no-channels-last"])]
    return {"variant": arm, "args": args, "epochs": epochs,
            "from": f"{p.name}" if d else "defaults (no time_to_accuracy file for this host class)"}


def run_plain(recipe: dict[str, Any], npz: Path, seed: int, epochs: float, save: Path,
              init: Path | None = None, lr: float | None = None) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.baselines.plain_bn_cnn", "--epochs", str(epochs), "--seed", str(seed),
           *recipe["args"], "--train-npz", str(npz), "--save", str(save),
           *(["--init", str(init)] if init else []), *(["--lr", str(lr)] if lr else [])]
    t0 = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"plain run failed ({' '.join(cmd)}):\n{out.stderr[-3000:]}")
    ev = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    evals = [{"epoch": e["epoch"], "acc": e["acc"], "wall_s": e["time"] - t0} for e in ev if e["event"] == "eval"]
    done = next(e for e in ev if e["event"] == "done")
    return {"evals": evals, "test_acc": evals[-1]["acc"], "wall_s": done["time"] - t0,
            "train_s": done["step_s"] * done["steps"], "steps": done["steps"], "shard_s": 0.0, "bytes_written": 0,
            "epochs": epochs, "lr": lr, "init": "previous night's weights" if init else "scratch"}


# ------------------------------------------------------------------ the Sluice arms

# One night as the deployment runs it: a fresh process, timed from its start before any import,
# less starting Prefect's embedded API (a deployment's server is already up).
NIGHT = """
import time
START = time.time()
import json, sys
from pathlib import Path
from benchmarks.pipeline import start_embedded_api
api_s = start_embedded_api()
import sluice.flows.nightly as fl
flow_start = time.time()
r = fl.nightly(json.loads(sys.argv[1]))
end = time.time()
lines = (Path(r["run_dir"]) / "metrics.jsonl").read_text().splitlines()
evals = [json.loads(x)["eval"] for x in lines if x.startswith('{"eval"')]
since = lambda t: t - START - api_s
p, t, d = r["promotion"], r["train"], r["dataset"]
print("RESULT " + json.dumps({
    "evals": [{"step": e["step"], "acc": e["acc"], "wall_s": since(e["wall_time"])} for e in evals],
    "wall_s": since(end), "api_s": api_s, "startup_s": flow_start - START - api_s, "flow_s": end - flow_start,
    "dataset": {k: d[k] for k in ("root", "fingerprint", "counts", "reused", "seconds")},
    "train_s": t["wall_s"], "steps": t["steps"], "loop_s": t["summary"].get("elapsed_s"),
    "host": t["summary"].get("host"), "verify_s": (r.get("verify") or {}).get("seconds"),
    "promotion": {"model_id": p["model_id"], "promoted": p["promoted"], "reason": p["reason"],
                  "val_acc": p["candidate_value"], "champion_val_acc": p.get("champion_value"),
                  "champion_before": p.get("champion_before"), "test_acc": p["report"]["acc"],
                  "unseen": p["unseen"],
                  "warm": {k: v for k, v in (p.get("warm") or {}).items() if k not in ("subset", "replayed_keys", "checkpoint")}}}))
"""


def sluice_config(arm: str, root: Path, source: Path, seed: int, quick: bool,
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The arm's config for one night; ``extra`` (a sweep's settings) goes over the arm's own."""
    from sluice.flows.config import merge
    over = {"data_root": str(root),
            "prepare": {"ingest": {"source": str(source)}, "shard": {"progress": False}},
            "train": {"seed": seed, "progress": False, **({"epochs": QUICK_EPOCHS} if quick else {})},
            "loader": {"seed": seed, "sampler": {"seed": seed}}, "selection": {"seed": seed}}
    return merge(merge(over, SLUICE_ARMS[arm]), extra or {})


def steps_per_pass(cfg: dict[str, Any], keys: list[str]) -> int:
    """About one epoch of tonight's run in steps (its evaluation interval): every train-split
    sample from scratch, or what a warm start would train on (new + replay) when there is a
    champion to start from."""
    from sluice.flows.pipeline import PipelineConfig
    from sluice.stages.data.split import split_of
    from sluice.storage.lineage import hash_keys
    from sluice.storage.registry import Registry
    c = PipelineConfig.model_validate(cfg)
    train = [k for k in keys if split_of(k, c.prepare.ingest, has_test=True) == "train"]
    n = len(train)
    champ = Registry(c.registry_dir()).champion() if c.warm.init != "scratch" else None
    seen = Registry(c.registry_dir()).trained_hashes(champ) if champ else None
    if seen is not None:
        new = int((~np.isin(hash_keys(train), seen)).sum())
        n = new + c.warm.replay_count(n - new, new) if new else n
    return max(1, n // c.ranks() // c.train.batch_size)


def version_bytes(root: Path) -> tuple[int, int, int]:
    """(every file's bytes written into the version's directory, the manifest's, and the bytes of
    every file the version reads, its parents' included: what the whole version would take)."""
    from sluice.storage.manifest import read_manifest
    files = [p for p in root.rglob("*") if p.is_file()]
    return (sum(p.stat().st_size for p in files), (root / "manifest.json").stat().st_size,
            read_manifest(root).total_bytes())


def overlaps(data_root: Path, version: Path, model_id: str) -> dict[str, Any]:
    """Our own check of the promotion's fairness: the candidate's and the champion's recorded
    training keys against the val split of tonight's version (the split promotion decides on);
    and the champion's test accuracy after the night (the model a deployment would serve)."""
    from sluice.storage.lineage import overlap, split_key_hashes
    from sluice.storage.registry import Registry
    reg = Registry(data_root / "registry")
    val = split_key_hashes(version, ["val"])
    champ = reg.champion()
    out: dict[str, Any] = {"split": "val", "samples": int(val.size)}
    for who, rec in (("candidate", reg.get(model_id)), ("champion", champ)):
        hashes = reg.trained_hashes(rec) if rec else None
        out[who] = None if hashes is None else overlap(hashes, val)
    out["champion_model"] = champ.model_id if champ else None
    out["champion_test_acc"] = ((champ.metrics or {}).get("test") or {}).get("acc") if champ else None
    return out


def run_sluice(arm: str, data_root: Path, npz: Path, night: dict[str, Any], seed: int, quick: bool,
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg = sluice_config(arm, data_root, npz, seed, quick, extra)
    cfg["train"]["eval_every_steps"] = steps_per_pass(cfg, [f"fm-{i}" for i in night["shown"]])
    out = subprocess.run([sys.executable, "-c", NIGHT, json.dumps(cfg)], capture_output=True, text=True,
                         cwd=ROOT, timeout=3 * 3600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"{arm} night {night['night']} seed {seed} failed:\n{out.stdout[-2000:]}\n"
                           f"{out.stderr[-4000:]}")
    r = json.loads(line[len("RESULT "):])
    version = Path(r["dataset"]["root"])
    total, manifest, whole = version_bytes(version)
    samples = sum(r["dataset"]["counts"].values())  # every split's, the test split's too
    # samples whose stored bytes are new tonight: on night 0 all of them (the test split too),
    # at the whole version's bytes per sample (an incremental version's own files hold fewer)
    changed = samples if night["night"] == 0 else night["added"] + night["relabelled"]
    p = r.pop("promotion")
    return {**r, "test_acc": p["test_acc"], "shard_s": r["dataset"]["seconds"],
            "bytes_written": 0 if r["dataset"]["reused"] else total,
            "manifest_bytes": 0 if r["dataset"]["reused"] else manifest,
            "new_sample_bytes": whole * changed / max(samples, 1),
            "eval_every_steps": cfg["train"]["eval_every_steps"], "promotion": p,
            "overlap": overlaps(data_root, version, p["model_id"])}


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
