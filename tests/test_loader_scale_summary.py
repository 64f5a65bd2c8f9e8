"""benchmarks.loader_scale's summary: a run cut short (a thrashing backend) keeps its pace so far,
flagged, and never counts toward the goal or the decode-bound limit; OOM kills fail the memory goal."""
from __future__ import annotations

from benchmarks.loader_scale import summarise
from benchmarks.report import loader_scale

LIMIT = 1 << 30
BPS = {"ffcv": 18_000.0, "webdataset": 18_000.0, "memory": None}


def row(backend, cond, sps=None, seed=0, **kw):
    r = {"backend": backend, "sampler": "shuffle", "condition": cond, "seed": seed, "peak_bytes": LIMIT // 2,
         "oom_kills": 0, "read_bytes": 0}
    if sps is not None:
        r["samples_per_s"] = sps
    return {**r, **kw}


def test_a_run_cut_short_keeps_its_pace_but_never_sets_the_goal():
    rows = [row("ffcv", "throttled", timed_out=True, samples_per_s_partial=93.0),
            row("webdataset", "throttled", 900.0), row("webdataset", "throttled", 1100.0, seed=1),
            row("ffcv", "cached", timed_out=True, samples_per_s_partial=5000.0),
            row("webdataset", "cached", 1200.0)]
    s = summarise(rows, BPS, throttle=200_000_000, limit=LIMIT)
    ffcv = s["arms"]["ffcv/shuffle/throttled"]
    assert ffcv["timed_out"] == 1 and ffcv["samples_per_s"]["median"] == 93.0
    assert s["decode_bound_limit"] == 1200.0                 # not the cut-short cached ffcv run
    g = s["goal"]
    assert g["best_throttled_arm"] == "webdataset/shuffle/throttled" and g["ratio"] == 1000.0 / 1200.0
    assert g["met"] and s["memory_goal_met"]
    text = "\n".join(loader_scale({"dataset": {"tar_bytes": 4e9, "samples": 216_000}, "memory_limit_bytes": LIMIT,
                                   "throttle_bytes_per_s": 200_000_000, "batches_per_run": 100, **s}))
    assert "cut short" in text and "0.833×, **met**" in text


def test_an_oom_kill_fails_the_memory_goal():
    rows = [row("ffcv", "throttled", rc=-9, oom_kills=1, peak_bytes=LIMIT), row("webdataset", "cached", 1200.0)]
    s = summarise(rows, BPS, throttle=200_000_000, limit=LIMIT)
    assert s["arms"]["ffcv/shuffle/throttled"]["failed"] == 1 and not s["memory_goal_met"]
