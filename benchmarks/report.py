"""docs/results.md, generated from the committed results files and nothing else.

    python -m benchmarks.report            # rewrite docs/results.md
    python -m benchmarks.report --check    # exit 1 if docs/results.md is not what the files say

Every figure on the page is read from a file under benchmarks/results/, and each block names
that file, the command that wrote it, the commit, the host's CPU and flags, the load average
and the seeds. A file that is missing simply has no block; a field a file does not record is
said to be unrecorded, never filled in. No other page of the documentation holds a figure.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

from benchmarks.common import paired_overhead
from benchmarks.hostinfo import class_of

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "results.md"


def _load(name: str) -> dict[str, Any] | None:
    p = RESULTS / name
    return json.loads(p.read_text()) if p.exists() else None


def _s(v: float | None, unit: str = " s", digits: int = 0) -> str:
    return "missed" if v is None else f"{v:,.{digits}f}{unit}"


def _pct(v: float | None, digits: int = 2) -> str:
    return "—" if v is None else f"{100 * v:.{digits}f}%"


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}×"


def _range(lo_hi: list | None) -> str:
    """`` (min–max)`` of a ``[min, max]`` pair; a ``None`` max is a seed that missed."""
    if not lo_hi or lo_hi[0] is None:
        return ""
    return f" ({_s(lo_hi[0])}–{_s(lo_hi[1])})"


def provenance(d: dict[str, Any], name: str) -> str:
    """One line: the file, command, commit, host and load of a results file."""
    host = d.get("host") or {}
    parts = [f"`benchmarks/results/{name}`"]
    parts.append(f"`{d['command']}`" if d.get("command") else "command not recorded")
    if d.get("commit"):  # keep a '+dirty' mark: the tree had uncommitted changes
        sha, _, mark = d["commit"].partition("+")
        parts.append(f"commit `{sha[:12]}{'+' + mark if mark else ''}`")
    else:
        parts.append("commit not recorded")
    if host:
        flags = ", ".join(host.get("flags", [])) or "no AVX512/AMX"
        sim = d.get("host_class_simulated")
        how = f" under {' '.join(f'{k}={v}' for k, v in sim.items())}" if sim else ""
        parts.append(f"host class **{class_of(d)}**{how}: {host.get('model', '?')} ({flags}), "
                     f"{host.get('cores', '?')} cores")
    else:
        meta = d.get("_meta") or {}
        parts.append(f"host not recorded ({meta.get('host_cores', '?')} cores, {meta.get('when', 'undated')})")
    la = d.get("load_average_start")
    parts.append(f"load average {la[0]:.1f} at start" if la else "load not recorded")
    if d.get("seeds") is not None:
        parts.append(f"seeds {d['seeds']}")
    if d.get("mode"):
        parts.append(f"{d['mode']} mode")
    return "Source: " + "; ".join(parts) + "."


# ------------------------------------------------------------------ one block per results file

def time_to_accuracy(d: dict[str, Any], name: str = "time_to_accuracy.json",
                     title: str = "Time to accuracy (Fashion-MNIST test split)") -> list[str]:
    base = any(arm.startswith("baseline") for arm in d["arms"])
    strongest = d.get("strongest_baseline") or "none reached 93%"
    fresh = any("startup_s" in r for a in d["arms"].values() for r in a["runs"])
    start = ("a fresh process that runs the flow: Python, torch and Prefect start-up and sharding "
             "included, starting Prefect's embedded API not" if fresh else "the flow, sharding included")
    lines = [f"#### {title}", "",
             f"Wall clock from the start (Sluice: {start}; the baseline: its "
             "process) to the first evaluation at or above the target; median of the seeds, "
             "min–max beside it. Each arm's budget is the smallest of its recorded sweep that "
             f"reached 93% with seed 0. Ratios are to the fastest baseline arm ({strongest}).", "",
             "| arm | epochs | to 93%: median (min–max) | vs fastest baseline | to 94% | final accuracy (median) |",
             "|---|---|---|---|---|---|"]
    for arm, a in d["arms"].items():
        s93, s94 = a["summary"]["0.93"], a["summary"]["0.94"]
        rng = "" if s93["min"] is None else f" ({_s(s93['min'])}–{_s(s93['max'])})"
        miss = f", {s93['misses']} of {len(a['runs'])} seeds missed" if s93["misses"] else ""
        lines.append(f"| {arm} | {a['budget_epochs']:g} | {_s(s93['median'])}{rng}{miss} | "
                     f"{_x(a.get('ratio_to_baseline_93'))} | {_s(s94['median'])} | {_pct(a['final_acc_median'])} |")
    sweeps = [f"{arm}: " + ", ".join(f"{r['epochs']:g} epochs {_pct(r['final_acc'])}"
                                     + ("" if r["seconds_to_target"].get("0.93") is not None else " (missed 93%)")
                                     for r in a.get("sweep", []))
              for arm, a in d["arms"].items() if a.get("sweep")]
    if sweeps:
        lines += ["", "The sweep (seed 0, final accuracy at each budget): " + "; ".join(sweeps) + "."]
    goals = d.get("goals") or {}
    if goals:
        lines += ["", "Goals: " + "; ".join(
            f"{name.replace('_', ' ')}: **{'met' if g['met'] else 'missed'}**"
            + (f" ({_x(g['ratio'])})" if g.get("ratio") is not None else "")
            for name, g in goals.items()) + "."]
    if base:
        st = d.get("baseline_settings", {}).get("chosen", {})
        amp = {"none": "fp32", "bf16": "bf16 autocast"}.get(st.get("amp", "none"), st.get("amp"))
        lines += ["", f"The baseline ran with {st.get('threads', '?')} threads, channels-last "
                      f"{'on' if st.get('channels_last') else 'off'}, {amp} (its fastest setting in "
                      "the recorded probe)."]
        probe = d.get("baseline_settings", {}).get("probe", [])
        fastest = {mode: min((r["step_s"] for r in probe if r.get("amp", "none") == mode and r["step_s"]),
                             default=None) for mode in ("none", "bf16")}
        if all(fastest.values()):
            lines[-1] += (f" Its fastest step (batch 256) in fp32: {fastest['none']:.3f} s; with bf16 "
                          f"autocast: {fastest['bf16']:.3f} s ({fastest['none'] / fastest['bf16']:.2f}× "
                          "faster).")
    ours = sorted({r["amp"] for a in d["arms"].values() for r in a["runs"] if r.get("amp")})
    if ours:
        lines += ["", f"Sluice's `amp: auto` resolved to {', '.join(ours)} on this host."]
    lines += _where_the_time_goes(d)
    api = d.get("prefect_embedded_api_start_s")
    if api:
        when = "median of the runs" if fresh else "once per benchmark process"
        lines += ["", f"Not counted for Sluice: starting Prefect's embedded API ({api:.0f} s, {when}; "
                      "a deployment's runs use a server that is already up)."]
    lines += ["", provenance(d, name)]
    return lines


def _median(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _where_the_time_goes(d: dict[str, Any]) -> list[str]:
    """Each arm's fixed costs and its pace, from the evaluations' wall times (medians over its
    seeds): what a faster default would have to cut."""
    if not any(r.get("evals") for a in d["arms"].values() for r in a["runs"]):
        return []
    secs = lambda v: "—" if v is None else f"{v:.1f} s"  # noqa: E731 - not recorded, not "missed"
    lines = ["", "Where the time goes (medians over each arm's seeds; the start-up and sharding columns "
                 "are recorded for Sluice's runs only; an epoch's time includes its evaluation):", "",
             "| arm | start-up (imports) | sharding | first evaluation (after epoch 1) | each later epoch |",
             "|---|---|---|---|---|"]
    for arm, a in d["arms"].items():
        runs = a["runs"]
        evals = [r.get("evals") or [] for r in runs]
        first = _median([e[0]["wall_s"] for e in evals if e])
        later = _median([y["wall_s"] - x["wall_s"] for e in evals for x, y in zip(e, e[1:])
                         if abs(y["epoch"] - x["epoch"] - 1) < 0.01])
        lines.append(f"| {arm} | {secs(_median([r.get('startup_s') for r in runs]))} | "
                     f"{secs(_median([r.get('shard_s') for r in runs]))} | {secs(first)} | {secs(later)} |")
    strongest = d["arms"].get(d.get("strongest_baseline") or "")
    base93 = strongest and strongest["summary"]["0.93"]["median"]
    if base93:
        lines += ["", f"The ≤ 0.5× goal asks for 93% by {0.5 * base93:.0f} s: half the strongest baseline's "
                      f"median ({base93:.0f} s)."]
    return lines


def candidates(d: dict[str, Any]) -> list[str]:
    """A candidate for the default measured beside the default and the baseline (same protocol)."""
    return time_to_accuracy(d, "time_to_accuracy_candidates.json",
                            "Candidates for the default: time to accuracy (Fashion-MNIST test split)")


def ablation(d: dict[str, Any]) -> list[str]:
    """Each technique of the default recipe left out (or a candidate added) at the default's budget."""
    ref = d["arms"].get("sluice")
    if not ref:
        return []
    lines = ["#### Ablations of the default recipe (Fashion-MNIST test split)", "",
             f"The default recipe as it was at commit `{str(d.get('commit', '?'))[:12]}` ('sluice'), "
             f"every arm at its budget ({ref['budget_epochs']:g} epochs), seeds interleaved; "
             "time to 93% as above, a seed that never reaches it counting as infinitely slow.", "",
             "| arm | to 93%: median (min–max) | final accuracy: median (min–max) | vs the default |",
             "|---|---|---|---|"]
    for arm, a in d["arms"].items():
        s93 = a["summary"]["0.93"]
        rng = "" if s93["min"] is None else f" ({_s(s93['min'])}–{_s(s93['max'])})"
        miss = f", {s93['misses']} of {len(a['runs'])} seeds missed" if s93["misses"] else ""
        acc = a["final_acc"]
        delta = 100 * (a["final_acc_median"] - ref["final_acc_median"])
        lines.append(f"| {arm} | {_s(s93['median'])}{rng}{miss} | {_pct(a['final_acc_median'])} "
                     f"({_pct(min(acc))}–{_pct(max(acc))}) | "
                     f"{'—' if arm == 'sluice' else f'{delta:+.2f} points'} |")
    lines += ["", provenance(d, "time_to_accuracy_ablation.json")]
    return lines


