"""``benchmarks/tokens.py`` (issue #41) end to end at its smallest settings on a tiny corpus, so
that it cannot rot: the three parts run, the resume check passes at every world size, and the
results page renders the file. Figures are never asserted (speed is a benchmark's business)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow  # ~40 s on two cores: the Debian text, three shards, two GPT runs


def test_tokens_benchmark_tiny(tmp_path: Path):
    pytest.importorskip("tokenizers")
    pytest.importorskip("pyarrow")
    if not Path("/usr/share/dictd/gcide.index").exists() or not Path("/usr/share/games/fortunes").exists():
        pytest.skip("the Debian text packages (dict-gcide, fortunes, python3.11-doc) are not installed")
    out = tmp_path / "tokens_tiny.json"
    p = subprocess.run([sys.executable, "-m", "benchmarks.tokens", "--tiny", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["mode"] == "tiny" and d["commit"] and d["host_class"] and d["load_average_start"] is not None
    lo = d["loader"]
    arms = set(lo["summary"])
    assert {"nanogpt_memmap", "sluice", "sluice_mixture"} <= arms
    assert "litdata_tokens" in arms or "litdata_tokens" in lo["skipped"]
    assert all(len(lo["runs"][a]) == lo["repeats"] for a in arms)
    rs = d["resume"]
    assert set(rs["worlds"]) == {"1", "2", "3", "6"}
    assert rs["all_pass"], {k: v["pass"] for k, v in rs["worlds"].items()}
    e2e = d["e2e"]
    assert {r["arm"] for r in e2e["runs"]} == {"nanogpt_loop", "sluice", "sluice_curriculum"}
    steps = {r["arm"]: r["steps_planned"] for r in e2e["runs"]}
    assert steps["sluice"] == steps["nanogpt_loop"] < steps["sluice_curriculum"]  # short rows early: more steps
    assert all("error" not in r for r in e2e["runs"]), [r.get("error") for r in e2e["runs"]]
    assert all(r["time_to_target_s"] is not None for r in e2e["runs"])  # the tiny target is loose
    from benchmarks import report
    text = "\n".join(report.tokens(d, out.name))
    assert "Token pipeline" in text and "pass" in text


def test_tokens_renderer_reads_the_committed_files():
    from benchmarks import report
    for p in sorted((ROOT / "benchmarks" / "results").glob("tokens-*.json")):
        assert report.tokens(json.loads(p.read_text()), p.name)


def test_the_e2e_goal_is_the_recipes_default_arm_over_the_loop():
    """The ratio is ``sluice`` (no curriculum) over the plain loop, medians over seeds; the
    curriculum arm never decides it, and a seed of ``sluice`` that missed the target leaves none."""
    from benchmarks.tokens import e2e_goal
    times = {"nanogpt_loop": (10.0, 20.0, 30.0), "sluice": (8.0, 12.0, 40.0), "sluice_curriculum": (1.0, 1.0, 1.0)}
    runs = [{"arm": a, "time_to_target_s": t} for a, ts in times.items() for t in ts]
    summary, goal = e2e_goal(runs)
    assert summary["sluice"]["per_seed"] == [8.0, 12.0, 40.0] and summary["sluice_curriculum"]["median"] == 1.0
    assert goal["ratio"] == pytest.approx(0.6) and goal["met"]
    runs[4]["time_to_target_s"] = None
    summary, goal = e2e_goal(runs)
    assert summary["sluice"]["misses"] == 1 and goal["ratio"] is None and not goal["met"]
