"""Text nights on a grown corpus (#47): what a warm start from the champion costs and reaches
against training from scratch, measured through the real nightly flow.

**Goal**, fixed before any run: ``warm_half`` (the champion's weights, half of the recipe's
``train.max_steps``) reaches within 0.02 bits per byte of ``scratch`` on tonight's val (the median
over seeds of the paired difference) at ≤ 0.7× its wall time (the median over seeds of the paired
ratio). ``GOALS`` holds the figures; the results file says met or missed.

**Data**: the Debian text corpus (``sluice.stages.data.text.debian.build_corpus(out, limit=N)``:
``gcide.jsonl``, ``fortunes.parquet``, ``pydocs/``), the text recipe's three sources at its
weights, cached under ``benchmarks/.cache/text_growth/``. Night 1 reads the corpus with the
``.jsonl`` cut to its first ``fraction`` of entries; night 2 reads it grown to all of them: the
first entries kept as they were and the rest appended, each keyed by its ``id`` field
(``stages/data/text/sources.py``), so an unchanged entry keeps its key and the prepare stage
writes gcide's new version on top of the last (the other two sources are reused as they are).
One corpus path, rewritten between nights, as a user's source grows.

**Nights**, per seed (``train.seed`` 0, 1, 2), each in a fresh process through Prefect's embedded
API (``sluice.flows.nightly.nightly``), ``nproc`` = this machine's cores unless ``--nproc``:
night 1 from an empty data root (it shards, learns the tokenizer and registers the first
champion), then that data root kept and restored on the same path before each arm
(``fresh_root``: a copy at another path cannot warm-start), so that every arm's night 2 starts
from the same champion and reads the same grown corpus. The arms of night 2, their order rotated from seed
to seed (the host's speed drifts over minutes; interleaving is the defence):

* ``scratch``: ``warm.init: scratch``, the recipe's ``train.max_steps``;
* ``warm``: ``warm.init: champion`` with the recipe's warm settings (``warm.max_steps`` unset: the
  recipe's ``train.max_steps``; every old document replayed; ``warm.lr_scale`` 0.5);
* ``warm_half``: the same with ``warm.max_steps`` = half of ``train.max_steps``.

The budgets are fixed before the first night and recorded in the file (``budgets``).

**Measured** per arm and seed: the night's wall clock, from the process's start to the flow's end
less starting Prefect's embedded API (a deployment's server is already up): every other cost is
in it — imports, the prepare stage's incremental shard, verify, training (torchrun's start
included), grading the candidate and the champion on tonight's val, the registry, the report and
gc — and its parts, each stage's own call timed in the night's process (``prepare_s``: the
prepare stage; ``verify_s``; ``plan_s``: the warm plan; ``train_s``: training, torchrun's start
included; ``grade_s``: grading the candidate and the champion on tonight's val and the registry;
``rest_s``: the flow's other seconds, Prefect's tasks, the report and gc); the training steps; the candidate's val bits per byte
(``promotion.candidate_value``), the champion's on tonight's val (``promotion.champion_value``)
and whether the candidate was promoted. Per arm: the median and min–max over seeds; for the
warm arms, their wall time over scratch's and their bits per byte less scratch's, paired by seed.

    python -m benchmarks.text_growth            # the recipe's settings: limit 300, 200 steps (~8-10 min on 2 cores)
    python -m benchmarks.text_growth --quick    # limit 40, 60 steps, 3 seeds (~5 min on 2 cores): text_growth_quick.json
    python -m benchmarks.text_growth --tiny --out /tmp/t.json   # one seed, 4 steps, 1 rank: ~2 min, a check that it runs

Writes ``benchmarks/results/text_growth.json`` (``--quick``: ``text_growth_quick.json``) after
every night, so an interrupted run keeps what it measured.
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

from benchmarks.common import RESULTS, table, write_result
from benchmarks.hostinfo import describe_run, load_average
from benchmarks.results_page import _x, provenance

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "benchmarks" / ".cache" / "text_growth"
ARMS = ("scratch", "warm", "warm_half")
# warm_half against scratch, paired by seed, medians over seeds
GOALS = {"arm": "warm_half", "bpb_within": 0.02, "time_ratio": 0.7}
# max_steps None: the text recipe's train.max_steps (and its eval_every_steps); fraction: the share
# of gcide's entries night 1 holds
MODES: dict[str, dict[str, Any]] = {
    "full": {"limit": 300, "fraction": 0.5, "max_steps": None, "seeds": [0, 1, 2]},
    "quick": {"limit": 40, "fraction": 0.5, "max_steps": 60, "seeds": [0, 1, 2]},
    "tiny": {"limit": 12, "fraction": 0.5, "max_steps": 4, "seeds": [0], "nproc": 1,
             "train": {"model_kwargs": {"n_layer": 1, "n_head": 2, "d_model": 32, "max_len": 64}},
             "data": {"seq_len": 64, "shard": {"vocab_size": 300}}},
}

# One night as the deployment runs it: a fresh process, timed from its start before any import,
# less starting Prefect's embedded API (as benchmarks.pipeline.start_embedded_api and
# benchmarks.nightly_growth_arms do).
NIGHT = """
import time
START = time.time()
import json, sys
import sluice.flows  # its environment defaults precede Prefect's import
from prefect import flow