def demo(d: dict[str, Any], name: str = "demo.json") -> list[str]:
    g = d["goal"]
    runs = d["runs"]
    resolved = runs[0].get("resolved")
    return [f"#### `make demo`, once set up ({class_of(d)})", "",
            f"`sluice demo` on a fresh data root: median {_s(d['median_wall_s'])} "
            f"({_s(min(r['wall_s'] for r in runs))}–{_s(max(r['wall_s'] for r in runs))}, {len(runs)} runs), "
            f"champion test accuracy {_pct(d['median_test_acc'])}. Goal ≥ {_pct(g['test_acc_at_least'], 0)} "
            f"in ≤ {g['seconds_at_most']:.0f} s: **{'met' if g['met'] else 'missed'}**"
            + (" in simulation only (its time is the newer CPU's, not an AVX2 host's)."
               if d.get("host_class_simulated") else ".")
            + (" The demo's seed is fixed, so the runs differ in wall time only: the accuracy is one "
               "seed's." if len({r['test_acc'] for r in runs}) == 1 else "")
            + (f" Resolved: {resolved}." if resolved else ""), "",
            provenance(d, name)]


def selection(d: dict[str, Any]) -> list[str]:
    if "levels" not in d or "methods" not in next(iter(d["levels"].values()), {}):
        return []
    lines = ["#### Sample selection under label noise", "",
             "Every method trains the same small CNN with the same optimizer and batch; they differ "
             "only in which samples fill it. Seconds to the target count training and selection "
             "(evaluations excluded, for all alike); for RHO-LOSS the irreducible-loss model's "
             "training and scoring are added, per run and amortised over "
             f"{d.get('il_reuses', '?')} runs that reuse its scores. Medians over the seeds, min–max "
             "in brackets (a missed max: a seed that never reached the target); final accuracy at "
             "the common step budget.", ""]
    reuses = d.get("il_reuses", 1)
    for level, lv in d["levels"].items():
        t = max(d["targets"])
        amortised_of: dict[str, float] = {}
        lines += [f"{float(level):.0%} noise, target {t:.0%} (IL model: {_s(lv['il_seconds'])}):", "",
                  f"| method | steps | seconds (training) | seconds incl. IL, per run | incl. IL amortised over {reuses} runs | final accuracy |",
                  "|---|---|---|---|---|---|"]
        for m, s in lv["methods"].items():
            secs, with_il = s["seconds_to_target"], s.get("seconds_to_target_with_il")
            needs_il = m.startswith("rho_loss")  # rho_loss and its variants (selection.VARIANTS)
            # the IL cost is the same constant on every seed, so it shifts the median by itself
            amortised = secs + lv["il_seconds"] / reuses if needs_il and secs is not None else None
            if amortised is not None:
                amortised_of[m] = amortised
            lines.append(f"| {m} | {s['steps_to_target'] if s['steps_to_target'] is not None else 'missed'} | "
                         f"{_s(secs)}{_range(s.get(f'seconds_to_{t}_range'))} | "
                         f"{_s(with_il) if needs_il else '—'} | {_s(amortised) if needs_il else '—'} | "
                         f"{_pct(s['final_acc'])} |")
        g = lv.get("goal_rho_loss_with_il_faster_than_uniform")
        if g:
            lines += ["", f"RHO-LOSS, IL cost included, in less wall time than uniform: "
                          f"**{'met' if g['met'] else 'missed'}** ({_x(g['ratio'])} uniform's time)."]
            if g.get("uniform_s") and amortised_of:
                lines[-1] += (f" With the IL model's cost shared by {reuses} runs that reuse its "
                              "scores: " + ", ".join(f"{m} {_x(v / g['uniform_s'])}"
                                                     for m, v in amortised_of.items()) + ".")
        lines.append("")
    lines.append(provenance(d, "selection.json"))
    return lines


