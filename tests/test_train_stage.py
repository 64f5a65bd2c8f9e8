"""The training stage's progress watch: it logs what rank 0 appended since its last look, and a
line still being written waits for its end."""
from __future__ import annotations

import json
import threading

from sluice.stages.run.training import watch_progress


def _step(n: int) -> str:
    return json.dumps({"step": n, "epoch": 0, "loss": 1.0 / n, "samples_per_s": 100.0, "data_wait_frac": 0.1})


def test_progress_logs_each_appended_step_once_and_waits_for_whole_lines(tmp_path):
    metrics, said, ticked = tmp_path / "metrics.jsonl", [], threading.Event()

    def log(line: str) -> None:
        said.append(line)
        ticked.set()

    metrics.write_text(_step(1) + "\n" + _step(2)[:10])  # step 2 is half written
    with watch_progress(metrics, log, every_s=0.01):
        assert ticked.wait(30)
        ticked.clear()
        with metrics.open("a") as f:
            f.write(_step(2)[10:] + "\n" + json.dumps({"eval": {"acc": 0.5}}) + "\n")
        assert ticked.wait(30)
    assert said[0].startswith("training: step 1 ")
    assert said[1].startswith("training: step 2 ") and said[1].endswith("eval acc 0.5000")
    assert len(said) == 2  # nothing logged twice