@flow(name="warm-up")
def warm_up():
    return 1
t = time.perf_counter()
warm_up()
api_s = time.perf_counter() - t
import sluice.flows.nightly as fl
import sluice.stages.run.promote as promote, sluice.stages.run.training as training, sluice.stages.run.warm as warm
from sluice.stages.kinds.tokens import TokenKind
SPENT = {}

def timed(owner, name, label):  # the seconds each stage's own call takes, Prefect's task around it not
    f = getattr(owner, name)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            SPENT[label] = SPENT.get(label, 0.0) + time.perf_counter() - t0
    setattr(owner, name, wrapper)
for owner, name, label in ((fl, "prepare_data", "prepare_s"), (TokenKind, "verify", "verify_s"),
                           (warm, "plan_start", "plan_s"), (training, "run_training", "train_s"),
                           (promote, "evaluate_and_promote", "grade_s")):
    timed(owner, name, label)
flow_start = time.time()
r = fl.nightly(json.loads(sys.argv[1]))
end = time.time()
p, t, d = r["promotion"], r["train"], r["dataset"]
since = lambda x: x - START - api_s
print("RESULT " + json.dumps({
    "wall_s": since(end), "api_s": api_s, "startup_s": flow_start - START - api_s, "flow_s": end - flow_start,
    **SPENT, "rest_s": end - flow_start - sum(SPENT.values()), "loop_s": t["summary"].get("elapsed_s"),
    "steps": t["steps"], "world_size": t["summary"].get("world_size"), "host": t["summary"].get("host"),
    "dataset": {"fingerprint": d.fingerprint, "counts": d.counts, "tokens": d.tokens,
                "sources": [{"name": s.name, "reused": s.reused, "seconds": s.seconds, "counts": s.counts,
                             "added": sum((s.delta or {}).get("added", {}).values()) if s.delta else None}
                            for s in d.sources]},
    "promotion": {"model_id": p["model_id"], "promoted": p["promoted"], "reason": p["reason"],
                  "metric": p["metric"], "candidate_bpb": p["candidate_value"], "champion_bpb": p.get("champion_value"),
                  "champion_before": p.get("champion_before"),
                  "by_source": {k: {"candidate": v["candidate"], "champion": v["champion"]}
                                for k, v in p["by_source"].items()},
                  "warm": {k: v for k, v in (p.get("warm") or {}).items()
                           if k not in ("subsets", "replayed_keys", "checkpoint", "selector_state")}}}))
