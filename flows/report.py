"""Run reports for the Prefect UI: a markdown summary and the training curves, drawn with
matplotlib as SVG and embedded as data URIs (the UI opens them with no file server).

Text stays text in the SVG (``svg.fonttype: none``), so the axes a person reads can also be
checked by a test that opens the page in a browser.
"""
from __future__ import annotations

import base64
import io
import json
import math
import re
from pathlib import Path
from typing import Any, NamedTuple, Sequence

Points = Sequence[tuple[float, float]]


class Curves(NamedTuple):
    """What the report charts, from rank 0's ``metrics.jsonl``: (step, value) points."""
    loss: list[tuple[int, float]]  # training loss
    acc: list[tuple[int, float]]  # evaluation accuracy
    eval_loss: list[tuple[int, float]]  # evaluation loss (a language model's, per token)


def read_curves(metrics_path: str | Path) -> Curves:
    """The report's curves, read once; a step logged twice (a retried run appends) keeps its last
    value."""
    loss: dict[int, float] = {}
    acc: dict[int, float] = {}
    eval_loss: dict[int, float] = {}
    p = Path(metrics_path)
    if p.exists():
        for line in p.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
            if "eval" in rec:
                e, step = rec["eval"], int(rec["eval"]["step"])
                if "acc" in e:
                    acc[step] = float(e["acc"])
                if "loss" in e:
                    eval_loss[step] = float(e["loss"])
            elif "loss" in rec and "step" in rec:
                loss[int(rec["step"])] = float(rec["loss"])
    return Curves(sorted(loss.items()), sorted(acc.items()), sorted(eval_loss.items()))


def chart_svg(series: dict[str, Points], title: str, y_label: str, *,
              y_limits: tuple[float, float] | None = None, empty: str = "no data recorded") -> str:
    """A line chart of ``series`` (name -> (step, value) points) against the training step.

    Every point gets a marker when there are few, so a single evaluation shows as a dot; the
    x axis starts at step 0 with integer ticks; ``y_limits`` clamps the y axis (accuracy stays
    within 0..1). Each line's SVG group has the id ``series-<name>``.
    """
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6.4, 3.2), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title, gid="chart-title")
    ax.set_xlabel("step")
    ax.set_ylabel(y_label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    xs_all = [x for pts in series.values() for x, _ in pts]
    ys_all = [y for pts in series.values() for _, y in pts if math.isfinite(y)]
    for name, pts in series.items():
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if len(pts) <= 40 else None, markersize=4, label=name,
                    gid=f"series-{_slug(name)}")
    if xs_all:
        ax.set_xlim(0, max(max(xs_all), 1) * 1.03)
        ax.legend(loc="best")
    else:
        ax.text(0.5, 0.5, empty, transform=ax.transAxes, ha="center", va="center")
    if ys_all:
        lo, hi = min(ys_all), max(ys_all)
        pad = max((hi - lo) * 0.1, 0.02 * max(abs(hi), 1e-3))
        lo, hi = lo - pad, hi + pad
        if y_limits is not None:
            lo, hi = max(lo, y_limits[0]), min(hi, y_limits[1])
        ax.set_ylim(lo, hi)
    elif y_limits is not None and all(map(math.isfinite, y_limits)):  # no data: fixed limits only
        ax.set_ylim(*y_limits)
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "sluice"}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    return buf.getvalue()


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def data_uri(svg: str) -> str:
    return "data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode()


def _f(v: Any, fmt: str = ".4f") -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and math.isfinite(v) else "n/a"


def _n(v: Any) -> str:
    return f"{v:,}" if isinstance(v, int) else "n/a"