def shard(d: dict[str, Any]) -> list[str]:
    rows = {r["name"]: r for r in d["rows"]}
    ours, raw = rows.get("sluice all formats"), [r for n, r in rows.items() if n.startswith("raw")]
    lines = ["#### Sharding", ""]
    if ours and raw:
        lines.append(f"All three formats of {ours['samples']:,} images: {_s(ours['seconds'], ' s', 1)}, against "
                     f"{_s(sum(r['seconds'] for r in raw), ' s', 1)} for "
                     + " + ".join(r["name"].removeprefix("raw ") for r in raw)
                     + f" alone ({_x(d.get('ratio_to_raw_sum'))}; goal ≤ 1.0×: "
                     f"**{'met' if d.get('goal_met') else 'missed'}**).")
    return lines + ["", provenance(d, "shard.json")]


def loader(d: dict[str, Any]) -> list[str]:
    lines = ["#### Loader throughput", "", "| dataset | backend | samples/s | vs its raw library |", "|---|---|---|---|"]
    for ds, g in d.get("goals", {}).items():
        for name, r in g.get("ours_vs_raw", {}).items():
            sps = next((row["samples_per_s"] for row in d["rows"] if row["dataset"] == ds and row["name"] == name), None)
            lines.append(f"| {ds} | {name} | {sps:,.0f} | {_x(r['ratio'])} ({r['raw']}; goal ≥ {r['goal']}×: "
                         f"{'met' if r['met'] else 'missed'}) |")
    return lines + ["", provenance(d, "loader.json")]


def compression(d: dict[str, Any]) -> list[str]:
    modes = {k: v for k, v in d.items() if isinstance(v, dict) and "final_acc" in v}
    if "none" not in modes:
        return []
    full = modes["none"]["bytes_per_step_steady"]
    lines = ["#### Gradient compression (2 ranks over loopback)", "",
             "| mode | bytes per step (steady) | fewer than fp32 | seconds per step | final accuracy |",
             "|---|---|---|---|---|"]
    for k, v in modes.items():
        lines.append(f"| {k} | {v['bytes_per_step_steady']:,.0f} | {_x(full / v['bytes_per_step_steady'])} | "
                     f"{v['seconds_per_step']:.3f} | {_pct(v['final_acc'])} |")
    return lines + ["", provenance({**d.get("_about", {}), **d}, "compression.json")]


def compression_links(d: dict[str, Any], name: str = "compression_links.json") -> list[str]:
    summary, goals = d.get("summary") or {}, d.get("goals") or {}
    if not summary:
        return []
    lines = ["#### Gradient compression over shaped links (2 simulated nodes, 1 core each)", "",
             "Seconds to the uncompressed run's final accuracy minus 1 point (training clock), "
             "median over the seeds; communication's share of a step against a compute-only step.", "",
             "| link (measured) | model | mode | steps | s to target | vs uncompressed wall | s per step | "
             "MB per step | comm share | final accuracy |", "|---|---|---|---|---|---|---|---|---|---|"]
    for rate, per in summary.items():
        mbit = (per.get("measured_mbit") or {}).get("median")
        for model, modes in per.items():
            if model == "measured_mbit":
                continue
            for mode, v in modes.items():
                mb = "—" if v.get("bytes_per_step") is None else f"{v['bytes_per_step'] / 1e6:.2f}"
                steps = "—" if v.get("steps") is None else f"{v['steps']:.0f}"
                lines.append(f"| {rate} ({_s(mbit, ' Mbit/s')}) | {model} | {mode} | {steps} | "
                             f"{_s(v.get('seconds_to_target'), ' s', 1)} | {_x(v.get('vs_uncompressed_wall'))} | "
                             f"{_s(v.get('step_s'), ' s', 3)} | {mb} | {_pct(v.get('comm_fraction'), 0)} | {_pct(v.get('final_acc'))} |")
    lines += _budget_sweeps(d.get("budgets") or {})
    for model, g in goals.items():
        parts = []
        slow, mid = g.get("100mbit_powersgd_vs_uncompressed_wall"), g.get("1gbit_powersgd_not_slower")
        if slow:
            parts.append(f"at 100 Mbit/s PowerSGD in ≤ 0.4× the uncompressed wall time: "
                         f"**{'met' if slow['met'] else 'missed'}** ({_x(slow['median'])})")
        if mid:
            parts.append(f"at 1 Gbit/s not slower: **{'met' if mid['met'] else 'missed'}** "
                         f"({_s(mid['powersgd_s'], ' s', 1)} vs {_s(mid['none_s'], ' s', 1)})")
        c = g.get("crossover") or {}
        wins = [r for r, w in (c.get("powersgd_faster_to_target") or {}).items() if w]
        fit, fit_t = c.get("fitted_crossover_mbit"), c.get("fitted_time_to_target_crossover_mbit")
        parts.append("PowerSGD reached the target first at " + (", ".join(wins) if wins else "no measured rate")
                     + ("" if fit_t is None else f"; it reaches the target sooner below about {fit_t:,.0f} Mbit/s "
                        "(fit of time to target against 1/throughput)")
                     + ("; the fit of step time against 1/throughput finds no crossover" if fit is None
                        else f"; its steps are faster than uncompressed ones below about {fit:,.0f} Mbit/s "
                             "(fit of step time against 1/throughput)"))
        lines += ["", f"{model}: " + "; ".join(parts) + "."]
    about = d.get("_about", {})
    if about.get("mode") == "quick":
        start = (about.get("modes") or {}).get("powersgd_rank2", {}).get("start_iter", "?")
        steps = max((about.get("steps") or {"?": 0}).values())
        lines += ["", f"Quick mode: {len(about.get('seeds', []))} seed, {steps} steps, PowerSGD "
                      f"compressing from step {start + 1 if isinstance(start, int) else start}: a smoke run, "
                      "not the measurement the goals ask for (the full run has 3 seeds, 200-300 steps uncompressed and a swept budget compressed)."]
    per_rate = about.get("per_rate") or {}
    if about.get("merged") and len({v.get("when") for v in per_rate.values()}) > 1:
        lines += ["", "Rates measured in separate runs (`--merge`; the modes at one rate always ran side by side): "
                      + "; ".join(f"{r}: commit `{str(v.get('commit'))[:12]}`, {v.get('when')}, load "
                                  f"{(v.get('load_average_start') or ['?'])[0]}" for r, v in per_rate.items()) + "."]
    return lines + ["", provenance({**about, **d}, name)]


