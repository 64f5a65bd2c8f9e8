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
    """The run summary a person reads in the Prefect UI (any kind of data: ``s["kind"]`` says
    what its metric is, which way is better and what a sample is called)."""
    d, k = s.get("dataset", {}), s.get("kind", {})
    samples = k.get("samples", "samples")
    lines = ["# Sluice nightly run", "",
             "## Dataset", f"- version `{d.get('fingerprint', '')[:16]}` ({k.get('name', 'data')}, "
             f"{'reused' if d.get('reused') else 'written'})",
             f"- {samples}: " + ", ".join(f"{n} {v}" for n, v in d.get("counts", {}).items()),
             f"- quarantined {samples}: {d.get('quarantined', 0)}"]
    for src in d.get("sources", []):
        delta = src.get("delta") or {}
        added = delta.get("added")
        lines.append(f"- source `{src['name']}` ({src.get('location', '')}, weight {src.get('weight', 1):g}): version "
                     f"`{src['fingerprint'][:16]}` at `{src.get('root', '')}` "
                     f"({'reused' if src.get('reused') else 'written'}), "
                     + ", ".join(f"{n} {v}" for n, v in src.get("counts", {}).items())
                     + (f"; new since its parent: {sum(added.values()) if isinstance(added, dict) else added}"
                        if added else ""))
    lines += list(d.get("describe", []))
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
    last = evals[-1] if evals else {}
    lines += ["", "## Training",
              f"- **{t.get('steps', 0)} steps** on {t.get('world_size', 1)} ranks "
              f"(stopped by {t.get('stopped_by', 'n/a')}), comm `{t.get('comm', 'none')}`, amp `{t.get('amp', 'n/a')}`",
              f"- resolved for the host: {t.get('host', 'n/a')}",
              *_launch_lines(t.get("launch")),
              f"- final evaluation on `{t.get('eval_split', 'test')}`: accuracy **{_f(t.get('final_acc'))}**, loss "
              f"{_f(last.get('loss'))}"
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
        lines.append(f"- data check: {v.get('samples', 0)} checksums, " + (
            "no damage" if v.get("ok") else f"**{v.get('damaged_count')} damaged**: "
            + ", ".join(f"{d['file']}#{d['index']}" for d in v.get("damaged", [])[:10]))
            + (f"; no checksums in {', '.join(v['unchecked'])}" if v.get("unchecked") else ""))
    fit = s.get("preflight")
    if fit:  # one batch of each split through the model before any rank started
        lines.append(f"- pre-flight: {fit.get('line', '')}")
    sel = s.get("selection")
    if sel:
        lines.append("- selection: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                for k, v in sel.items()))
    lines += ["", "## Evaluation and promotion"] + _promotion(s.get("promotion", {}), samples)
    tracked = s.get("tracking")
    if tracked:  # stages/track: the mirror of this night (and any earlier one it caught up)
        lines += ["", "## Tracking"] + [_tracked(t) for t in tracked]
    charts = s.get("charts", {})
    if charts:
        lines += ["", "## Training curves"] + [f"![{name}]({uri})" for name, uri in charts.items()]
    return "\n".join(lines) + "\n"


def _tracked(t: dict[str, Any]) -> str:
    """One tracker's line: where, what it mirrored tonight, and whether it is behind."""
    added = t.get("added") or []
    state = (f"**mirror behind**: {t['behind']} (the night is not affected"
             + ("; the next night catches up)" if t.get("retry", True) else ")") if t.get("behind") else "up to date")
    return (f"- {t.get('tracker')} (`{t.get('where', '')}`): {len(added)} night(s) mirrored"
            + (f" ({', '.join(added)})" if added else "") + f"; {state}")


def _promotion(p: dict[str, Any], samples: str) -> list[str]:
    """The decision, each source's weight, what it served and its metric, mixture changes, the
    unseen check and where the weights started."""
    better = "higher" if p.get("higher_is_better", True) else "lower"
    lines = [f"- candidate {p.get('metric', '')} **{_f(p.get('candidate_value'))}** on `{p.get('eval_split', 'val')}` "
             f"(decides; {better} is better)"
             + (f"; on `{p['report_split']}` (reported only): {_f(p['report'].get('value'))}"
                if p.get("report") and p.get("report_split") != p.get("eval_split") else ""),
             f"- champion before: {p.get('champion_before') or 'none'}"
             + (f" ({_f(p['champion_value'])})" if p.get("champion_value") is not None else ""),
             f"- promoted: **{'yes' if p.get('promoted') else 'no'}** — {p.get('reason', '')}"]
    rows = p.get("by_source") or {}
    if len(rows) > 1 or any(v.get("candidate") is not None for v in rows.values()):
        m = p.get("metric", "")
        lines += ["", f"| source | weight | trained | candidate {m} | champion {m} |", "|---|---|---|---|---|"]
        for name, v in rows.items():
            lines.append(f"| {name} | {_f(v.get('weight'), '.3g')} | {_n(v.get('trained'))} | "
                         f"{_f(v.get('candidate'))} | {_f(v.get('champion'))} |")
        lines += [f"| **all** | | | {_f(p.get('candidate_value'))} | {_f(p.get('champion_value'))} |", ""]
    mix = p.get("mixture") or {}
    if mix.get("changed"):  # the weights a night trains on are recorded with its model
        lines.append("- mixture weights changed since the champion: " + ", ".join(
            f"{k} {_f(mix['champion_weights'].get(k), '.3g')} → {_f(w, '.3g')}" for k, w in mix["weights"].items()
            if mix["champion_weights"].get(k) != w)
            + "".join(f", {k} {_f(w, '.3g')} → dropped" for k, w in mix["champion_weights"].items()
                      if k not in mix["weights"]))
    w = p.get("warm")
    if w:
        lines.append(f"- weights: warm start from champion {w['parent_model']} (version {w['parent_version'][:16]}): "
                     f"{w['new']} new {samples} + {w['replayed']} replayed ({w['policy']})"
                     if w.get("parent_model") else f"- weights: from scratch ({w.get('why', '')})")
    u = p.get("unseen")
    if u:  # stages/run/grading.py: every graded sample checked against what the model trained on
        lines.append(f"- graded on unseen {samples} only: the candidate trained on {u['candidate_trained_samples']} "
                     f"{samples} ({', '.join(u['candidate_trained_on'])}), none of the {u['samples_checked']} "
                     "graded" + ("; the champion, re-graded on this version, trained on none of them either"
                                  if u.get("champion_samples_checked") is not None else ""))
    return lines


def _launch_lines(launch: dict[str, Any] | None) -> list[str]:
    """Where a Ray-launched run trained, attempt by attempt (``stages/run/ray_nodes.py``)."""
    if not launch:
        return []
    attempts = launch.get("attempts", [])
    said = "; ".join(f"attempt {i + 1}: {a['world_size']} ranks on {len(a['nodes'])} node(s), {a['ended']}"
                     f" after {a['seconds']:.0f} s" for i, a in enumerate(attempts))
    return [f"- launched on a Ray cluster: {said}; {launch.get('node_losses', 0)} node(s) lost"]


def report_markdown(summary: dict[str, Any], metrics_path: str | Path) -> str:
    """The whole report: the summary and both charts (training loss, and the kind's evaluation
    curve: accuracy for a classifier, loss per token for a language model)."""
    loss, acc, eval_loss = read_curves(metrics_path)
    key, label, (lo, hi) = (summary.get("kind") or {}).get("curve") or ("acc", "accuracy", (0.0, 1.0))
    points, name = {"acc": (acc, "accuracy"), "loss": (eval_loss, "loss")}[key]
    charts = {
        "training loss": data_uri(chart_svg({"train loss": loss}, "training loss", "loss",
                                            y_limits=(0.0, math.inf))),
        f"evaluation {name}": data_uri(chart_svg({f"eval {name}": points}, f"evaluation {name}", label,
                                                 y_limits=(lo, hi), empty="no evaluation recorded")),
    }
    return markdown_summary({**summary, "charts": charts})
