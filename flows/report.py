"""Run reports for the Prefect UI: a markdown summary and the training curves as an SVG picture
(embedded as a data URI, so it opens from the UI with no file server and no plotting library)."""
from __future__ import annotations

import base64
from typing import Any, Sequence


def svg_curves(series: dict[str, Sequence[tuple[float, float]]], title: str, width: int = 640,
               height: int = 320, y_label: str = "") -> str:
    """A small line chart: ``series`` maps a name to (x, y) points."""
    pad_l, pad_r, pad_t, pad_b = 56, 120, 28, 36
    pts = [p for s in series.values() for p in s]
    if not pts:
        pts = [(0.0, 0.0), (1.0, 1.0)]
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y1 = y0 + 1
    w, h = width - pad_l - pad_r, height - pad_t - pad_b

    def sx(x): return pad_l + (x - x0) / (x1 - x0) * w
    def sy(y): return pad_t + h - (y - y0) / (y1 - y0) * h

    colors = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{pad_l}" y="16" font-size="13">{title}</text>',
           f'<line x1="{pad_l}" y1="{pad_t + h}" x2="{pad_l + w}" y2="{pad_t + h}" stroke="#444"/>',
           f'<line x1="{pad_l}" y1="{pad_t}" x2="{pad_l}" y2="{pad_t + h}" stroke="#444"/>']
    for k in range(5):
        yv = y0 + (y1 - y0) * k / 4
        xv = x0 + (x1 - x0) * k / 4
        out.append(f'<text x="{pad_l - 6}" y="{sy(yv) + 4:.1f}" text-anchor="end">{yv:.3g}</text>')
        out.append(f'<text x="{sx(xv):.1f}" y="{pad_t + h + 16}" text-anchor="middle">{xv:.0f}</text>')
    out.append(f'<text x="{pad_l + w / 2}" y="{height - 4}" text-anchor="middle">step</text>')
    if y_label:
        out.append(f'<text x="12" y="{pad_t + h / 2}" transform="rotate(-90 12 {pad_t + h / 2})" text-anchor="middle">{y_label}</text>')
    for i, (name, s) in enumerate(series.items()):
        c = colors[i % len(colors)]
        if s:
            path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s)
            out.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.5" points="{path}"/>')
        out.append(f'<text x="{pad_l + w + 10}" y="{pad_t + 14 * (i + 1)}" fill="{c}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out)


def data_uri(svg: str) -> str:
    return "data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode()


def markdown_summary(s: dict[str, Any]) -> str:
    """The run summary a person reads in the Prefect UI."""
    d = s.get("dataset", {})
    lines = ["# Sluice nightly run", "",
             "## Dataset", f"- version `{d.get('fingerprint', '')[:16]}` at `{d.get('root', '')}`"
             f" ({'reused' if d.get('reused') else 'written'})",
             "- samples: " + ", ".join(f"{k} {v}" for k, v in d.get("counts", {}).items()),
             f"- quarantined samples: {d.get('quarantined', 0)}"]
    il = s.get("il")
    if il:
        lines += ["", "## Irreducible loss", f"- {'reused' if il.get('reused') else 'computed'}"
                  f" ({il.get('train_seconds', 0)} s training, holdout acc {il.get('holdout_accuracy', float('nan')):.3f})"]
    t = s.get("train", {})
    lines += ["", "## Training",
              f"- {t.get('steps', 0)} steps on {t.get('world_size', 1)} ranks, comm `{t.get('comm', 'none')}`",
              f"- loader throughput {t.get('samples_per_s', 0):.0f} samples/s, waiting for data "
              f"{100 * t.get('data_wait_frac', 0):.1f}% of step time",
              f"- gradient bytes per step {t.get('bytes_per_step', 0):.0f} (uncompressed {t.get('uncompressed_bytes', 0):.0f})"]
    if t.get("loader"):  # the loader's bottleneck, from its profile (rank 0)
        lines.append(f"- loader `{t['loader'].get('backend')}`: {t['loader'].get('summary', '')}")
    sel = s.get("selection")
    if sel:
        lines.append("- selection: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                for k, v in sel.items()))
    p = s.get("promotion", {})
    lines += ["", "## Evaluation and promotion",
              f"- candidate test accuracy **{p.get('candidate_value', float('nan')):.4f}**",
              f"- champion before: {p.get('champion_before') or 'none'}"
              + (f" ({p['champion_value']:.4f})" if p.get("champion_value") is not None else ""),
              f"- promoted: **{'yes' if p.get('promoted') else 'no'}** — {p.get('reason', '')}"]
    if s.get("curves_uri"):
        lines += ["", "## Training curves", f"![training curves]({s['curves_uri']})"]
    return "\n".join(lines) + "\n"
