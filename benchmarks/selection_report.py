"""``benchmarks.selection``'s section of docs/results.md: methods under label noise, seconds to the
target with the irreducible-loss model's cost per run and amortised. Apart from the benchmark,
which imports torch and Sluice at the top: rendering the page needs neither.
"""
from __future__ import annotations

from typing import Any

from benchmarks.results_page import _pct, _range, _s, _x, provenance


def results_section(d: dict[str, Any]) -> list[str]:
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