def _budget_sweeps(budgets: dict[str, Any]) -> list[str]:
    """One line per model and compressed mode: the step budgets its first seed tried (same at
    every rate when the runs are deterministic, so rates that agree are listed once)."""
    seen: dict[tuple[str, str, str], list[str]] = {}
    for rate, per_model in budgets.items():
        for model, per_mode in per_model.items():
            for mode, b in per_mode.items():
                if not b.get("sweep"):
                    continue
                tried = ", ".join(f"{p['multiplier']:g}× = {p['steps']} steps → {_pct(p['final_acc'])}"
                                  + (" (reached)" if p.get("reached") else "")
                                  if "error" not in p else f"{p['multiplier']:g}× failed" for p in b["sweep"])
                seen.setdefault((model, mode, tried), []).append(rate)
    if not seen:
        return []
    return ["", "Step budget of the compressed modes (recorded sweep on the first seed; the smallest that "
                "reaches the target is what every seed trains for):", ""] + [
        f"- {model} {mode} ({', '.join(rates)}): {tried}" for (model, mode, tried), rates in seen.items()]


def compression_links_quick(d: dict[str, Any]) -> list[str]:
    if _load("compression_links.json") is not None:  # the full run's block stands instead
        return []
    return compression_links(d, "compression_links_quick.json")


def loader_scale(d: dict[str, Any], name: str = "loader_scale.json") -> list[str]:
    ds, g = d["dataset"], d.get("goal") or {}
    lines = [f"#### The loader beyond memory ({ds['tar_bytes'] / 1e9:.1f} GB of JPEG shards, "
             f"{ds['samples']:,} samples, under a {d['memory_limit_bytes'] / 2**20:,.0f} MiB memory cgroup)", "",
             f"Each run: {d.get('batches_per_run')} batches of 256 after {d.get('warmup_batches', 0)} of warm-up, "
             "RRC to 128 + flip + normalise, 2 decode workers, in a fresh child process. `throttled`: the memory "
             f"limit, a {d['throttle_bytes_per_s'] / 1e6:,.0f} MB/s blkio read throttle and a cold page cache; "
             "`cached`: the files in the page cache, no limit (this sets the decode-bound limit). "
             "Median of the repeats, min–max beside it.", "",
             "| arm | samples/s: median (min–max) | storage-bound limit | peak memory | OOM kills | verdict |",
             "|---|---|---|---|---|---|"]
    for arm, a in d["arms"].items():
        sp = a["samples_per_s"]
        cut = (f", cut short after {a['timed_out']} run(s) of {d.get('run_timeout_s', '?')} s: pace so far"
               if a.get("timed_out") else "")
        rng = f" ({sp['min']:,.0f}–{sp['max']:,.0f})" if sp.get("n", 0) > 1 else ""
        val = f"{sp['median']:,.0f}{rng}{cut}" if sp else f"no run finished ({a['failed']} failed)"
        lim = "—" if a["storage_bound_limit"] is None else f"{a['storage_bound_limit']:,.0f}"
        over = "" if a["within_limit"] else " (over the limit)"
        lines.append(f"| {arm} | {val} | {lim} | {a['peak_bytes_max'] / 2**20:,.0f} MiB{over} | {a['oom']} | "
                     f"{a.get('verdict') or '—'} |")
    if g:
        lines += ["", f"Goal: the best throttled arm ({g['best_throttled_arm']}, {g['samples_per_s']:,.0f} samples/s) "
                      f"at ≥ 0.8× the lower of its storage-bound ({g['storage_bound_limit']:,.0f}) and the "
                      f"decode-bound ({g['decode_bound_limit']:,.0f}, the best cached arm) limits: "
                      f"{g['ratio']:.3f}×, **{'met' if g['met'] else 'missed'}**. No run OOM-killed or over the "
                      f"memory limit: **{'met' if d['memory_goal_met'] else 'missed'}**."]
    if d.get("auto_under_limit"):
        lines += ["", f"`auto` under the limit: {d['auto_under_limit']}"]
    if d.get("mode") == "quick":
        lines += ["", "Quick mode: a smaller dataset and 12 batches a run: a check that everything runs, "
                      "not the measurement the goals ask for."]
    lines += ["", provenance(d, name)]
    return lines


def loader_scale_quick(d: dict[str, Any]) -> list[str]:
    if _load("loader_scale.json") is not None:  # the full run's block stands instead
        return []
    return loader_scale(d, "loader_scale_quick.json")


def shard_order(d: dict[str, Any]) -> list[str]:
    s, g = d["summary"], d["goal"]
    lines = [f"#### Shard-block order against the global shuffle (Fashion-MNIST, {d['epochs']:g} epochs)", "",
             f"The same training on both sides but for the order: the exact global shuffle, or `shard_block` "
             f"(shard order shuffled, samples shuffled within a window of {d['window']} shards of "
             f"{d['shard_samples']:,}). Test accuracy, median of the seeds (min–max).", "",
             "| sampler | test accuracy |", "|---|---|"]
    for kind, v in s.items():
        lines.append(f"| {kind} | {_pct(v['median'])} ({_pct(v['min'])}–{_pct(v['max'])}) |")
    lines += ["", f"Goal: shard_block within {g['target_points']:g} points of the global shuffle: "
                  f"{g['gap_points']:+.2f} points, **{'met' if g['met'] else 'missed'}**.",
              "", provenance(d, "shard_order.json")]
    return lines


def tiny_budget(d: dict[str, Any], name: str) -> list[str]:
    runs = d["runs"]
    return [f"#### A tiny budget learns ({class_of(d)})", "",
            "The deployment test's config (1,500 samples, RHO-LOSS, 20 steps of 32 per rank on 2 ranks) "
            f"with the default recipe: validation accuracy median {_pct(d['median_val_acc'])} "
            f"({_pct(d['min_val_acc'])}–{_pct(d['max_val_acc'])}, seeds {', '.join(str(r['seed']) for r in runs)}), test "
            f"{_pct(d['median_test_acc'])}; chance is 10%. Trained as: {runs[0].get('host') or 'not recorded'}.",
            "", provenance(d, name)]


def host_layout(d: dict[str, Any], name: str) -> list[str]:
    lines = [f"#### Trainer throughput per rank layout ({class_of(d)})", "",
             "| ranks x threads, batch per rank | samples/s: median (min–max) |", "|---|---|"]
    for row in d["summary"]:
        lines.append(f"| {row['layout']} | {row['median samples/s']:,.0f} ({row['min']:,.0f}–{row['max']:,.0f}) |")
    return lines + ["", provenance(d, name)]