"""


# ------------------------------------------------------------------ the corpus

def corpus(limit: int) -> dict[str, Path]:
    """The three Debian sources at ``limit`` documents each (cached)."""
    from sluice.stages.data.text.debian import build_corpus
    out = CACHE / f"limit{limit}"
    if not (out / ".complete").exists():
        shutil.rmtree(out, ignore_errors=True)
        build_corpus(out, limit=limit)
        (out / ".complete").write_text(json.dumps({"limit": limit}))
    return {"gcide": out / "gcide.jsonl", "fortunes": out / "fortunes.parquet", "pydocs": out / "pydocs"}


def write_night(full: dict[str, Path], dest: Path, gcide_entries: int) -> dict[str, Path]:
    """The corpus at ``dest`` with gcide.jsonl holding its first ``gcide_entries`` entries as they
    are (a larger count keeps every earlier line byte for byte: a grown source)."""
    dest.mkdir(parents=True, exist_ok=True)
    if not (dest / "pydocs").exists():
        shutil.copytree(full["pydocs"], dest / "pydocs")
        shutil.copyfile(full["fortunes"], dest / "fortunes.parquet")
    lines = full["gcide"].read_bytes().splitlines(keepends=True)[:gcide_entries]
    tmp = dest / ".gcide.jsonl.tmp"
    tmp.write_bytes(b"".join(lines))
    tmp.replace(dest / "gcide.jsonl")
    return {"gcide": dest / "gcide.jsonl", "fortunes": dest / "fortunes.parquet", "pydocs": dest / "pydocs"}


# ------------------------------------------------------------------ the nights

def recipe_budget() -> dict[str, Any]:
    """The text recipe's step budget, evaluation interval and warm settings, as the file holds them."""
    from sluice.flows.recipe import load_recipe
    r = load_recipe("text")
    return {"max_steps": r["train"]["max_steps"], "eval_every_steps": r["train"].get("eval_every_steps"),
            "warm": r.get("warm") or {}, "weights": {s["name"]: s["weight"] for s in r["data"]["sources"]}}


