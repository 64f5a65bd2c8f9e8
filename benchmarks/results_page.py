"""What every benchmark's section of docs/results.md shares: reading a results file, the source
line that ends each block, and the page's number formats.

Each benchmark renders its own section (a ``results_section`` beside the benchmark, or in a
``<name>_report`` module where the benchmark imports torch at the top or times its own process);
``benchmarks.report`` puts the sections on the page. A format here is the page's, so every section writes a second,
a share or a ratio alike: ``_s`` seconds (``missed`` for a run that never got there), ``_pct`` a
share, ``_x`` a ratio, ``_range`` a min–max, ``_pts`` points, ``_la`` a load average.
"""
from __future__ import annotations

import json
import statistics
from typing import Any

from benchmarks.common import RESULTS
from benchmarks.hostinfo import class_of


def load(name: str) -> dict[str, Any] | None:
    """A results file under benchmarks/results/, or None where there is none."""
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


def _pts(v: float | None) -> str:
    return "—" if v is None else f"{v:+.2f}"


def _la(v: list | None) -> str:
    return f"{v[0]:.1f}" if v else "not recorded"


def _median(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


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