def markdown_summary(s: dict[str, Any]) -> str:
    """The run summary a person reads in the Prefect UI."""
    d = s.get("dataset", {})
    lines = ["# Sluice nightly run", "",
             "## Dataset", f"- version `{d.get('fingerprint', '')[:16]}` at `{d.get('root', '')}`"
             f" ({'reused' if d.get('reused') else 'written'})",
             "- samples: " + ", ".join(f"{k} {v}" for k, v in d.get("counts", {}).items()),
             f"- quarantined samples: {d.get('quarantined', 0)}"]
    for src in d.get("sources", []):  # text: one token artifact per source
        delta = src.get("delta") or {}
        lines.append(f"- source `{src['name']}` ({src.get('source', '')}, weight {src.get('weight', 1):g}): version "
                     f"`{src['fingerprint'][:16]}` ({'reused' if src.get('reused') else 'written'}), documents "
                     + ", ".join(f"{k} {v}" for k, v in src.get("counts", {}).items())
                     + (f"; new since its parent: {sum(delta.get('added', {}).values())}" if delta else ""))
    if d.get("damaged_sources"):
        lines.append(f"- **damaged source files kept in part: {d['damaged_sources']}** (see the manifest)")
    il = s.get("il")
    if il:
        lines += ["", "## Irreducible loss",
                  f"- {'reused' if il.get('reused') else 'carried' if il.get('reused_from') else 'computed'}: "
                  f"{il.get('train_seconds', 0)} s "
                  f"training on the holdout split ({il.get('holdout_size', '?')} samples)",
                  f"- IL model accuracy on the {il.get('scored_split', 'train')} split it scores (unseen): "
                  f"{_f(il.get('scored_accuracy'), '.3f')}; on its own training data (the holdout): "
                  f"{_f(il.get('holdout_accuracy'), '.3f')}"]
        if il.get("reused_from"):  # carried by key from an earlier version (stages/select/il_carry.py)
            lines.append(f"- carried from version `{il['reused_from'][:16]}`: {il.get('reused_samples', 0)} "
                         f"unchanged samples reused, {il.get('scored', 0)} new, changed or relabelled scored")
        elif il.get("retrained"):
            lines.append(f"- IL model retrained: {il['retrained']}")
    t = s.get("train", {})
    evals = t.get("evals", [])
    lines += ["", "## Training",
              f"- **{t.get('steps', 0)} steps** on {t.get('world_size', 1)} ranks "
              f"(stopped by {t.get('stopped_by', 'n/a')}), comm `{t.get('comm', 'none')}`, amp `{t.get('amp', 'n/a')}`",
              f"- resolved for the host: {t.get('host', 'n/a')}",
              f"- final evaluation accuracy **{_f(t.get('final_acc'))}** on `{t.get('eval_split', 'test')}`"
              + (f" ({len(evals)} evaluation{'s' if len(evals) != 1 else ''} during training)" if evals else ""),
              f"- loader throughput {_f(t.get('samples_per_s'), '.0f')} samples/s, waiting for data "
              f"{_f(100 * t['data_wait_frac'] if 'data_wait_frac' in t else None, '.1f')}% of step time",
              f"- gradient bytes per step {_f(t.get('bytes_per_step'), '.0f')} "
              f"(uncompressed {_f(t.get('uncompressed_bytes'), '.0f')})"]
    if t.get("loader"):  # the loader's bottleneck, from its profile (rank 0)
        lines.append(f"- loader `{t['loader'].get('backend')}`: {t['loader'].get('summary', '')}")
        if t["loader"].get("corrupt_skipped"):  # loader.on_corrupt: skip (summed over every rank)
            lines.append(f"- damaged samples skipped by the loader: {t['loader']['corrupt_skipped']} (all ranks)")
    v = s.get("verify")
    if v:  # sluice verify, run before training
        lines.append(f"- artifact check: {v.get('samples', 0)} sample checksums, " + (
            "no damage" if v.get("ok") else f"**{v.get('damaged_count')} damaged**: "
            + ", ".join(f"{d['file']}#{d['index']}" for d in v.get("damaged", [])[:10]))
            + (f"; no checksums in {', '.join(v['unchecked'])}" if v.get("unchecked") else ""))
    sel = s.get("selection")
    if sel:
        lines.append("- selection: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                for k, v in sel.items()))
    p = s.get("promotion", {})
    if str(p.get("metric", "")).endswith("loss"):  # a language model: promoted by its loss per token
        lines += ["", "## Evaluation and promotion"] + _loss_promotion(p)
        charts = s.get("charts", {})
        if charts:
            lines += ["", "## Training curves"] + [f"![{name}]({uri})" for name, uri in charts.items()]
        return "\n".join(lines) + "\n"
    lines += ["", "## Evaluation and promotion",
              f"- candidate accuracy **{_f(p.get('candidate_value'))}** on `{p.get('eval_split', 'val')}` (decides)"
              + (f"; on `{p['report_split']}` (reported only): {_f(p['report'].get('acc'))}"
                 if p.get("report") and p.get("report_split") != p.get("eval_split") else ""),
              f"- champion before: {p.get('champion_before') or 'none'}"
              + (f" ({_f(p['champion_value'])})" if p.get("champion_value") is not None else ""),
              f"- promoted: **{'yes' if p.get('promoted') else 'no'}** — {p.get('reason', '')}"]
    w = p.get("warm")
    if w:
        lines.append(f"- weights: warm start from champion {w['parent_model']} (version {w['parent_version'][:16]}): "
                     f"{w['new']} new samples + {w['replayed']} replayed ({w['policy']})"
                     if w.get("parent_model") else f"- weights: from scratch ({w.get('why', '')})")
    u = p.get("unseen")
    if u:  # stages/run/grading.py: every graded sample checked against what the model trained on
        lines.append(f"- graded on unseen samples only: the candidate trained on {u['candidate_trained_samples']} "
                     f"samples ({', '.join(u['candidate_trained_on'])}), none of the {u['samples_checked']} "
                     "graded" + ("; the champion, re-graded on this version, trained on none of them either"
                                  if u.get("champion_samples_checked") is not None else ""))
    charts = s.get("charts", {})
    if charts:
        lines += ["", "## Training curves"] + [f"![{name}]({uri})" for name, uri in charts.items()]
    return "\n".join(lines) + "\n"


def _loss_promotion(p: dict[str, Any]) -> list[str]:
    """Promotion by validation loss: the decision, then candidate and champion per source."""
    lines = [f"- candidate {p['metric']} **{_f(p.get('candidate_value'))}** per token on `{p.get('eval_split')}` "
             f"(decides; lower is better)",
             f"- champion before: {p.get('champion_before') or 'none'}"
             + (f" ({_f(p['champion_value'])})" if p.get("champion_value") is not None else ""),
             f"- promoted: **{'yes' if p.get('promoted') else 'no'}** — {p.get('reason', '')}",
             "", f"| source | weight | tokens trained | candidate {p['metric']} | champion {p['metric']} |",
             "|---|---|---|---|---|"]
    for name, v in p.get("loss_by_source", {}).items():
        lines.append(f"| {name} | {_f(v.get('weight'), '.3g')} | {_n(v.get('trained_tokens'))} | "
                     f"{_f(v.get('candidate'))} | {_f(v.get('champion'))} |")
    lines.append(f"| **all** | | | {_f(p.get('candidate_value'))} | {_f(p.get('champion_value'))} |")
    mix = p.get("mixture") or {}
    if mix.get("changed"):  # the weights a night trains on are recorded with its model
        lines += ["", "- mixture weights changed since the champion: " + ", ".join(
            f"{k} {_f(mix['champion_weights'].get(k), '.3g')} → {_f(w, '.3g')}" for k, w in mix["weights"].items()
            if mix["champion_weights"].get(k) != w)
            + "".join(f", {k} {_f(w, '.3g')} → dropped" for k, w in mix["champion_weights"].items()
                      if k not in mix["weights"])]
    u = p.get("unseen")
    if u:
        lines += ["", f"- graded on unseen documents only: the candidate trained on {u['candidate_trained_samples']} "
                  f"documents ({', '.join(u['candidate_trained_on'])}), none of the {u['samples_checked']} graded"
                  + ("; the champion, re-graded on these versions, trained on none of them either"
                     if u.get("champion_samples_checked") is not None else "")]
    w = p.get("warm")
    if w:
        lines.append(f"- weights: from scratch ({w.get('why', '')})")
    return lines


def report_markdown(summary: dict[str, Any], metrics_path: str | Path) -> str:
    """The whole report: the summary and both charts (training loss, evaluation accuracy)."""
    loss, acc, eval_loss = read_curves(metrics_path)
    if str(summary.get("promotion", {}).get("metric", "")).endswith("loss"):  # a language model
        return markdown_summary({**summary, "charts": {
            "training loss": data_uri(chart_svg({"train loss": loss}, "training loss", "loss per token",
                                                y_limits=(0.0, math.inf))),
            "evaluation loss": data_uri(chart_svg({"eval loss": eval_loss}, "evaluation loss",
                                                  "loss per token", y_limits=(0.0, math.inf),
                                                  empty="no evaluation recorded"))}})
    charts = {
        "training loss": data_uri(chart_svg({"train loss": loss}, "training loss", "loss",
                                            y_limits=(0.0, math.inf))),
        "evaluation accuracy": data_uri(chart_svg({"eval accuracy": acc}, "evaluation accuracy",
                                                  "accuracy", y_limits=(0.0, 1.0),
                                                  empty="no evaluation recorded")),
    }
    return markdown_summary({**summary, "charts": charts})
