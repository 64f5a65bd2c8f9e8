"""InfoBatch on packed token rows against no selection (issue #41): does pruning rows a language
model already predicts well save compute at equal validation loss?

    python -m benchmarks.token_selection           # benchmarks/results/token_selection-<class>.json
    python -m benchmarks.token_selection --quick   # about 5 minutes: token_selection-<class>_quick.json
    python -m benchmarks.token_selection --tiny    # seconds, the test's: *_tiny.json

Data: the text recipe's three Debian sources (``sluice.stages.data.text.debian``: dict-gcide,
fortunes, python3.11-doc), limited to the first documents of each (``SETTINGS[mode]["limit"]``;
full: 300 gcide, 300 fortunes, 10 pydocs; quick: 200, 200, 6), sharded by ``shard_text`` with the recipe's shard config
(BPE 2048, one tokenizer learnt on gcide and shared, val 5%), cached under
``benchmarks/.cache/token_selection/``. Every train document once per epoch (a mixture of the three,
repeat 1.0), packed into rows of 128 tokens, 8 rows a step, one rank, one torch thread.

Model and optimiser: the text recipe's (``flows/recipes/text.yaml``: gpt, 2 layers x 128, 4 heads;
AdamW 3e-3, weight decay 0.1, one-cycle with warm-up 0.1, clip 1.0), fp32, ``epochs`` epochs (full
4, quick 3: InfoBatch prunes nothing in epoch 0, it has no losses yet). Evaluated once at the end:
the loss per token on the val split of every source that has one (10 pydocs documents leave
pydocs' val split empty).

Arms, seeds 0, 1, 2 (a seed fixes the weights' init and the mixture's order, so arms pair by seed):
  none        every row, ``epochs`` epochs;
  infobatch   ``selection: {method: infobatch}`` with its defaults (prune 0.5, anneal 0.875,
              sync_every 16, mode auto = drop on the CPU), keyed by document
              (``select.infobatch_tokens.InfoBatchRows``), ``epochs`` epochs;
  none_equal  no selection for as many rows as infobatch's median over the seeds (``max_steps``
              = that / 8, the one-cycle schedule over those steps): the equal-compute control.
``none`` and ``infobatch`` run interleaved, their order rotated per seed; ``none_equal`` runs after
them (its budget is read from infobatch's rows). Counted per arm: rows trained (per step, from the
step metrics with ``log_every_steps: 1``; per epoch beside rows offered), the trainer's elapsed
seconds, wall seconds of the run (loaders, training, the evaluation) and the val loss per token.
Rows trained and val loss do not move with the host's load; seconds do (the file records the load).

The verdict compares paired per-seed differences of val loss: at equal epochs (infobatch - none)
and at equal rows (infobatch - none_equal). A direction is claimed only when all three seeds agree.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, table
from benchmarks.hostinfo import class_of, describe_run, load_average, results_name
from benchmarks.results_page import _la, _pct, provenance

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "benchmarks" / ".cache" / "token_selection"
SOURCES = ("gcide", "fortunes", "pydocs")
SEEDS = (0, 1, 2)
ARMS = ("none", "infobatch")  # interleaved, rotated; then none_equal
RECIPE_MODEL = {"n_layer": 2, "n_head": 4, "d_model": 128, "max_len": 128}
SETTINGS: dict[str, dict[str, Any]] = {
    "full": {"limit": {"gcide": 300, "fortunes": 300, "pydocs": 10}, "vocab": 2048, "model": RECIPE_MODEL,
             "seq_len": 128, "batch": 8, "eval_batch": 16, "epochs": 4},
    "quick": {"limit": {"gcide": 200, "fortunes": 200, "pydocs": 6}, "vocab": 2048, "model": RECIPE_MODEL,
              "seq_len": 128, "batch": 8, "eval_batch": 16, "epochs": 3},
    "tiny": {"limit": {"gcide": 40, "fortunes": 40, "pydocs": 2}, "vocab": 300,
             "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "max_len": 32},
             "seq_len": 32, "batch": 8, "eval_batch": 8, "epochs": 3}}
# the text recipe's optimiser (flows/recipes/text.yaml), fp32 on one thread
OPTIM = {"optimizer": "adamw", "lr": 3e-3, "weight_decay": 0.1, "schedule": "onecycle", "warmup_fraction": 0.1,
         "clip_grad_norm": 1.0}


def log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


# ================================================================== data
def corpus(s: dict[str, Any]) -> dict[str, str]:
    """The three sources' token artifacts (``{name: version directory}``): the raw text through
    ``benchmarks.tokens_common.debian_text`` (cached per limit), sharded as the text recipe does (the
    tokenizer learnt on the first source and shared; cached by the shard stage's fingerprint)."""
    from benchmarks.tokens_common import debian_text
    from sluice.stages.data.text import TextShardConfig, shard_text
    tag = "-".join(f"{k}{v}" for k, v in s["limit"].items())
    text = debian_text(CACHE / f"text-{tag}", s["limit"])
    roots: dict[str, str] = {}
    first = None
    for name in SOURCES:
        cfg = TextShardConfig(tokenizer="bpe", vocab_size=s["vocab"], val_fraction=0.05, progress=False,
                              tokenizer_file=first)
        out = shard_text(cfg, text[name], CACHE / f"art-{tag}-v{s['vocab']}" / name)
        roots[name] = str(out.root)
        first = first or str(out.root)
    return roots


def describe_corpus(roots: dict[str, str]) -> dict[str, Any]:
    """Documents and tokens per source and split, and the sources graded (a non-empty val split)."""
    from sluice.storage.tokens import open_token_split
    out: dict[str, Any] = {"vocab_size": None, "sources": {}}
    for name, root in roots.items():
        per = {}
        for split in ("train", "val"):
            sp = open_token_split(root, split)
            per[split] = {"documents": len(sp.offsets) - 1, "tokens": int(sp.offsets[-1])}
            out["vocab_size"] = int(sp.vocab_size)
        out["sources"][name] = per
    out["graded"] = [n for n, v in out["sources"].items() if v["val"]["documents"] > 0]
    return out


def loaders(roots: dict[str, str], graded: list[str], s: dict[str, Any], seed: int, doc_keys: bool) -> tuple[Any, Any]:
    """The train loader (every train document once an epoch, order by ``seed``) and the val loader
    over the graded sources."""
    from sluice.stages.load.mixture import MixtureConfig
    from sluice.stages.load.tokens import TokenLoader, TokenLoaderConfig
    mix = MixtureConfig(sources=[{"path": r, "name": n, "repeat": 1.0} for n, r in roots.items()], seed=seed)
    train = TokenLoader(None, TokenLoaderConfig(split="train", seq_len=s["seq_len"], batch_size=s["batch"],
                                                mixture=mix, seed=seed, prefetch=0, doc_keys=doc_keys))
    once = MixtureConfig(sources=[{"path": roots[n], "name": n, "repeat": 1.0} for n in graded])
    val = TokenLoader(None, TokenLoaderConfig(split="val", seq_len=s["seq_len"], batch_size=s["eval_batch"],
                                              mixture=once, prefetch=0))
    return train, val


# ================================================================== one run
def run_arm(arm: str, seed: int, roots: dict[str, str], cinfo: dict[str, Any], s: dict[str, Any],
            max_steps: int | None = None) -> dict[str, Any]:
    """One training run of ``arm`` at ``seed``: rows trained (per step and per epoch), seconds and
    the final val loss per token."""
    from sluice.stages.select import SelectionConfig, build_selector
    from sluice.stages.select.infobatch_tokens import token_row_selector
    from sluice.stages.train import train
    t0 = time.perf_counter()
    tr, ev = loaders(roots, cinfo["graded"], s, seed, doc_keys=arm == "infobatch")
    sel = None
    if arm == "infobatch":
        sel = token_row_selector(build_selector(SelectionConfig(method="infobatch", seed=seed),
                                                split_size=tr.n_doc_keys))
    cfg = {"model": "gpt", "num_classes": cinfo["vocab_size"], "model_kwargs": s["model"], **OPTIM, "batch_size": s["batch"],
           "epochs": s["epochs"], "max_steps": max_steps, "amp": "none", "log_every_steps": 1,
           "eval_every_steps": None, "progress": False, "torch_threads": 1, "seed": seed}
    r = train(cfg, tr, ev, sel)
    wall = time.perf_counter() - t0
    by_epoch: dict[int, dict[str, int]] = {}
    for m in r.metrics:
        n = round(m["samples_per_s"] * m["step_s"])  # this step's rows (log_every_steps 1)
        e = by_epoch.setdefault(int(m["epoch"]), {"trained": 0, "offered": 0})
        e["trained"] += n
        e["offered"] += int(m.get("select/n_candidates", n))
    return {"arm": arm, "seed": seed, "steps": r.steps, "max_steps": max_steps,
            "rows_trained": sum(e["trained"] for e in by_epoch.values()),
            "rows_offered": sum(e["offered"] for e in by_epoch.values()),
            "rows_by_epoch": {str(k): v for k, v in sorted(by_epoch.items())},
            "train_s": r.summary["elapsed_s"], "wall_s": wall,
            "val_loss_per_token": r.evals[-1]["loss"], "val_tokens": r.evals[-1]["n"]}


# ================================================================== summary and verdict
def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm: median, min and max over the seeds of rows trained, seconds and val loss."""
    out = {}
    for arm in dict.fromkeys(r["arm"] for r in runs):
        rs = [r for r in runs if r["arm"] == arm]
        out[arm] = {k: _stats([r[k] for r in rs]) for k in ("rows_trained", "train_s", "wall_s", "val_loss_per_token")}
        out[arm]["seeds"] = [r["seed"] for r in rs]
    return out


def _direction(deltas: list[float]) -> str:
    """``better`` (every seed's loss lower), ``worse`` (every seed's higher) or ``mixed``."""
    if all(d < 0 for d in deltas):
        return "better"
    if all(d > 0 for d in deltas):
        return "worse"
    return "mixed"


def _paired(runs: list[dict[str, Any]], arm: str, against: str) -> dict[str, Any]:
    """Per-seed differences of val loss per token, ``arm`` - ``against`` (negative: ``arm`` better)."""
    by = {(r["arm"], r["seed"]): r for r in runs}
    seeds = [sd for sd in SEEDS if (arm, sd) in by and (against, sd) in by]
    d = [by[(arm, sd)]["val_loss_per_token"] - by[(against, sd)]["val_loss_per_token"] for sd in seeds]
    return {"against": against, "seeds": seeds, "per_seed": d, **_stats(d), "direction": _direction(d)}


def verdict(runs: list[dict[str, Any]], summary: dict[str, Any]) -> dict[str, Any]:
    """The answer, at equal epochs and at equal rows: the rows InfoBatch saved; whether it kept
    none's quality doing so (``saves_compute_at_equal_quality``: not worse in every seed at equal
    epochs); whether its rows beat as many unselected (``beats_equal_rows``: better in every seed
    than none_equal; if not, stopping earlier saves as much)."""
    rows_saved = 1 - summary["infobatch"]["rows_trained"]["median"] / summary["none"]["rows_trained"]["median"]
    epochs = _paired(runs, "infobatch", "none")
    rows = _paired(runs, "infobatch", "none_equal")
    train_ratio = summary["infobatch"]["train_s"]["median"] / summary["none"]["train_s"]["median"]
    saves, beats = epochs["direction"] != "worse", rows["direction"] == "better"

    def said(p: dict[str, Any], what: str, meaning: dict[str, str]) -> str:
        seeds = ", ".join(f"{x:+.3f}" for x in p["per_seed"])
        how = {"better": "lower in every seed", "worse": "higher in every seed",
               "mixed": "signs mixed: no difference measured"}[p["direction"]]
        return (f"{what}: val loss per token {p['median']:+.3f} against {p['against']} (per seed {seeds}; {how}): "
                f"{meaning[p['direction']]}")
    if not saves:
        answer = "No: at equal epochs its saving costs quality" + (
            ", though its rows are worth more than as many unselected." if beats else
            ", and at equal rows it does no better than training fewer steps without selection.")
    elif beats:
        answer = "Yes: none's quality from fewer rows, and better than as many rows unselected."
    else:
        answer = ("Only as much as stopping earlier does: it keeps none's quality from fewer rows, "
                  "but so does no selection trained for as many rows.")
    text = (f"InfoBatch trained {100 * rows_saved:.1f}% fewer rows than none over the same epochs "
            f"(its train seconds {train_ratio:.2f}x none's). "
            + said(epochs, "At equal epochs", {"worse": "the saving costs quality.",
                                               "mixed": "the saving keeps quality, as far as three seeds tell.",
                                               "better": "fewer rows and a lower loss."}) + " "
            + said(rows, "At equal rows", {"worse": "its rows are worth less than as many unselected.",
                                           "mixed": "its rows are worth no more than as many unselected.",
                                           "better": "its rows are worth more than as many unselected."})
            + f" Does InfoBatch save compute at equal quality? {answer}")
    return {"rows_saved_fraction": rows_saved, "train_s_ratio": train_ratio, "equal_epochs": epochs,
            "equal_rows": rows, "saves_compute_at_equal_quality": saves, "beats_equal_rows": beats,
            "answer": answer, "text": text}


# ================================================================== its section of docs/results.md
def results_section(d: dict[str, Any], name: str) -> list[str]:
    """InfoBatch on packed token rows against no selection (issue #41): rows trained, seconds and
    the val loss per token at equal epochs, and against no selection for as many rows."""
    mode = f", {d['mode']} mode" if d.get("mode") and d["mode"] != "full" else ""
    s, c, m = d["settings"], d["corpus"], d["settings"]["model"]
    src = c["sources"]
    docs = ", ".join(f"{v['train']['documents']:,} {k}" for k, v in src.items())
    train_tokens = sum(v["train"]["tokens"] for v in src.values())
    val_tokens = sum(src[k]["val"]["tokens"] for k in c["graded"])
    ib = s["infobatch"]
    lines = [f"#### InfoBatch on token rows against no selection ({class_of(d)}{mode})", "",
             f"A GPT ({m['n_layer']} layers, d {m['d_model']}, {m['n_head']} heads; rows of {s['seq_len']} tokens, "
             f"{s['batch']} a step, vocabulary {c['vocab_size']:,}; the text recipe's optimiser, fp32, one thread) "
             f"trained for {s['epochs']} epochs over the three Debian sources' train splits ({docs} documents, "
             f"{train_tokens:,} tokens), evaluated at the end on the val splits of {', '.join(c['graded'])} "
             f"({val_tokens:,} tokens). Arms: `none`; `infobatch` (its defaults: prune {ib['prune']:g}, anneal "
             f"{ib['anneal']:g}, keyed by document); `none_equal`, no selection for {d['none_equal_steps']:,} steps, "
             "infobatch's median rows (the one-cycle schedule over them): the equal-compute control. "
             f"Median (min–max) over seeds {d['seeds']}; `none` and `infobatch` interleaved, `none_equal` after.", "",
             "| arm | rows trained | train s | wall s | val loss per token |", "|---|---|---|---|---|"]

    def mm(v: dict[str, float], digits: int) -> str:
        return f"{v['median']:,.{digits}f} ({v['min']:,.{digits}f}–{v['max']:,.{digits}f})"
    for arm, v in d["summary"].items():
        lines.append(f"| {arm} | {mm(v['rows_trained'], 0)} | {mm(v['train_s'], 0)} | {mm(v['wall_s'], 0)} | "
                     f"{mm(v['val_loss_per_token'], 4)} |")
    ibr = [r for r in d["runs"] if r["arm"] == "infobatch"]
    if ibr:
        per = [statistics.median(r["rows_by_epoch"][e]["trained"] for r in ibr) for e in sorted(ibr[0]["rows_by_epoch"], key=int)]
        offered = ibr[0]["rows_by_epoch"]["0"]["offered"]
        lines += ["", f"InfoBatch's rows trained per epoch (median over seeds): {', '.join(f'{x:,.0f}' for x in per)} "
                  f"of {offered:,}."]
    n = len(d["verdict"]["equal_rows"]["seeds"])
    lines += ["", f"**Verdict**: {d['verdict']['text']}", "",
              f"A direction is claimed only where all {n} seeds agree, which chance alone gives "
              f"{_pct(2 * 0.5 ** n, 0)} of the time: the paired differences per seed say how far apart the arms are.", "",
              f"Load average {_la(d.get('load_average_start'))} at the start and {_la(d.get('load_average_end'))} at the "
              f"end, {d.get('seconds', 0):.0f} s in all: seconds move with the host's load, rows trained and the loss do not."]
    return lines + ["", provenance(d, name)]


# ================================================================== main
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer documents, 3 epochs: *_quick.json")
    ap.add_argument("--tiny", action="store_true", help="a tiny corpus and model, seconds (the test)")
    ap.add_argument("--out", default=None,
                    help="results file (default benchmarks/results/token_selection-<class>[_quick].json)")
    args = ap.parse_args(argv)
    mode = "tiny" if args.tiny else "quick" if args.quick else "full"
    s = SETTINGS[mode]
    stem = results_name("token_selection") + {"full": "", "quick": "_quick", "tiny": "_tiny"}[mode]
    path = Path(args.out) if args.out else RESULTS / f"{stem}.json"
    prov = describe_run("benchmarks.token_selection", sys.argv[1:] if argv is None else argv)
    t0 = time.perf_counter()
    log(f"== corpus ({mode})")
    roots = corpus(s)
    cinfo = describe_corpus(roots)
    from sluice.stages.select import SelectionConfig
    rec: dict[str, Any] = {**prov, "mode": mode, "seeds": list(SEEDS),
                           "settings": {**s, "optim": OPTIM, "amp": "none", "torch_threads": 1,
                                        "infobatch": SelectionConfig(method="infobatch").method_params.model_dump()},
                           "corpus": cinfo, "runs": []}

    def one(arm: str, seed: int, max_steps: int | None = None) -> None:
        r = run_arm(arm, seed, roots, cinfo, s, max_steps)
        rec["runs"].append(r)
        log(f"{arm} seed {seed}: {r['rows_trained']} rows, {r['train_s']:.1f} s, val {r['val_loss_per_token']:.4f}")
    for i, seed in enumerate(SEEDS):
        for arm in ARMS[i % len(ARMS):] + ARMS[:i % len(ARMS)]:
            one(arm, seed)
    ib = statistics.median(r["rows_trained"] for r in rec["runs"] if r["arm"] == "infobatch")
    rec["none_equal_steps"] = max(1, math.floor(ib / s["batch"] + 0.5))
    for seed in SEEDS:
        one("none_equal", seed, rec["none_equal_steps"])
    rec["summary"] = summarize(rec["runs"])
    rec["verdict"] = verdict(rec["runs"], rec["summary"])
    rec["load_average_end"] = load_average()
    rec["seconds"] = time.perf_counter() - t0
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rec, indent=1) + "\n")
    os.replace(tmp, path)
    print_table(rec)
    print(f"wrote {path}")


def print_table(rec: dict[str, Any]) -> None:
    """The summary per arm and the verdict."""
    def mm(v: dict[str, float], f: str) -> str:
        return f"{v['median']:{f}} ({v['min']:{f}}-{v['max']:{f}})"
    rows = [{"arm": arm, "rows trained": mm(v["rows_trained"], ".0f"), "train s": mm(v["train_s"], ".1f"),
             "wall s": mm(v["wall_s"], ".1f"), "val loss/token": mm(v["val_loss_per_token"], ".4f")}
            for arm, v in rec["summary"].items()]
    print(f"\n{rec['mode']} mode, {rec['settings']['epochs']} epochs, seeds {rec['seeds']}: median (min-max)")
    print(table(rows, ["arm", "rows trained", "train s", "wall s", "val loss/token"]))
    n = len(rec["verdict"]["equal_rows"]["seeds"])
    print("\n" + rec["verdict"]["text"])
    print(f"(a direction is claimed where all {n} seeds agree: chance alone gives that {2 * 0.5 ** n:.0%} of the time)")


if __name__ == "__main__":
    main()
