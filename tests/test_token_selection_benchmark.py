"""``benchmarks/token_selection.py`` (issue #41) at its tiny settings, so that it cannot rot: every
arm runs at every seed, the equal-rows control trains as many rows as infobatch's median, InfoBatch
prunes rows after epoch 0 and none before it, the provenance and verdict are recorded, and the
results page renders the file. Figures are never asserted (that is the benchmark's business)."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

ARMS = {"none", "infobatch", "none_equal"}


@pytest.mark.slow  # ~20 s on two cores: the Debian text, three shards, nine tiny GPT runs
def test_token_selection_benchmark_tiny(tmp_path: Path):
    pytest.importorskip("tokenizers")
    pytest.importorskip("pyarrow")
    if not Path("/usr/share/dictd/gcide.index").exists() or not Path("/usr/share/games/fortunes").exists():
        pytest.skip("the Debian text packages (dict-gcide, fortunes, python3.11-doc) are not installed")
    out = tmp_path / "token_selection_tiny.json"
    p = subprocess.run([sys.executable, "-m", "benchmarks.token_selection", "--tiny", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["mode"] == "tiny" and d["command"].startswith("python -m benchmarks.token_selection")
    assert d["commit"] and d["host_class"] and d["load_average_start"] is not None and d["load_average_end"]
    assert d["seeds"] == [0, 1, 2] and d["settings"]["epochs"] >= 3 and d["settings"]["infobatch"]["prune"] == 0.5
    assert d["corpus"]["graded"] and set(d["corpus"]["sources"]) == {"gcide", "fortunes", "pydocs"}
    runs = d["runs"]
    assert {(r["arm"], r["seed"]) for r in runs} == {(a, s) for a in ARMS for s in d["seeds"]}
    # none and infobatch interleaved, their order rotated per seed; the control after them
    assert [r["arm"] for r in runs[:4]] == ["none", "infobatch", "infobatch", "none"]
    assert all(r["arm"] == "none_equal" for r in runs[-3:])
    for r in runs:
        assert set(r["rows_by_epoch"]) == {str(e) for e in range(d["settings"]["epochs"])}, r["arm"]
        assert r["rows_trained"] == sum(e["trained"] for e in r["rows_by_epoch"].values())
        assert r["train_s"] > 0 and r["wall_s"] >= r["train_s"] and r["val_tokens"] > 0
    full = {r["seed"]: r for r in runs if r["arm"] == "none"}
    for r in (r for r in runs if r["arm"] == "infobatch"):
        e0 = r["rows_by_epoch"]["0"]
        assert e0["trained"] == e0["offered"] == full[r["seed"]]["rows_by_epoch"]["0"]["trained"]  # nothing seen yet
        assert r["rows_trained"] < r["rows_offered"] == full[r["seed"]]["rows_trained"]
    ib = statistics.median(r["rows_trained"] for r in runs if r["arm"] == "infobatch")
    for r in (r for r in runs if r["arm"] == "none_equal"):
        assert r["steps"] == r["max_steps"] == d["none_equal_steps"]
        assert abs(r["rows_trained"] - ib) <= d["settings"]["batch"] / 2
    assert set(d["summary"]) == ARMS
    for v in d["summary"].values():
        for k in ("rows_trained", "train_s", "wall_s", "val_loss_per_token"):
            assert v[k]["min"] <= v[k]["median"] <= v[k]["max"], k
    vd = d["verdict"]
    assert vd["equal_epochs"]["against"] == "none" and vd["equal_rows"]["against"] == "none_equal"
    assert vd["equal_rows"]["direction"] in ("better", "worse", "mixed")
    assert isinstance(vd["saves_compute_at_equal_quality"], bool) and isinstance(vd["beats_equal_rows"], bool)
    assert vd["answer"] and vd["answer"] in vd["text"]
    assert vd["text"] in p.stdout
    from benchmarks import report
    text = "\n".join(report.token_selection(d, out.name))
    assert "InfoBatch" in text and "none_equal" in text and vd["text"] in text


def test_token_selection_renderer_reads_the_committed_files():
    from benchmarks import report
    for p in sorted((ROOT / "benchmarks" / "results").glob("token_selection-*.json")):
        assert report.token_selection(json.loads(p.read_text()), p.name)