# results files written once per host class: <stem>-<class>.json
PER_CLASS: list[tuple[str, Callable[[dict[str, Any], str], list[str]]]] = [
    ("time_to_accuracy", time_to_accuracy), ("demo", demo), ("tiny_budget", tiny_budget),
    ("host_layout", host_layout)]


def host_classes() -> list[str]:
    """Which host class each results file was measured on, and which goals one class only."""
    seen: dict[str, list[str]] = {}
    for p in sorted(RESULTS.glob("*.json")):
        d = json.loads(p.read_text())
        seen.setdefault(class_of(d), []).append(p.name)
    lines = ["#### Host classes", "",
             "Settings and speed differ between CPUs that compute bf16 natively (`avx512_bf16`, `amx`) "
             "and those that do not (`avx2`); every block's source line names its class.", ""]
    for cls, names in sorted(seen.items()):
        lines.append(f"- **{cls}**: " + ", ".join(f"`{n}`" for n in names))
    for stem in ("time_to_accuracy", "demo"):
        classes = sorted(c for c, names in seen.items() if f"{stem}.json" in names
                         or any(n.startswith(f"{stem}-") for n in names))
        real = [c for c in classes if not c.endswith("(simulated)")]
        if len(real) == 1:
            sim = [c for c in classes if c not in real]
            lines.append(f"- `{stem}`'s goals were measured on **{real[0]}** only"
                         + (f" ({', '.join(sim)} too, which is not that host class's speed)." if sim else "."))
    lines += ["", "A simulated class (`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` on an AVX512-bf16 "
              "CPU) runs PyTorch's AVX2 kernels and resolves as an AVX2 host does, so its accuracy and what it "
              "resolves stand for that class; its timings are the newer CPU's, not an AVX2 host's (the "
              "ratios between its own arms are a guide only)."]
    return lines


def loader_checks(d: dict[str, Any]) -> list[str]:
    passes = max([r.get("passes", 1) for r in d.get("rows", [])] or [1])
    built = (f"{passes} passes, each arm built first in one of them, " if passes > 1 else "")
    lines = ["#### Per-sample checksum checks: their cost (`benchmarks.loader --checks`)", "",
             f"Interleaved arms, {built}median of {passes * (d.get('timed_epochs') or 0)} epochs each, "
             f"load average {d.get('load_avg_1m', 0):.1f} at the end (a shared 2-core host: ±10% is noise "
             "here). Overhead: 1 − on/off of the medians (it decides the goal); paired: the median over "
             "rounds of each round's back-to-back ratio, which the host's drift between rounds does not move.", "",
             "| dataset | backend | checks on, samples/s | checks off | overhead (goal ≤ 5%) | paired, per round |",
             "|---|---|---|---|---|---|"]
    rows = {(r["dataset"], r["name"]): r for r in d.get("rows", []) if r.get("epoch_s_all")}
    for ds, per in d.get("checks", {}).items():
        for b, v in per.items():
            on, off = rows.get((ds, f"sluice {b}")), rows.get((ds, f"sluice {b} (checks off)"))
            paired = v.get("overhead_paired")
            if paired is None and on and off:  # files written before the benchmark recorded it
                paired = paired_overhead(on["epoch_s_all"], off["epoch_s_all"])
            lines.append(f"| {ds} | {b} | {v['on']:,.0f} | {v['off']:,.0f} | {100 * v['overhead']:+.1f}% "
                         f"({'met' if v['met'] else 'missed'}) | "
                         + ("—" if paired is None else f"{100 * paired:+.1f}%") + " |")
    return lines + ["", provenance(d, "loader_checks.json")]


SECTIONS: list[tuple[str, Callable[[dict[str, Any]], list[str]]]] = [
    ("time_to_accuracy.json", time_to_accuracy), ("time_to_accuracy_candidates.json", candidates),
    ("time_to_accuracy_ablation.json", ablation), ("demo.json", demo), ("selection.json", selection),
    ("shard.json", shard), ("loader.json", loader), ("loader_checks.json", loader_checks),
    ("compression.json", compression),
    ("compression_links.json", compression_links), ("compression_links_quick.json", compression_links_quick),
    ("loader_scale.json", loader_scale), ("loader_scale_quick.json", loader_scale_quick),
    ("shard_order.json", shard_order),
]


def _pts(v: float | None) -> str:
    return "—" if v is None else f"{v:+.2f}"


def _xs(v: float | None) -> str:
    """A ratio of times: None is a run that never got there, 0 one whose reference never did."""
    return "never" if v is None else "fine-tune never did" if v == 0 else f"{v:.2f}×"


def nightly_growth(d: dict[str, Any], name: str = "nightly_growth.json") -> list[str]:
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


THEN_DEFAULTS = "that commit's defaults (lr_scale 0.5, replay_ratio 1)"


def warm_sweep(d: dict[str, Any], name: str = "nightly_growth_warm_sweep.json") -> list[str]:
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


def render_nightly() -> str:
    d = _load("nightly_growth.json")
    if d is None:
        return ("Not measured yet: `benchmarks/results/nightly_growth.json` does not exist, so this page "
                "claims no figure for it (`python -m benchmarks.nightly_growth` writes it).\n")
    sweep = _load("nightly_growth_warm_sweep.json")
    return "\n".join(nightly_growth(d) + (["", *warm_sweep(sweep)] if sweep else [])) + "\n"


def _met(g: dict[str, Any] | None) -> str:
    return "not measured" if not g or g.get("met") is None else ("met" if g["met"] else "missed")