def budgets(mode: dict[str, Any], recipe: dict[str, Any]) -> dict[str, Any]:
    """Each arm's night-2 settings, fixed before the first night."""
    steps = mode["max_steps"] or recipe["max_steps"]
    every = recipe["eval_every_steps"] if not mode["max_steps"] else max(1, steps // 2)
    return {"max_steps": steps, "eval_every_steps": every,
            "arms": {"scratch": {"warm": {"init": "scratch"}, "steps": steps},
                     "warm": {"warm": {"init": "champion"}, "steps": steps},
                     "warm_half": {"warm": {"init": "champion", "max_steps": steps // 2}, "steps": steps // 2}}}


def night_config(root: Path, src: dict[str, Path], seed: int, nproc: int, budget: dict[str, Any],
                 mode: dict[str, Any], weights: dict[str, float], warm: dict[str, Any] | None) -> dict[str, Any]:
    from sluice.flows.config import merge
    cfg = {"recipe": "text", "data_root": str(root), "nproc": nproc,
           "data": {"sources": [{"name": n, "source": str(src[n]), "weight": w} for n, w in weights.items()],
                    "shard": {"progress": False}},
           "train": {"seed": seed, "max_steps": budget["max_steps"], "eval_every_steps": budget["eval_every_steps"]},
           **({"warm": warm} if warm else {})}
    return merge(cfg, {k: mode[k] for k in ("train", "data") if k in mode})


def run_night(cfg: dict[str, Any]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", NIGHT, json.dumps(cfg)], capture_output=True, text=True,
                         cwd=ROOT, timeout=3600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"night failed ({json.dumps(cfg)}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def fresh_root(root: Path, night1: Path, keep: Path) -> None:
    """``root`` as night 1 left it: the last night's data root moved to ``keep``, then night 1's
    copied back in its place. On the same path, not a copy beside it: a text dataset version
    records its tokenizer by its absolute path under the data root (the shard config's
    ``tokenizer_file``), so a copy at another path writes the grown source's version whole, with
    no ancestor, and the champion cannot be warm-started from."""
    root.rename(keep)
    shutil.copytree(night1, root)


def order(seed_index: int) -> list[str]:
    """The arms' order for the ``seed_index``-th seed: rotated by one each seed."""
    k = seed_index % len(ARMS)
    return list(ARMS[k:] + ARMS[:k])


def _brief(r: dict[str, Any]) -> str:
    p, w = r["promotion"], r["promotion"]["warm"]
    champ = "" if p["champion_bpb"] is None else f" (champion {p['champion_bpb']:.4f})"
    return (f"  seed {r['seed']} night {r['night']} {r['arm']:<9}: val_bpb {p['candidate_bpb']:.4f}{champ}, "
            f"{'promoted' if p['promoted'] else 'not promoted'}, {r['steps']} steps, wall {r['wall_s']:.1f} s "
            f"(start {r['startup_s']:.1f}, prepare {r['prepare_s']:.1f}, verify {r['verify_s']:.1f}, "
            f"plan {r['plan_s']:.1f}, train {r['train_s']:.1f}, grade {r['grade_s']:.1f}, rest {r['rest_s']:.1f}), "
            f"weights: {w.get('init')}"
            + (f" ({w.get('new')} new + {w.get('replayed')} replayed)" if w.get("parent_model") else ""))


# ------------------------------------------------------------------ the summary

def _stats(xs: list[float | None]) -> dict[str, Any]:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm, the median and min–max over seeds; the warm arms paired with scratch by seed; the goal."""
    by = {(r["arm"], r["seed"]): r for r in runs if r["night"] == 2}
    seeds = sorted({s for _, s in by})
    arms: dict[str, Any] = {}
    for arm in ARMS:
        rs = [by[(arm, s)] for s in seeds if (arm, s) in by]
        if not rs:
            continue
        a = {k: _stats([r[k] for r in rs]) for k in ("wall_s", "startup_s", "prepare_s", "verify_s", "plan_s", "train_s", "grade_s", "rest_s", "steps")}
        a["candidate_bpb"] = _stats([r["promotion"]["candidate_bpb"] for r in rs])
        a["champion_bpb"] = _stats([r["promotion"]["champion_bpb"] for r in rs])
        a["promoted"] = sum(bool(r["promotion"]["promoted"]) for r in rs)
        a["seeds"] = len(rs)
        pairs = [(by[(arm, s)], by[("scratch", s)]) for s in seeds if (arm, s) in by and ("scratch", s) in by]
        if arm != "scratch" and pairs:
            a["vs_scratch"] = {
                "wall_ratio": _stats([w["wall_s"] / c["wall_s"] for w, c in pairs]),
                "train_ratio": _stats([w["train_s"] / c["train_s"] for w, c in pairs]),
                "bpb_delta": _stats([w["promotion"]["candidate_bpb"] - c["promotion"]["candidate_bpb"] for w, c in pairs]),
                "per_seed": [{"seed": w["seed"], "wall_ratio": w["wall_s"] / c["wall_s"],
                              "bpb_delta": w["promotion"]["candidate_bpb"] - c["promotion"]["candidate_bpb"]}
                             for w, c in pairs]}
        arms[arm] = a
    g = (arms.get(GOALS["arm"]) or {}).get("vs_scratch")
    goal: dict[str, Any] = {**GOALS, "bpb_delta": None, "wall_ratio": None, "bpb_met": None, "time_met": None,
                            "met": None}
    if g and g["bpb_delta"]["median"] is not None:
        goal.update(bpb_delta=g["bpb_delta"]["median"], wall_ratio=g["wall_ratio"]["median"],
                    bpb_met=g["bpb_delta"]["median"] <= GOALS["bpb_within"],
                    time_met=g["wall_ratio"]["median"] <= GOALS["time_ratio"])
        goal["met"] = goal["bpb_met"] and goal["time_met"]
    return {"arms": arms, "goal": goal}


def print_table(summary: dict[str, Any]) -> None:
    rows = []
    for arm, a in summary["arms"].items():
        v = a.get("vs_scratch") or {}
        rows.append({"arm": arm, "steps": a["steps"]["median"], "wall s": a["wall_s"]["median"],
                     "wall min-max": f"{a['wall_s']['min']:.1f}-{a['wall_s']['max']:.1f}",
                     "train s": a["train_s"]["median"], "val_bpb": a["candidate_bpb"]["median"],
                     "bpb min-max": f"{a['candidate_bpb']['min']:.4f}-{a['candidate_bpb']['max']:.4f}",
                     "champion bpb": a["champion_bpb"]["median"], "promoted": f"{a['promoted']}/{a['seeds']}",
                     "wall / scratch": (v.get("wall_ratio") or {}).get("median"),
                     "bpb - scratch": (v.get("bpb_delta") or {}).get("median")})
    print(table(rows, list(rows[0])))
    g = summary["goal"]
    if g["met"] is not None:
        print(f"goal ({g['arm']}: within {g['bpb_within']} bpb of scratch at <= {g['time_ratio']}x its wall time): "
              f"{'met' if g['met'] else 'missed'} (bpb {g['bpb_delta']:+.4f}, wall {g['wall_ratio']:.2f}x)")


# ------------------------------------------------------------------ its section of docs/results.md

def _bpb(v: float | None) -> str:
    return "—" if v is None else f"{v:.4f}"


def _d(v: float | None) -> str:
    return "—" if v is None else f"{v:+.4f}"


def _stat(s: dict[str, Any] | None, fmt: Any = _bpb) -> str:
    """The median and (min–max) of a summary; ``min to max`` where the figures carry a sign."""
    if not s or s.get("median") is None:
        return "—"
    sep = " to " if fmt is _d else "–"
    return f"{fmt(s['median'])} ({fmt(s['min'])}{sep}{fmt(s['max'])})"


def results_section(d: dict[str, Any], name: str = "text_growth.json") -> list[str]:
    """Text nights on a grown corpus: warm starts from the champion against scratch, per arm."""
    c, b, s = d["corpus"], d["budgets"], d["summary"]
    secs = lambda v: f"{v:,.1f}"  # noqa: E731
    lines = [f"A text night on a grown corpus (the text recipe, `data.kind: tokens`): the Debian corpus at "
             f"{c['limit']} documents a source, night 1 with gcide.jsonl cut to its first {c['night1_entries']} "
             f"of {c['night2_entries']} entries, night 2 with it grown to all of them (the other two sources "
             f"unchanged). Per seed (`train.seed`) one night 1, its data root restored on the same path before "
             f"each arm, so every arm starts from the same champion; every night a fresh process through the "
             f"nightly flow, {d['nproc']} rank{'s' if d['nproc'] != 1 else ''}, the arms' order rotated from "
             f"seed to seed. `scratch`: `warm.init: scratch`, {b['max_steps']} steps; `warm`: "
             f"`warm.init: champion`, the recipe's warm settings ({b['arms']['warm']['steps']} steps); "
             f"`warm_half`: the same at {b['arms']['warm_half']['steps']} steps. Wall: the night's process from "
             "its start to the flow's end (less starting Prefect's embedded API): the incremental shard, verify, "
             "training, grading the candidate and the champion, the registry. Val bits per byte on night 2's "
             "val split (lower is better); median (min–max) over seeds; the ratios and differences against "
             "`scratch` paired by seed:", "",
             "| arm | steps | wall s | of it training s | candidate val bpb | champion val bpb | promoted "
             "| wall / scratch | bpb − scratch |", "|---|---|---|---|---|---|---|---|---|"]
    for arm, a in s["arms"].items():
        v = a.get("vs_scratch") or {}
        lines.append(f"| `{arm}` | {a['steps']['median']:.0f} | {_stat(a['wall_s'], secs)} | "
                     f"{_stat(a['train_s'], secs)} | {_stat(a['candidate_bpb'])} | {_stat(a['champion_bpb'])} | "
                     f"{a['promoted']}/{a['seeds']} | {_stat(v.get('wall_ratio'), _x) if v else '—'} | "
                     f"{_stat(v.get('bpb_delta'), _d) if v else '—'} |")
    parts = ("startup_s", "prepare_s", "verify_s", "plan_s", "train_s", "grade_s", "rest_s")
    names = ("imports", "prepare (incremental shard)", "verify", "warm plan", "training", "grading both models "
             "+ registry", "Prefect's tasks, report, gc")
    lines += ["", "Where a night's seconds go (medians): " + "; ".join(
        f"`{arm}` " + ", ".join(f"{n} {a[k]['median']:.1f}" for k, n in zip(parts, names) if a.get(k))
        for arm, a in s["arms"].items()) + "."]
    g = s["goal"]
    lines.append("")
    if g["met"] is None:
        lines.append(f"Goal (`{g['arm']}` within {g['bpb_within']} bpb of `scratch` at ≤ {g['time_ratio']}× its "
                     "wall time, medians of the paired figures): not measured.")
    else:
        lines.append(f"Goal (`{g['arm']}` within {g['bpb_within']} bpb of `scratch` at ≤ {g['time_ratio']}× its "
                     f"wall time, medians of the paired figures): **{'met' if g['met'] else 'missed'}** "
                     f"({_d(g['bpb_delta'])} bpb: {'met' if g['bpb_met'] else 'missed'}; "
                     f"{_x(g['wall_ratio'])}: {'met' if g['time_met'] else 'missed'}).")
    for arm in ("warm", "warm_half"):
        a = s["arms"].get(arm)
        if not a or not a.get("vs_scratch"):
            continue
        v = a["vs_scratch"]
        seeds = v["per_seed"]
        reached = sum(x["bpb_delta"] <= 0 for x in seeds)
        within = sum(x["bpb_delta"] <= GOALS["bpb_within"] for x in seeds)
        lines[-1] += (f" `{arm}` ({a['steps']['median']:.0f} steps) reached scratch's bits per byte or better on "
                      f"{reached} of {len(seeds)} seeds (within {GOALS['bpb_within']} on {within}), at "
                      f"{_x(v['wall_ratio']['median'])} its wall time and {_x(v['train_ratio']['median'])} its "
                      "training time (medians).")
    la = [r["load_average"][0] for r in d["runs"] if r.get("load_average")]
    if la:
        lines += ["", f"The host's 1-minute load average at each night's start: {min(la):.1f}–{max(la):.1f} "
                      f"({d['nproc']} cores): the wall figures move with it, the bits per byte do not (a seed's "
                      "training is deterministic)."]
    return lines + ["", provenance(d, name)]


# ------------------------------------------------------------------ main

def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="limit 40, 60 steps, 3 seeds: text_growth_quick.json")
    ap.add_argument("--tiny", action="store_true", help="one seed, a few steps of a tiny model (the smoke test)")
    ap.add_argument("--seeds", type=int, nargs="+", default=None)
    ap.add_argument("--nproc", type=int, default=None, help="training ranks (default: this machine's cores)")
    ap.add_argument("--out", type=Path, default=None, help="results file (default benchmarks/results/text_growth[_quick].json)")
    ap.add_argument("--work", type=Path, default=None, help="where the data roots go (kept; default a temporary folder)")
    args = ap.parse_args(argv)
    mode_name = "tiny" if args.tiny else "quick" if args.quick else "full"
    mode = MODES[mode_name]
    seeds = args.seeds or mode["seeds"]
    nproc = args.nproc or mode.get("nproc") or os.cpu_count() or 1
    recipe = recipe_budget()
    budget = budgets(mode, recipe)
    about = describe_run("benchmarks.text_growth", sys.argv[1:] if argv is None else argv)
    full = corpus(mode["limit"])
    n_all = len(full["gcide"].read_bytes().splitlines())
    n1 = max(1, math.ceil(mode["fraction"] * n_all))
    path = args.out or RESULTS / ("text_growth" + ("" if mode_name == "full" else f"_{mode_name}") + ".json")
    work = args.work or Path(tempfile.mkdtemp(prefix="sluice-text-growth-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", str(work / "prefect"))  # every night's process inherits it
    runs: list[dict[str, Any]] = []
    result = {**about, "mode": mode_name, "seeds": seeds, "nproc": nproc, "goals": GOALS,
              "corpus": {"limit": mode["limit"], "fraction": mode["fraction"], "night1_entries": n1,
                         "night2_entries": n_all, "grown_source": "gcide"},
              "recipe": recipe, "budgets": budget, "overrides": {k: mode[k] for k in ("train", "data") if k in mode},
              "runs": runs}
    t0 = time.time()

    def save() -> None:
        result.update(summary=summarise(runs), total_s=time.time() - t0, load_average_end=load_average())
        if args.out:
            from sluice.storage.atomic import write_json
            args.out.parent.mkdir(parents=True, exist_ok=True)
            write_json(args.out, result)
        else:
            write_result(path.stem, result)

    weights = recipe["weights"]
    try:
        for i, seed in enumerate(seeds):
            d = work / f"seed{seed}"
            root = d / "root"  # every night of this seed runs on this path (see ``fresh_root``)
            src = write_night(full, work / "text-corpus", n1)  # the corpus as it was on night 1
            la = load_average()
            r = run_night(night_config(root, src, seed, nproc, budget, mode, weights, None))
            runs.append({**r, "arm": "night1", "night": 1, "seed": seed, "load_average": la})
            print(_brief(runs[-1]), flush=True)
            shutil.copytree(root, d / "night1")  # the champion every arm starts from
            write_night(full, work / "text-corpus", n_all)  # the source grew
            for pos, arm in enumerate(order(i)):
                fresh_root(root, d / "night1", d / (order(i)[pos - 1] if pos else "night1-run"))
                la = load_average()
                r = run_night(night_config(root, src, seed, nproc, budget, mode, weights,
                                           budget["arms"][arm]["warm"]))
                runs.append({**r, "arm": arm, "night": 2, "seed": seed, "position": pos, "load_average": la})
                print(_brief(runs[-1]), flush=True)
                save()
            root.rename(d / order(i)[-1])
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    save()
    print_table(result["summary"])
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
