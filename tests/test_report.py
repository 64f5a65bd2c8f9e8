"""The nightly report's content without a browser (tests/test_report_browser.py reads it in
one): the numbers it states come from the training result, and the charts have sane axes even
with a single evaluation."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from sluice.flows.nightly import run_summary
from sluice.flows.report import chart_svg, report_markdown

SVG = "{http://www.w3.org/2000/svg}"


def _ticks(svg: str, axis: str) -> list[str]:
    return [t.text for g in ET.fromstring(svg).iter(f"{SVG}g") if g.get("id", "").startswith(f"{axis}tick_")
            for t in g.iter(f"{SVG}text")]


def test_report_states_the_steps_and_accuracy_of_the_training_result(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 2.0 / s}) + "\n" for s in range(1, 201))
                       + json.dumps({"eval": {"step": 200, "acc": 0.7731}}) + "\n")
    trained = {"steps": 200, "final_acc": 0.7731, "evals": [{"step": 200, "acc": 0.7731}],
               "summary": {"world_size": 2, "comm": "powersgd", "samples_per_s": 900.0, "data_wait_frac": 0.1,
                           "bytes_per_step": 1e4, "uncompressed_bytes": 1e6, "stopped_by": "max_steps"}}
    il = {"reused": False, "train_seconds": 12.0, "holdout_size": 150, "holdout_accuracy": 0.958,
          "scored_split": "train", "scored_accuracy": 0.812}
    from sluice.stages.kinds import SourceVersion
    from sluice.stages.kinds.image import ImageKind, ImageVersion
    source = SourceVersion(name="fashion-mnist", location="fashion-mnist", root="/d/v", fingerprint="f" * 64,
                           counts={"train": 1200})
    version = ImageVersion(fingerprint="f" * 64, sources=[source], counts=source.counts, channels=1, num_classes=10)
    decision = {"metric": "val_acc", "higher_is_better": True, "candidate_value": 0.78, "eval_split": "val",
                "report_split": "test", "report": {"value": 0.7731}}
    md = report_markdown(run_summary(version, il, trained, decision, "test", ImageKind()), metrics)
    assert "**200 steps** on 2 ranks" in md  # it said "0 steps on 2 ranks"
    assert "final evaluation on `test`: accuracy **0.7731**" in md
    assert "accuracy on the train split it scores (unseen): 0.812" in md and "(the holdout): 0.958" in md
    assert ("candidate val_acc **0.7800** on `val` (decides; higher is better); on `test` (reported only): 0.7731"
            in md)
    assert "- images: 1 channels, 10 classes" in md and "source `fashion-mnist`" in md
    assert md.count("](data:image/svg+xml;base64,") == 2


def test_one_evaluation_is_a_visible_point_on_sane_axes():
    svg = chart_svg({"eval accuracy": [(200, 0.773)]}, "evaluation accuracy", "accuracy", y_limits=(0.0, 1.0))
    xs = [int(t) for t in _ticks(svg, "x")]
    ys = [float(t) for t in _ticks(svg, "y")]
    assert xs[0] == 0 and xs == sorted(set(xs)) and xs[-1] <= 210  # it read "200 200 200 201 201"
    assert 0 <= ys[0] <= 0.773 <= ys[-1] <= 1.0  # it ran 0.773–1.77
    marks = [g for g in ET.fromstring(svg).iter(f"{SVG}g") if g.get("id") == "series-eval-accuracy"]
    assert marks and list(marks[0].iter(f"{SVG}use"))  # the point is drawn (a marker), not an empty line


def test_no_evaluation_says_so():
    svg = chart_svg({"eval accuracy": []}, "evaluation accuracy", "accuracy", y_limits=(0.0, 1.0),
                    empty="no evaluation recorded")
    assert "no evaluation recorded" in svg