def tokens(d: dict[str, Any], name: str) -> list[str]:
    """The token pipeline benchmark (issue #41): loader throughput on one core, exact resume of a
    mixture at other world sizes, and time to a validation loss against a nanoGPT-style loop."""
    mode = f", {d['mode']} mode" if d.get("mode") and d["mode"] != "full" else ""
    lines = [f"#### Token pipeline: loader, resume, time to a validation loss ({class_of(d)}{mode})", ""]
    lo = d.get("loader")
    if lo:
        c = lo["corpus"]
        lit = (lo.get("prep") or {}).get("litdata_optimize") or {}
        lines += [f"**Loader**: packed ({lo['batch']}, {lo['seq_len']}) int64 inputs and targets on one core "
                  f"(one torch thread, no helper thread or worker process in any arm) over the three Debian "
                  f"sources' train splits ({c['stream_tokens']:,} tokens with end-of-text, vocabulary "
                  f"{c['vocab_size']:,}); median (min–max) of {lo['repeats']} interleaved windows of "
                  f"{lo['window_s']:g} s. LitData's `optimize` of the same stream took "
                  + (f"{lit['seconds']:.1f} s (not in its throughput)." if lit else "— (not run)."), "",
                  "| arm | tokens/s: median (min–max) | cores busy | tokens per CPU second: median |",
                  "|---|---|---|---|"]
        per_cpu = {arm: statistics.median(w["tokens_per_s"] / max(w["cores_busy"], 1e-9) for w in runs)
                   for arm, runs in lo["runs"].items() if runs}
        for arm, v in lo["summary"].items():
            t = v["tokens_per_s"]
            lines.append(f"| {arm} | {t['median'] / 1e6:,.1f} M ({t['min'] / 1e6:,.1f}–{t['max'] / 1e6:,.1f} M) | "
                         f"{v['cores_busy']['median']:.2f} | {per_cpu[arm] / 1e6:,.1f} M |")
        lines += ["", "Goals (on tokens/s): " + "; ".join(f"{k} {v['value']:.2f}× (≥ {v['wanted']:g}×: **{_met(v)}**)"
                                                         for k, v in lo["goals"].items()) + "."]
        if "nanogpt_memmap" in per_cpu and "sluice" in per_cpu:
            lines += ["", "Per CPU second (what a shared host's descheduling does not move): sluice "
                      f"{_x(per_cpu['sluice'] / per_cpu['nanogpt_memmap'])} nanogpt_memmap"
                      + (f", {_x(per_cpu['sluice'] / per_cpu['litdata_tokens'])} litdata_tokens"
                         if "litdata_tokens" in per_cpu else "") + "."]
        if lo.get("skipped"):
            lines += ["", "Not run: " + "; ".join(f"{k} ({v})" for k, v in lo["skipped"].items()) + "."]
        lines.append("")
    rs = d.get("resume")
    if rs:
        w = ", ".join(f"{k} {v:g}" for k, v in rs["weights"].items())
        sch = rs["seq_len_schedule"]
        lines += [f"**Resume**: a mixture of the three sources (weights {w}; {rs['epoch_size']:,} documents an epoch), "
                  f"packed, rows {sch['start']} → {sch['end']} tokens by the curriculum, global batch "
                  f"{rs['global_batch']} rows; stopped at 4 ranks at step {rs['stop_step']} of {rs['steps_epoch0']}, "
                  "resumed at each world size and run to the end of epoch 1; each epoch checked against an "
                  "uninterrupted 1-rank run.", "",
                  "| resumed at | token positions repeated / skipped (epoch 0) | same tokens | documents and tokens "
                  "per source exact (epoch 0, 1) | result |", "|---|---|---|---|---|"]
        for k, v in rs["worlds"].items():
            e0, e1 = v["epoch0"], v["epoch1"]
            lines.append(f"| {k} rank{'s' * (k != '1')} | {e0['repeated']} / {e0['skipped']} of {e0['positions']:,} | "
                         f"{'yes' if e0['same_tokens_as_uninterrupted'] and e1['same_tokens_as_uninterrupted'] else 'no'} | "
                         f"{'yes' if e0['counts_exact'] else 'no'}, {'yes' if e1['counts_exact'] else 'no'} | "
                         f"**{'pass' if v['pass'] else 'FAIL'}** |")
        peer = rs.get("naive_peer") or {}
        if peer.get("restart_epoch"):
            lines += ["", f"The naive peer ({rs['naive_peer_note']}; {peer['chunks']:,} chunks), chunks repeated / "
                      "skipped over epoch 0:", "", "| resumed at | restart the epoch | skip the batches taken |",
                      "|---|---|---|"]
            for k in peer["restart_epoch"]:
                a, b = peer["restart_epoch"][k], peer["skip_taken_batches"][k]
                lines.append(f"| {k} rank{'s' * (k != '1')} | {a['repeated']:,} / {a['skipped']:,} | {b['repeated']:,} / {b['skipped']:,} |")
        lines.append("")
    e2e = d.get("e2e")
    if e2e and e2e.get("skipped"):
        lines += [f"**End to end**: not measured ({e2e['skipped']})."]
    elif e2e:
        st = e2e["settings"]
        m = st["model"]
        lines += [f"**End to end**: a GPT ({m['n_layer']} layers, d {m['d_model']}, rows of {st['seq_len']}, "
                  f"batch {st['batch']}, vocabulary {st['vocab']}) from a fresh process to **{e2e['target_bpb']:g} bits "
                  f"per byte** of the validation text (fixed before the runs), every arm's own tokenizer training "
                  f"and token files counted; both evaluated on all {e2e['corpus']['val_docs']:,} validation documents "
                  f"every {st['eval_every']} steps, a budget of {st['budget_tokens']:,} training tokens.", "",
                  "| arm | seconds to target per seed | median (min–max) | misses | bits per byte at the end, per seed "
                  "| tokenizer + token files, median |", "|---|---|---|---|---|---|"]
        for arm, v in e2e["summary"].items():
            per = ", ".join("missed" if t is None else f"{t:.0f}" for t in v["per_seed"])
            runs = [r for r in e2e["runs"] if r["arm"] == arm]
            last = ", ".join(f"{r['evals'][-1]['bpb']:.3f}" if r.get("evals") else "—" for r in runs)
            prep = [r["prep_s"] for r in runs if r.get("prep_s") is not None]
            lines.append(f"| {arm} | {per} | {_s(v['median'])}{_range([v['min'], v['max']])} | {v['misses']} | {last} | "
                         f"{_s(statistics.median(prep)) if prep else '—'} |")
        g = e2e["goal"]
        lines += ["", f"Sluice over the loop: {_x(g['ratio'])} (goal ≤ {g['wanted']:g}×: **{_met(g)}**)."]
    elif d.get("e2e_calibration"):
        lines += ["**End to end**: only the calibration sweep has run; the goal is not measured."]
    else:
        lines += ["**End to end**: not measured."]
    parts = [(k, d[k]) for k in ("loader", "resume", "e2e", "e2e_calibration") if isinstance(d.get(k), dict)]
    if parts:
        lines += ["", "Each part as run: " + "; ".join(
            f"{k}: `{v.get('command', '?')}`, load average {_la(v.get('load_average_start'))} at start and "
            f"{_la(v.get('load_average_end'))} at the end, {v.get('seconds', 0):.0f} s" for k, v in parts) + "."]
    return lines + ["", provenance(d, name)]


def _la(v: list | None) -> str:
    return f"{v[0]:.1f}" if v else "not recorded"


def token_selection(d: dict[str, Any], name: str) -> list[str]:
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


