"""benchmarks.compression --link R --merge: a rate measured in one session joins the rates of an
earlier one (same settings) in one results file; the modes of a rate always come from one run;
other settings are refused before any work. Bookkeeping only: the runs here are made up."""
from __future__ import annotations

import json

import pytest

import benchmarks.compression_links as cl
from benchmarks.report import compression_links


def fake_results(rates: list[str], when: str, none_s: float, psgd_s: float) -> dict:
    """What ``run`` returns (+ the provenance main adds) for seeds 0 and 1 and one model."""
    def one(clock: float, step: float, acc: float) -> dict:
        return {"final_acc": acc, "steps": 300, "train_clock_s": clock, "step_s": step, "bytes_per_step": 1e6,
                "bytes_per_step_whole_run": 1e6, "hook_busy_fraction": 0.1, "param_digests_equal": True,
                "evals": [(150, clock / 2, acc - 0.05), (300, clock, acc)]}
    raw = {r: {"small_cnn_dense": {"none": {s: one(none_s, none_s / 300, 0.80) for s in (0, 1)},
                                   "powersgd_rank2": {s: one(psgd_s, psgd_s / 300, 0.795) for s in (0, 1)}}}
           for r in rates}
    about = {"mode": "full", "models": {"small_cnn_dense": cl.MODELS["small_cnn_dense"]}, "modes": cl.MODES,
             "steps": {"small_cnn_dense": 300}, "budget_sweep": list(cl.BUDGET_SWEEP), "seeds": [0, 1], "eval_every_steps": cl.EVAL_EVERY,
             "test_images": cl.TEST_IMAGES, "compute_only_steps": cl.COMPUTE_STEPS, "commit": when,
             "per_rate": {r: {"commit": when, "when": when, "load_average_start": [1.0]} for r in rates}}
    return {"_about": about, "raw": raw,
            "compute_only_step_s": {r: {"small_cnn_dense": {0: 0.3, 1: 0.3}} for r in rates},
            "link_mbit": {r: [cl.rate_bits(r) / 1e6 * 0.96] * 2 for r in rates},
            "budgets": {r: {"small_cnn_dense": {"none": {"multiplier": 1.0, "sweep": None}, "powersgd_rank2": {
                "multiplier": 1.25, "steps": 375, "sweep": [
                    {"multiplier": 1.0, "steps": 300, "final_acc": 0.785, "reached": False},
                    {"multiplier": 1.25, "steps": 375, "final_acc": 0.795, "reached": True}]}}} for r in rates},
            "order": [f"seed{s}/{r}/small_cnn_dense/{m}" for s in (0, 1) for r in rates for m in cl.MODES]}


def test_merge_keeps_the_other_rates_and_replaces_the_rerun_one():
    old = json.loads(json.dumps(fake_results(["100mbit", "1gbit"], "day1", 200.0, 120.0)))  # as read from disk
    new = fake_results(["1gbit", "10gbit"], "day2", 60.0, 70.0)
    m = cl.merge(old, new)
    assert m["_about"]["rates"] == ["100mbit", "1gbit", "10gbit"]
    assert {r: v["when"] for r, v in m["_about"]["per_rate"].items()} == {"100mbit": "day1", "1gbit": "day2",
                                                                           "10gbit": "day2"}
    assert m["raw"]["1gbit"]["small_cnn_dense"]["none"][0]["train_clock_s"] == 60.0      # the rerun rate is new
    assert m["raw"]["100mbit"]["small_cnn_dense"]["none"][0]["train_clock_s"] == 200.0   # seeds are ints again
    assert sum(o.split("/")[1] == "1gbit" for o in m["order"]) == 4                        # no stale 1gbit runs
    summary = cl.summarise(m["raw"], m["compute_only_step_s"], m["link_mbit"])
    assert summary["100mbit"]["small_cnn_dense"]["powersgd_rank2"]["vs_uncompressed_wall"] == pytest.approx(0.6)
    assert summary["100mbit"]["small_cnn_dense"]["none"]["comm_fraction"] == pytest.approx(1 - 0.3 / (200 / 300))
    g = cl.goals(summary, ["small_cnn_dense"])["small_cnn_dense"]
    assert not g["100mbit_powersgd_vs_uncompressed_wall"]["met"] and not g["1gbit_powersgd_not_slower"]["met"]
    text = "\n".join(compression_links({**m, "summary": summary, "goals": {"small_cnn_dense": g}}))
    assert "separate runs" in text and "100mbit: commit `day1`" in text
    # the budget sweep is listed once for the rates whose sweeps agree
    assert "- small_cnn_dense powersgd_rank2 (100mbit, 1gbit, 10gbit): 1× = 300 steps → 78.50%, " \
           "1.25× = 375 steps → 79.50% (reached)" in text


