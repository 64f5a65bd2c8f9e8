"""benchmarks.time_to_accuracy's bookkeeping: Sluice is measured against the fastest baseline
variant (the strongest plain-PyTorch recipe), a seed that never reaches the target counts as
infinitely slow, and the sweep keeps the first budget that reaches 93% with seed 0."""
from __future__ import annotations

import pytest

import benchmarks.time_to_accuracy as tta
from benchmarks.report import time_to_accuracy


def fake_run(times: dict[tuple[str, float, int], float | None]):
    """A stand-in for one training run: 93% at ``times[arm, epochs, seed]`` (None: never)."""
    def run(self, arm, epochs, seed):
        hit = times[(arm, epochs, seed)]
        evals = [{"epoch": epochs, "acc": 0.92 if hit is None else 0.931, "wall_s": hit or 100.0}]
        return {"evals": evals, "wall_s": evals[-1]["wall_s"], "final_acc": evals[-1]["acc"], "seed": seed,
                "epochs": epochs, "seconds_to_target": {"0.93": hit, "0.94": None}}
    return run


def measured(monkeypatch, times, arms, budgets) -> dict:
    """The benchmark's sweep, measured runs and summary over ``fake_run(times)``, seeds 0-2."""
    monkeypatch.setattr(tta.Bench, "run", fake_run(times))
    bench = tta.Bench(arms, [0, 1, 2], budgets, {})
    bench.sweep()
    bench.measure()
    return bench.finish()


def test_ratio_is_to_the_fastest_baseline_and_a_miss_is_infinitely_slow(monkeypatch):
    a, b = list(tta.BASELINES)
    times = {(a, 5, 0): None, (a, 6, 0): 300.0, (a, 6, 1): 310.0, (a, 6, 2): 290.0,
             (b, 5, 0): 250.0, (b, 5, 1): 260.0, (b, 5, 2): None,
             ("sluice", 4, 0): 120.0, ("sluice", 4, 1): None, ("sluice", 4, 2): 125.0}
    res = measured(monkeypatch, times, [a, b, "sluice"], {a: [5, 6], b: [5, 6], "sluice": [4, 5]})
    arms = res["arms"]
    assert arms[a]["budget_epochs"] == 6 and arms[b]["budget_epochs"] == 5 and arms["sluice"]["budget_epochs"] == 4
    assert [r["epochs"] for r in arms[a]["sweep"]] == [5, 6]          # seed 0's hit is reused, not rerun
    assert arms[b]["summary"]["0.93"] == {"median": 260.0, "min": 250.0, "max": None, "misses": 1}
    assert res["strongest_baseline"] == b                              # 260 s beats 300 s
    assert arms["sluice"]["summary"]["0.93"]["median"] == 125.0
    assert arms["sluice"]["ratio_to_baseline_93"] == pytest.approx(125 / 260)
    assert res["goals"]["sluice_93_in_at_most_0.5x_baseline"]["met"]
    text = "\n".join(time_to_accuracy({**res, "seeds": [0, 1, 2]}))
    assert f"fastest baseline arm ({b})" in text and "0.48×" in text


def test_a_sluice_that_misses_on_most_seeds_misses_the_goal(monkeypatch):
    (a, *_), s = list(tta.BASELINES), "sluice"
    times = {(a, 5, k): 200.0 for k in range(3)} | {(s, 4, 0): 80.0, (s, 4, 1): None, (s, 4, 2): None}
    res = measured(monkeypatch, times, [a, s], {a: [5], s: [4]})
    assert res["arms"][s]["summary"]["0.93"]["median"] is None
    assert res["arms"][s]["ratio_to_baseline_93"] is None
    assert not res["goals"]["sluice_93_in_at_most_0.5x_baseline"]["met"]


def test_a_candidates_file_gets_its_own_table_citing_its_own_file(monkeypatch):
    from benchmarks.report import candidates
    (a, *_), s = list(tta.BASELINES), "sluice"
    times = {(a, 5, k): 200.0 for k in range(3)} | {(s, 5, k): 180.0 for k in range(3)}
    text = "\n".join(candidates({**measured(monkeypatch, times, [a, s], {a: [5], s: [5]}), "seeds": [0, 1, 2]}))
    assert text.startswith("#### Candidates for the default")
    assert "`benchmarks/results/time_to_accuracy_candidates.json`" in text and "0.90×" in text


def test_where_the_time_goes_separates_fixed_costs_from_the_pace_of_an_epoch():
    from benchmarks.report import time_to_accuracy
    b, s = list(tta.BASELINES)[0], "sluice"

    def run(seed, first, epoch, **extra):  # evaluations after epochs 1, 2, 3 and a last half epoch
        evals = [{"epoch": 1.0, "acc": 0.9, "wall_s": first}, {"epoch": 2.0, "acc": 0.92, "wall_s": first + epoch},
                 {"epoch": 3.0, "acc": 0.931, "wall_s": first + 2 * epoch},
                 {"epoch": 3.5, "acc": 0.932, "wall_s": first + 2.5 * epoch}]
        return {"seed": seed, "evals": evals, "final_acc": 0.932, **extra}

    def arm(runs, median):
        return {"budget_epochs": 3.5, "runs": runs, "final_acc_median": 0.932,
                "summary": {"0.93": {"median": median, "min": median, "max": median, "misses": 0},
                            "0.94": {"median": None, "min": None, "max": None, "misses": 3}}}
    d = {"arms": {b: arm([run(k, 30.0 + k, 27.0) for k in range(3)], 84.0),
                  s: arm([run(k, 36.0, 20.0 + k, startup_s=2.5 + k, shard_s=3.0) for k in range(3)], 77.0)},
         "strongest_baseline": b, "seeds": [0, 1, 2]}
    text = "\n".join(time_to_accuracy(d))
    assert f"| {b} | — | — | 31.0 s | 27.0 s |" in text       # not recorded for the baseline: a dash
    assert f"| {s} | 3.5 s | 3.0 s | 36.0 s | 21.0 s |" in text  # the last half epoch is not an epoch's pace
    assert "93% by 42 s: half the strongest baseline's median (84 s)" in text