def render() -> str:
    blocks = ["\n".join(host_classes())]
    for name, fn in SECTIONS:
        d = _load(name)
        if d is not None:
            lines = fn(d)
            if lines:
                blocks.append("\n".join(lines))
    for stem, fn in PER_CLASS:
        for p in sorted(RESULTS.glob(f"{stem}-*.json")):
            if not p.stem.endswith("_quick"):
                blocks.append("\n".join(fn(json.loads(p.read_text()), p.name)))
    # the GPU loader benchmark's CPU mode, per host class: the full run, else the quick one
    for p in sorted(RESULTS.glob("gpu_loader_cpu-*.json")):
        full = p.with_name(p.name.replace("_quick.json", ".json"))
        if not p.stem.endswith("_quick") or not full.exists():
            blocks.append("\n".join(gpu_loader_cpu(json.loads(p.read_text()), p.name)))
    # the token pipeline benchmark, per host class: the full run, and the quick one beside it
    # unless the full run measured every part (the e2e goal needs a target fixed per mode)
    for p in sorted(RESULTS.glob("tokens-*.json")):
        full = p.with_name(p.name.replace("_quick.json", ".json"))
        if not p.stem.endswith("_quick") or not full.exists() \
                or not (json.loads(full.read_text()).get("e2e") or {}).get("summary"):
            blocks.append("\n".join(tokens(json.loads(p.read_text()), p.name)))
    # InfoBatch on token rows, per host class: the full run, else the quick one
    for p in sorted(RESULTS.glob("token_selection-*.json")):
        full = p.with_name(p.name.replace("_quick.json", ".json"))
        if not p.stem.endswith("_tiny") and (not p.stem.endswith("_quick") or not full.exists()):
            blocks.append("\n".join(token_selection(json.loads(p.read_text()), p.name)))
    return "\n\n".join(blocks) + "\n"


PAGE_HEAD = """# Results

<!-- generated by `python -m benchmarks.report` from benchmarks/results/*.json; do not edit by hand -->

Every figure on this page is read from a results file under `benchmarks/results/`. Each measured
block ends with its source: the file, the command that wrote it, the commit, the host class (CPU, its
flags and cores), the load average at the start and the seeds; a file that does not exist has no
block. How to run the benchmarks: [benchmarks.md](benchmarks.md). `python -m benchmarks.report`
rewrites this page and `--check` fails when it differs from what the files say
(`tests/test_readme_results.py` runs that check).
"""


# ------------------------------------------------------------------ on one GPU

GPU_RUNS = ("gpu.json", "gpu-repeat.json")


def _acc(runs: list[dict[str, Any]]) -> str:
    accs = [r["final_acc"] for r in runs if r.get("final_acc") is not None]
    return f"{statistics.median(accs):.4f} ({min(accs):.4f}–{max(accs):.4f})" if accs else "—"


