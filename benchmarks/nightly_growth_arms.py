"""The arms of ``benchmarks.nightly_growth``, one night each in a fresh process: the plain baseline
from scratch or from its previous night's weights (``run_plain``), and the deployment's nightly
flow on its own data root (``run_sluice``), with what each night wrote and the promotion's
fairness check.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import RESULTS
from benchmarks.hostinfo import results_name

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("plain scratch", "plain fine-tune", "sluice nightly")
SLUICE_ARMS: dict[str, dict[str, Any]] = {"sluice nightly": {}}
# Quick mode's epochs, both plain arms' scratch budget and Sluice's: BatchNorm's running statistics
# need some 60 steps before an evaluation means anything (3 epochs of 3,000 tested at chance)
QUICK_EPOCHS = 6


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
    "dataset": {"root": d.root, "fingerprint": d.fingerprint, "counts": d.counts, "reused": d.reused,
                "seconds": sum(v.seconds for v in d.sources)},
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
    # one dataset folder night after night, whatever the night's file is called (a growing source)
    over = {"data_root": str(root),
            "data": {"source": str(source), "name": "fashion-mnist", "shard": {"progress": False},
                     "loader": {"seed": seed, "sampler": {"seed": seed}}},
            "train": {"seed": seed, "progress": False, **({"epochs": QUICK_EPOCHS} if quick else {})},
            "selection": {"seed": seed}}
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
    train = [k for k in keys if split_of(k, c.data.ingest, has_test=True) == "train"]
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
