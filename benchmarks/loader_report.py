"""``benchmarks.loader``'s sections of docs/results.md: each backend against its raw library
(``loader.json``), and the per-sample checks' cost (``--checks``: ``loader_checks.json``). Apart
from the benchmark, which imports torch at the top.
"""
from __future__ import annotations

from typing import Any

from benchmarks.common import paired_overhead
from benchmarks.results_page import _x, provenance


def results_section(d: dict[str, Any]) -> list[str]:
    lines = ["#### Loader throughput", "", "| dataset | backend | samples/s | vs its raw library |", "|---|---|---|---|"]
    for ds, g in d.get("goals", {}).items():
        for name, r in g.get("ours_vs_raw", {}).items():
            sps = next((row["samples_per_s"] for row in d["rows"] if row["dataset"] == ds and row["name"] == name), None)
            lines.append(f"| {ds} | {name} | {sps:,.0f} | {_x(r['ratio'])} ({r['raw']}; goal ≥ {r['goal']}×: "
                         f"{'met' if r['met'] else 'missed'}) |")
    return lines + ["", provenance(d, "loader.json")]


def checks_section(d: dict[str, Any]) -> list[str]:
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
