"""``benchmarks.shard_order``'s section of docs/results.md: test accuracy with ``shard_block`` order
against the global shuffle. Apart from the benchmark, which imports torch at the top.
"""
from __future__ import annotations

from typing import Any

from benchmarks.results_page import _pct, provenance


def results_section(d: dict[str, Any]) -> list[str]:
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