def gpu(files: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Time to 93% on one GPU against the plain baseline, per committed run of ``benchmarks.gpu``;
    the loader-throughput goals, with why they read as unmeasured."""
    g = files[0][1]["gpu"]
    out = [f"Device: {g['gpu']}, torch {g['torch']} (CUDA {g['cuda']}). Each file is one run of "
           "`make gpu-check GPU_CHECK_ARGS=--full`:", ""]
    out += [f"- {provenance(d, n)}" for n, d in files]
    out += ["", "Time to 93% test accuracy on Fashion-MNIST, each run a fresh process timed from its start "
            "(Sluice's includes sharding the 70,000 images):", "",
            "| file | arm | epochs | seconds to 93%: median (min–max) | misses | final accuracy: median (min–max) |",
            "|---|---|---|---|---|---|"]
    for n, d in files:
        for arm, a in d["time_to_accuracy"]["arms"].items():
            sm = a["summary"]
            out.append(f"| {n} | {arm} | {a['epochs']:g} | {_s(sm['median'], digits=1)} ({_s(sm['min'], digits=1)}–"
                       f"{_s(sm['max'], digits=1)}) | {sm['misses']} | {_acc(a['runs'])} |")
    runs = [r for _, d in files for r in d["time_to_accuracy"]["arms"]["sluice"]["runs"]]
    waits = [r["data_wait_frac"] for r in runs if r.get("data_wait_frac") is not None]
    verdicts = sorted({r["loader"]["verdict"] for r in runs if isinstance(r.get("loader"), dict)})
    ratios = ", ".join(f"{_x(d['time_to_accuracy']['sluice_vs_baseline'])} ({n})" for n, d in files)
    out += ["", f"Sluice's default recipe takes {ratios} the plain baseline's median time: **a miss**. "
            f"Its loader is not the cause (verdict {', '.join(verdicts)}; data wait {_pct(min(waits), 0)}–"
            f"{_pct(max(waits), 0)} of the step time); it trains 64 samples per rank on CUDA (`stages/host.py`, "
            "not measured there) against the baseline's 256, and its start-up (process, sharding, torchrun) "
            "is longer.", "",
            "Loader-throughput goals (met / missed per file). Each arm times a single pass of a few thousand "
            "samples after one warm-up batch, and the two runs disagree: read these as unmeasured, not as "
            "wins or misses.", "",
            "| goal | wanted | " + " | ".join(n for n, _ in files) + " |", "|---|---|" + "---|" * len(files)]
    wanted = files[0][1]["goals_wanted"]
    for goal, want in (("best_sluice_vs_ceiling_32", f"≥ {wanted['best_sluice_vs_ceiling_32']}"),
                       ("best_sluice_vs_pil_224", f"≥ {wanted['best_sluice_vs_pil_224']}"),
                       ("data_wait_frac_resnet18_64", f"< {wanted['data_wait_frac_max']}")):
        cells = [d["goals"].get(goal, {}) for _, d in files]
        out.append(f"| {goal} | {want} | " + " | ".join(
            f"{_s(c.get('ratio', c.get('best')), '', 2)} ({'met' if c.get('met') else 'missed'})" for c in cells) + " |")
    return out


def gpu_batch_ab(d: dict[str, Any]) -> list[str]:
    """The batch-per-rank A/B on one GPU: seconds to 93% per seed and final accuracy, per arm."""
    info = d["info"]
    out = [f"Batch per rank on the GPU (`benchmarks/results/gpu_batch_ab.json`: `{info['command']}`, "
           f"{info['commit']}; {info['device']}; seeds {d['seeds']}, arms interleaved):", "",
           "| arm | seconds to 93% per seed | final accuracy: median (min–max) |", "|---|---|---|"]
    for arm in dict.fromkeys(r["arm"] for r in d["runs"]):
        runs = [r for r in d["runs"] if r["arm"] == arm]
        out.append(f"| {arm} | {', '.join(_s(r['seconds_to_93'], '', 1) for r in runs)} | {_acc(runs)} |")
    return out + ["", "At 256 per rank an epoch costs about a third of the time, but 5.5 epochs reach 93% on "
                  "one seed of three: the recipe keeps 64 per rank on CUDA (`stages/host.py`) until a budget "
                  "that reaches 93% at 256 on every seed is measured."]


def _dataset(d: dict[str, Any]) -> str:
    st = (d.get("data") or {}).get("folder_stats") or {}
    if not st:
        return "the ImageNet-like JPEGs (not recorded)"
    return (f"{st['n']:,} ImageNet-like JPEGs (`benchmarks/imagenet_like.py`: mean {st['mean_width']:.0f}×"
            f"{st['mean_height']:.0f} px, {st['mean_bytes'] / 1e3:.0f} KB, quality {st['quality']}, "
            f"{st['classes']:,} classes, each at its own size)")


def _loader_rows(d: dict[str, Any], trained: bool) -> list[str]:
    out = []
    for px, size in d["sizes"].items():
        for arm, a in size["arms"].items():
            sm = a.get("summary")
            if not sm:
                errs = sorted({r["error"] for r in a.get("runs", []) if "error" in r})
                out.append(f"| {px} | {arm} | " + ("failed: " + "; ".join(e[:200] for e in errs) if errs
                                                   else "not run") + " |" + " |" * (3 if trained else 2))
                continue
            ips, busy, per = sm["images_per_s"], sm["cores_busy"], sm["images_per_s_per_core"]
            cells = [f"{ips['median']:,.0f} ({ips['min']:,.0f}–{ips['max']:,.0f})"]
            if trained:
                cells.append(_pct(sm["data_wait_frac"]["median"], 1))
            cells += ["—" if busy["median"] is None else f"{busy['median']:.2f}",
                      "—" if per["median"] is None else f"{per['median']:,.0f}"]
            out.append(f"| {px} | {arm} | " + " | ".join(cells) + " |")
    return out


def gpu_loader_cpu(d: dict[str, Any], name: str) -> list[str]:
    """The GPU loader benchmark's CPU mode: decode + augmentation throughput per arm, per core."""
    lines = [f"#### ResNet-50 loader benchmark, CPU mode: decode and augmentation per core ({class_of(d)})", "",
             f"No GPU and no training: each arm's input path alone on this CPU over {_dataset(d)}; a random "
             "resized crop to the size, a flip and ImageNet's normalisation; batches of "
             f"{d['batch']}, {d['workers']} workers; median (min–max) of {d['repeats']} interleaved windows of "
             f"{d['window_s']:g} s. Images per busy core is the CPU cost of an image. These are CPU figures: "
             "the benchmark's goals are judged on a GPU only (`gpu_loader.json`, below under *On one GPU*).", "",
             "| px | arm | images/s: median (min–max) | cores busy | images/s per busy core |",
             "|---|---|---|---|---|"]
    lines += _loader_rows(d, trained=False)
    best = [f"{px} px: {g['best_sluice']}, {_x(g.get('images_per_core_vs_pil'))} the PIL DataLoader's images per "
            f"core and {_x(g.get('images_per_s_vs_pil'))} its images/s"
            for px, size in d["sizes"].items() if (g := size.get("goals") or {}).get("best_sluice")]
    if best:
        lines += ["", "The Sluice arm with the most images per core: " + "; ".join(best) + " (indicative)."]
    if d.get("skipped"):
        lines += ["", "Not run: " + "; ".join(f"{k} ({v})" for k, v in d["skipped"].items()) + "."]
    return lines + ["", provenance(d, name)]


def gpu_loader(d: dict[str, Any], name: str = "gpu_loader.json") -> list[str]:
    """The GPU loader benchmark on one GPU: trained images/s per arm and the goals beside them."""
    g = d.get("gpu") or {}
    lines = [f"ResNet-50 fed by each loader (`benchmarks/results/{name}`): {g.get('gpu')}, torch {g.get('torch')} "
             f"(CUDA {g.get('cuda')}); {d.get('model', 'ResNet-50')}, batch {d['batch']}, over {_dataset(d)}. "
             f"Trained images/s over windows of {d['window_s']:g} s after {d['warmup_s']:g} s of warm-up, "
             f"median (min–max) of {d['repeats']} interleaved repeats; data wait: the share of the window "
             "spent in `next(loader)` (the host one step ahead of the GPU at most); cores busy: CPU time of "
             "the process and its workers over the window.", ""]
    if d.get("note"):
        lines += [f"Note: {d['note']}.", ""]
    lines += ["| px | arm | trained images/s: median (min–max) | data wait | cores busy | images/s per busy core |",
              "|---|---|---|---|---|---|"]
    lines += _loader_rows(d, trained=True)
    lines += ["", "Goals (fixed before the run), per size, for the best Sluice arm:", "",
              "| px | best Sluice arm | vs synthetic (≥ 0.9×) | vs PIL DataLoader (≥ 1.5×) | data wait (< 5%) | "
              "cores busy vs PIL's (≤ 0.5×) |", "|---|---|---|---|---|---|"]
    for px, size in d["sizes"].items():
        go = size.get("goals") or {}

        def cell(k: str, pct: bool = False) -> str:
            v = go.get(k) or {}
            if v.get("met") is None:
                return "not measured"
            return f"{_pct(v['value'], 1) if pct else _x(v['value'])} ({'met' if v['met'] else 'missed'})"
        lines.append(f"| {px} | {go.get('best_sluice') or '—'} | {cell('vs_synthetic')} | {cell('vs_pil')} | "
                     f"{cell('data_wait', True)} | {cell('cores_busy_vs_pil')} |")
    if d.get("skipped"):
        lines += ["", "Not run: " + "; ".join(f"{k} ({v})" for k, v in d["skipped"].items()) + "."]
    return lines + ["", provenance(d, name)]


def render_gpu() -> str:
    """The GPU section; it says so plainly when no GPU results are committed."""
    files = [(n, d) for n in GPU_RUNS if (d := _load(n)) is not None]
    loader = _load("gpu_loader.json")
    if not files and loader is None:
        return "No GPU results are committed: this page claims none.\n"
    lines = gpu(files) if files else []
    if (ab := _load("gpu_batch_ab.json")) is not None:
        lines += [""] + gpu_batch_ab(ab)
    lines += [""] + (gpu_loader(loader) if loader is not None else [
        "The ResNet-50 loader benchmark (`benchmarks.gpu_loader`) has no GPU results committed: its goals "
        "are unmeasured (`make gpu-check GPU_CHECK_ARGS=--loader` writes them)."])
    return "\n".join(lines) + "\n"


def render_page() -> str:
    """docs/results.md: every block of ``render()`` (its headings one level under the title) and
    the nightly-growth section."""
    blocks = re.sub(r"(?m)^#### ", "## ", render())
    return (f"{PAGE_HEAD}\n{blocks}\n## Nightly retraining on a growing source\n\n{render_nightly()}"
            f"\n## On one GPU\n\n{render_gpu()}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="fail if docs/results.md differs from the files")
    args = ap.parse_args(argv)
    wanted = render_page()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != wanted:
            print("docs/results.md is not what benchmarks/results/ says; run python -m benchmarks.report",
                  file=sys.stderr)
            return 1
        return 0
    PAGE.parent.mkdir(exist_ok=True)
    PAGE.write_text(wanted)
    print(f"rewrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
