"""benchmarks.photos' bookkeeping: the time to 88% is the first evaluation at or above it, a
seed where Sluice never gets there is infinitely slow, a loop that never gets there is charged
its whole run, the goals go by the median over seeds (a night that promotes nothing misses), and
the crop sweep's section says whether the recipe's crop scale was the best it measured."""
from __future__ import annotations

import benchmarks.photos as ph
from sluice.stages.kinds.image_recipe import CROP_SCALE


def _night(wall, acc, promoted=True):
    return {"seed": 0, "wall_s": wall, "test_acc": acc, "promoted": promoted}


def _curve(cross, wall=500.0):
    return {"cross_s": cross, "wall_s": wall, "samples_per_s": 100.0}


def test_crossing_is_the_first_evaluation_at_the_target():
    evals = [{"acc": 0.5, "wall_s": 10}, {"acc": 0.881, "wall_s": 20}, {"acc": 0.87, "wall_s": 30},
             {"acc": 0.9, "wall_s": 40}]
    assert ph.crossing(evals, 0.88) == 20
    assert ph.crossing(evals, 0.95) is None


def test_a_missed_seed_counts_against_sluice_and_the_median_decides():
    nights = [_night(100, 0.89), _night(110, 0.90), _night(400, 0.85)]
    # seed 0: 0.5; seed 1: Sluice never crosses (inf); seed 2: the loop never crosses, charged 500 s
    s = ph.summarise(nights, [_curve(50), _curve(None), _curve(200)], [_curve(100), _curve(90), _curve(None)])
    assert s["ratios"] == [0.5, None, 0.4]
    assert s["goals"]["vs_plain"]["median_ratio"] == 0.5 and s["goals"]["vs_plain"]["met"]
    night = s["goals"]["night"]
    assert (night["median_wall_s"], night["median_test_acc"], night["met"]) == (110, 0.89, True)
    # two seeds of three missing: the median is a miss
    s = ph.summarise(nights, [_curve(None), _curve(None), _curve(10)], [_curve(100)] * 3)
    assert s["goals"]["vs_plain"]["median_ratio"] is None and not s["goals"]["vs_plain"]["met"]
    # fast and accurate, but one night promoted nothing: missed
    s = ph.summarise([_night(100, 0.9), _night(100, 0.9, promoted=False), _night(100, 0.9)], [_curve(1)] * 3,
                     [_curve(10)] * 3)
    assert not s["goals"]["night"]["met"]


def test_the_sweep_section_says_whether_the_recipes_crop_scale_won():
    def result(accs):
        return {"resolved": {"model": "bn_cnn", "size": 32}, "photos": 12000, "epochs": 8,
                "runs": [{"scale": [lo, 1.0], "final_acc": a, "wall_s": 100.0} for lo, a in accs]}
    lo = CROP_SCALE[0]
    won = "\n".join(ph.sweep_section(result([(0.35, 0.87), (lo, 0.92)])))
    lost = "\n".join(ph.sweep_section(result([(0.35, 0.93), (lo, 0.92)])))
    assert "is the best of these" in won and "92.00%" in won
    assert "not the best of these ((0.35, 1) scored higher)" in lost


def test_a_nights_only_run_claims_no_comparison():
    nights = [{"seed": k, "wall_s": 200.0 + k, "test_acc": 0.89, "promoted": True} for k in range(3)]
    s = ph.summarise(nights, [], [])
    assert s["goals"]["night"]["met"] and not s["goals"]["vs_plain"]["met"] and not s["goals"]["vs_plain"]["measured"]
    d = {**s, "nights": nights, "resolved": {"model": "bn_cnn", "size": 32, "amp": "none"}, "photos": 12000,
         "sluice": [], "plain": []}
    text = "\n".join(ph.results_section(d, "photos-avx2_nights.json"))
    assert "not run on this host class" in text and "fp32" in text and "**met**" in text


def test_a_nights_only_run_writes_its_file(monkeypatch, tmp_path):
    """The whole of main in --nights-only mode, its nights stood in for: it writes the file it says."""
    written = {}
    roots = iter(tmp_path / f"night{k}" for k in range(3))

    def night(folder, seed, sets=()):
        root = next(roots)
        (root / "datasets" / "photos").mkdir(parents=True)
        return {"seed": seed, "wall_s": 90.0 + seed, "test_acc": 0.89, "promoted": True, "root": str(root)}
    monkeypatch.setattr(ph, "photo_folder", lambda n: tmp_path)
    monkeypatch.setattr(ph, "night", night)
    monkeypatch.setattr(ph, "split_lists", lambda folder, art, out: {"train": 9643, "test": 1200})
    monkeypatch.setattr(ph, "what_sluice_resolved", lambda root, amp: {"size": 32, "model": "bn_cnn", "amp": amp,
                                                                      "mean": [0.3] * 3, "std": [0.27] * 3})
    monkeypatch.setattr(ph, "write_result", lambda name, d: written.setdefault(name, d) and f"{name}.json")
    result = ph.main(["--nights-only"])
    [(name, d)] = written.items()
    assert name.endswith("_nights") and d is result and d["mode"] == "nights" and not d["sluice"]
    assert d["goals"]["night"]["median_wall_s"] == 91.0 and d["goals"]["night"]["met"]
    assert "not run on this host class" in "\n".join(ph.results_section(d, f"{name}.json"))
