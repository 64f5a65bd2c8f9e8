"""``benchmarks.gpu_loader``'s sections of docs/results.md: on one GPU, ResNet-50's trained images/s
fed by each loader with the goals beside them (``gpu_loader.json``); without one, decode and
augmentation per core (``gpu_loader_cpu-<host class>.json``). Apart from the benchmark, which
imports torch at the top.
"""
from __future__ import annotations

from typing import Any

from benchmarks.hostinfo import class_of
from benchmarks.results_page import _pct, _x, provenance


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


def cpu_section(d: dict[str, Any], name: str) -> list[str]:
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


def results_section(d: dict[str, Any], name: str = "gpu_loader.json") -> list[str]:
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
