"""The selection block of docs/results.md: RHO-LOSS's irreducible-loss cost shows per run and amortised
over the runs that reuse its scores, min-max beside each median, and the goal as the file says."""
from __future__ import annotations

from benchmarks.report import selection


def results(rho_seconds: float | None) -> dict:
    method = lambda secs, with_il, rng: {"steps_to_target": None if secs is None else 1000,  # noqa: E731
                                         "seconds_to_target": secs, "seconds_to_target_with_il": with_il,
                                         "seconds_to_0.88_range": rng, "final_acc": 0.88}
    il = 70.0
    rho_with_il = None if rho_seconds is None else rho_seconds + il
    return {"targets": [0.85, 0.88], "il_reuses": 7, "seeds": [0, 1, 2], "command": "x",
            "levels": {"0.2": {"il_seconds": il, "goal_rho_loss_with_il_faster_than_uniform": {
                "target": 0.88, "uniform_s": 100.0, "rho_loss_with_il_s": rho_with_il,
                "ratio": None if rho_with_il is None else rho_with_il / 100.0,
                "met": bool(rho_with_il and rho_with_il < 100.0)},
                "methods": {"uniform": method(100.0, 100.0, [90.0, 110.0]),
                            "rho_loss": method(rho_seconds, rho_with_il,
                                               [rho_seconds, None] if rho_seconds else [None, None])}}}}


def row(lines: list[str], name: str) -> list[str]:
    return [c.strip() for c in next(x for x in lines if x.startswith(f"| {name} |")).split("|")[1:-1]]


def test_il_cost_per_run_and_amortised():
    lines = selection(results(60.0))
    rho, uni = row(lines, "rho_loss"), row(lines, "uniform")
    assert rho[2:5] == ["60 s (60 s–missed)", "130 s", "70 s"]   # 60 + 70; 60 + 70 / 7
    assert uni[2:5] == ["100 s (90 s–110 s)", "—", "—"]          # uniform pays no IL model
    assert any("**missed** (1.30× uniform's time). With the IL model's cost shared by 7 runs that reuse its scores: rho_loss 0.70×." in x for x in lines)


def test_a_rho_loss_that_never_reaches_the_target_reads_missed():
    rho = row(selection(results(None)), "rho_loss")
    assert rho[1:5] == ["missed", "missed", "missed", "missed"]
