"""``benchmarks.tokens``' section of docs/results.md, per results file: the loader's tokens/s on one
core, the mixture's exact resume at other world sizes, and time to a validation loss against a
nanoGPT-style loop. Apart from the benchmark, whose e2e runs time their own process from its
start (``python -m benchmarks.tokens --e2e-run``): rendering the page adds nothing to what they
import.
"""
from __future__ import annotations

import statistics
from typing import Any

from benchmarks.hostinfo import class_of
from benchmarks.results_page import _la, _range, _s, _x, provenance


def _met(g: dict[str, Any] | None) -> str:
    return "not measured" if not g or g.get("met") is None else ("met" if g["met"] else "missed")


def results_section(d: dict[str, Any], name: str) -> list[str]:
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
