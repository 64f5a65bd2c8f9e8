"""benchmarks.nightly_growth's bookkeeping: the night schedule, merging runs of the same
settings, the per-night summary and goals, and the docs/results.md block. No training: the runs here are
made up."""
from __future__ import annotations

import json

import numpy as np
import pytest

import benchmarks.nightly_growth as ng
from benchmarks.report import nightly_growth as block


def test_the_schedule_grows_corrects_and_deletes():
    labels = np.arange(60_000) % 10
    nights = ng.plan_nights(0, ng.FULL, labels)
    assert [n["shown"].size for n in nights] == [30_000, 36_000, 42_000, 48_000, 53_700, 59_700]
    assert [n["added"] for n in nights] == [30_000] + [6_000] * 5
    assert [n["removed"] for n in nights] == [0, 0, 0, 0, 300, 0]
    assert [n["relabelled"] for n in nights] == [0, 0, 0, 300, 0, 0]
    wrong = [int((n["labels"] != labels[n["shown"]]).sum()) for n in nights]
    assert wrong == [300, 300, 300, 0, 0, 0]
    for a, b in zip(nights, nights[1:]):  # a night keeps yesterday's samples but the deleted ones
        assert np.isin(a["shown"], b["shown"]).sum() == a["shown"].size - b["removed"]
    short = ng.plan_nights(0, {**ng.FULL, "nights": 2}, labels)
    assert all((x["shown"] == y["shown"]).all() for x, y in zip(short, nights))  # same first nights
    assert not (ng.plan_nights(1, ng.FULL, labels)[0]["shown"] == nights[0]["shown"]).all()


def _night(n: int, acc: float, wall: float, sluice: bool = False, overlap: int = 0) -> dict:
    r = {"night": n, "seed": 0, "samples": 100 + 10 * n, "added": 100 if n == 0 else 10, "removed": 0,
         "relabelled": 0, "mislabelled": 0, "test_acc": acc, "wall_s": wall, "train_s": wall / 2,
         "shard_s": 1.0 if sluice else 0.0, "bytes_written": 1_000_000 if sluice else 0,
         "evals": [{"acc": acc - 0.05, "wall_s": wall / 2}, {"acc": acc, "wall_s": wall}]}
    if sluice:
        r.update(manifest_bytes=10_000, new_sample_bytes=990_000 if n == 0 else 99_000,
                 promotion={"promoted": True, "warm": {}},
                 overlap={"candidate": overlap, "champion": 0, "champion_test_acc": acc})
    return r


def _runs(seed: str, sluice_acc: float, overlap: int = 0) -> dict:
    prov = {"command": "python -m benchmarks.nightly_growth", "commit": "abc", "when": f"day{seed}",
            "load_average_start": [1.0]}
    return {"plain scratch": {seed: {"nights": [_night(n, 0.90, 100.0) for n in range(2)], "provenance": prov}},
            "plain fine-tune": {seed: {"nights": [_night(0, 0.90, 100.0), _night(1, 0.90, 60.0)], "provenance": prov}},
            "sluice nightly": {seed: {"nights": [_night(n, sluice_acc, 20.0, True, overlap) for n in range(2)],
                                      "provenance": prov}}}


def _result(runs: dict) -> dict:
    settings = {"mode": "full", "schedule": {**ng.FULL, "nights": 2},
                "plain": {"variant": "baseline", "args": [], "epochs": 5}, "finetune": {"epochs": 1, "lr": 0.1},
                "finetune_from": "sweep", "sluice": ng.SLUICE_ARMS, "sluice_epochs": "default", "within_points": 0.2}
    res = {"settings": settings, "runs": runs, "seeds": [0], "command": "x", "commit": "abc", "mode": "full"}
    return {**res, **ng.summarise(res)}


def test_goals_per_night_from_the_medians():
    r = _result(_runs("0", 0.899))
    g = r["goals"]["sluice nightly"]
    n1 = g["per_night"][1]
    assert n1["accuracy_met"] and n1["vs_scratch_wall"] == pytest.approx(0.20)  # at 20 s, plain's wall 100 s
    assert n1["vs_finetune"] == pytest.approx(20 / 60) and n1["time_met"]
    assert g["per_night"][0]["bytes_vs_new"] == pytest.approx(1.0) and g["per_night"][0]["bytes_met"]
    assert n1["bytes_vs_new"] == pytest.approx(10.0) and not g["bytes"]  # rewrote everything for 10 new
    assert g["zero_overlap"] and g["last_night"]["met"]
    assert not _result(_runs("0", 0.897))["goals"]["sluice nightly"]["last_night"]["met"]  # 0.3 points below
    assert not _result(_runs("0", 0.899, overlap=3))["goals"]["sluice nightly"]["zero_overlap"]


def test_merging_keeps_other_seeds_and_refuses_other_settings():
    old = json.loads(json.dumps(_result(_runs("0", 0.899))))
    merged = ng.merge_runs(old, _runs("1", 0.91))
    assert sorted(merged["sluice nightly"]) == ["0", "1"] and list(merged)[0] == "plain scratch"
    again = ng.merge_runs(old, _runs("0", 0.95))
    assert again["sluice nightly"]["0"]["nights"][0]["test_acc"] == 0.95  # a rerun seed replaces its own
    ng.check_same_settings(old["settings"], dict(old["settings"]), "x.json")
    with pytest.raises(SystemExit, match="other settings \\(schedule\\)"):
        ng.check_same_settings(old["settings"], {**old["settings"], "schedule": ng.QUICK}, "x.json")


def test_the_readme_block_names_every_arm_and_goal():
    runs = ng.merge_runs(_result(_runs("0", 0.899)), _runs("1", 0.90))
    text = "\n".join(block(_result(runs)))
    assert "| 1 (110) | sluice nightly | 89.95% (89.90%–90.00%) |" in text
    assert "Goals for `sluice nightly`" in text and "zero overlap every night: **met**" in text
    assert "merged" in text and "`benchmarks/results/nightly_growth.json`" in text
