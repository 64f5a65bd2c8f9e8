"""``benchmarks.compression``'s sections of docs/results.md: bytes, time and accuracy per mode on 2
ranks over loopback (``compression.json``), and with ``--link`` (``benchmarks.compression_links``)
time to accuracy per mode over shaped links, the compressed modes' step budgets and the goals
(``compression_links.json``). Apart from the benchmark, which imports torch and Sluice at the top.
"""
from __future__ import annotations

from typing import Any

from benchmarks.results_page import _pct, _s, _x, provenance


def results_section(d: dict[str, Any]) -> list[str]:
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


def links_section(d: dict[str, Any], name: str = "compression_links.json") -> list[str]:
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