def test_merge_refuses_other_settings():
    old = fake_results(["100mbit"], "day1", 200.0, 120.0)
    new = fake_results(["1gbit"], "day2", 60.0, 50.0)
    new["_about"]["steps"] = {"small_cnn_dense": 100}
    with pytest.raises(SystemExit, match="steps"):
        cl.merge(old, new)
    old["_about"]["mode"] = "quick"
    with pytest.raises(SystemExit, match="other settings"):
        cl.merge(old, fake_results(["1gbit"], "day2", 60.0, 50.0))


def test_budget_sweep_stops_at_the_first_budget_that_reaches_the_target():
    def result(mult: float, acc: float) -> dict:
        return {"steps": round(100 * mult), "final_acc": acc, "train_clock_s": 10 * mult,
                "evals": [(round(50 * mult), 5 * mult, acc - 0.02), (round(100 * mult), 10 * mult, acc)]}
    accs = {1.0: 0.80, 1.25: 0.83, 1.5: 0.86, 2.0: 0.88}
    ran: list[float] = []

    def train(mult: float) -> dict:
        ran.append(mult)
        return result(mult, accs[mult])
    mult, res, points = cl.sweep_budget(0.85, result(1.0, 0.80), cl.BUDGET_SWEEP, train)
    assert (mult, res["steps"], ran) == (1.5, 150, [1.25, 1.5])            # 2x never ran
    assert [p["reached"] for p in points] == [False, False, True] and points[-1]["seconds_to_target"] == 15.0
    ran.clear()
    mult, res, points = cl.sweep_budget(0.95, result(1.0, 0.80), cl.BUDGET_SWEEP, train)
    assert mult == 2.0 and not points[-1]["reached"] and len(points) == 4  # none reached: the largest stands
    ran.clear()
    mult, _, points = cl.sweep_budget(0.78, result(1.0, 0.80), cl.BUDGET_SWEEP, train)
    assert (mult, ran, points[0]["seconds_to_target"]) == (1.0, [], 5.0)   # reached at once: nothing more
    mult, _, points = cl.sweep_budget(None, {"error": "boom"}, cl.BUDGET_SWEEP, train)
    assert mult == 1.0 and points == [{"multiplier": 1.0, "error": "boom"}]  # no target: no sweep


def test_merge_refuses_another_budget_sweep():
    old = fake_results(["100mbit"], "day1", 200.0, 120.0)
    new = fake_results(["1gbit"], "day2", 60.0, 50.0)
    new["_about"]["budget_sweep"] = [1.0, 3.0]
    with pytest.raises(SystemExit, match="budget_sweep"):
        cl.merge(old, new)


def test_crossover_fits_time_to_target_and_step_time_over_the_rates():
    """none: 100 compute + comm steps of 300 at 4 MB; PowerSGD: 1.5x the steps, nearly no bytes.
    Time to target t = steps * (c + bytes * 8 / rate): equal where 300 (c + 32/r) = 450 c."""
    c = 0.1
    summary = {}
    for rate in ("100mbit", "1gbit", "10gbit"):
        mbit = cl.rate_bits(rate) / 1e6
        none_step, psgd_step = c + 32 / mbit, c + 0.0001
        summary[rate] = {"measured_mbit": {"median": mbit}, "m": {
            "none": {"step_s": none_step, "seconds_to_target": 300 * none_step},
            "powersgd_rank2": {"step_s": psgd_step, "seconds_to_target": 450 * psgd_step}}}
    out = cl.crossover(summary, "m")
    assert out["powersgd_faster_to_target"] == {"100mbit": True, "1000mbit": False, "10000mbit": False}
    assert out["fitted_time_to_target_crossover_mbit"] == pytest.approx(32 * 300 / (150 * c), rel=0.01)  # 640
    assert out["fitted_crossover_mbit"] > 10_000  # per step PowerSGD is quicker at every rate here
