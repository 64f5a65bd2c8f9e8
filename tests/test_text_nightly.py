"""The nightly flow on text (``PipelineConfig.text``): three small text sources (a folder, a
.jsonl, a Parquet file) sharded with one tokenizer, a tiny GPT trained on their mixture by the same
train task, and promotion by validation loss per token, overall and per source. Each night runs in
a fresh process through Prefect's embedded API, as the deployment runs it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sluice.errors import GradedOnTrainingData
from sluice.storage.lineage import overlap
from sluice.storage.registry import Candidate, Registry

WORDS = ("river sluice gate water flows night model token loss packs rows mixture source fortune "
         "dictionary python module function class returns value error list string number").split()

NIGHTS = """
import json, sys
from pathlib import Path
import sluice.flows.nightly as fl
from sluice.flows.pipeline import PipelineConfig
from tests.test_text_nightly import write_jsonl
for night in json.loads(sys.argv[1]):
    if night.get("grow"):  # the source grows between nights
        write_jsonl(Path(night["grow"][0]), night["grow"][1])
    r = fl.nightly(PipelineConfig.model_validate(night["config"]))
    p = r["promotion"]
    print("RESULT " + json.dumps({"promotion": {k: p[k] for k in ("model_id", "promoted", "reason", "metric",
        "candidate_value", "champion_value", "champion_before", "loss_by_source", "unseen", "eval", "warm",
        "mixture")}, "served_by_source": r["train"]["summary"].get("served_by_source"),
        "dataset": r["dataset"], "run_dir": r["run_dir"], "gc": r.get("gc")}), flush=True)
"""


def _doc(rng: np.random.Generator, tag: str) -> str:
    return f"{tag}: " + " ".join(rng.choice(WORDS, int(rng.integers(12, 40)))) + ".\n"


def write_sources(root: Path, n_notes: int = 30, n_lines: int = 40, n_rows: int = 30) -> dict[str, Path]:
    """A folder of .txt notes, a .jsonl of entries and a Parquet file of quotes: random word
    salad, distinct per document, so nothing is dropped as a duplicate."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    rng = np.random.default_rng(0)
    notes = root / "notes"
    notes.mkdir(parents=True, exist_ok=True)
    for i in range(n_notes):
        (notes / f"note{i:03d}.txt").write_text(_doc(rng, f"note {i}"))
    write_jsonl(root / "entries.jsonl", n_lines)
    pq.write_table(pa.table({"id": [f"q{i}" for i in range(n_rows)],
                             "text": [_doc(rng, f"quote {i}") for i in range(n_rows)]}), root / "quotes.parquet")
    return {"notes": notes, "entries": root / "entries.jsonl", "quotes": root / "quotes.parquet"}


def write_jsonl(path: Path, n: int) -> None:
    """``n`` entries; a larger ``n`` keeps every earlier entry as it was (a grown source)."""
    rng = np.random.default_rng(1)
    path.write_text("".join(json.dumps({"id": f"e{i}", "text": _doc(rng, f"entry {i}")}) + "\n" for i in range(n)))


def config(data: Path, sources: dict[str, Path], steps: int, weights: dict | None = None, **promotion) -> dict:
    return {"recipe": "text", "data_root": str(data), "nproc": 1, "keep_versions": 3,
            "text": {"sources": [{"name": name, "source": str(path), "weight": (weights or {}).get(name, 1.0)}
                                 for name, path in sources.items()],
                     "shard": {"tokenizer": "byte", "val_fraction": 0.25, "progress": False},
                     "seq_len": 32, "eval_batch_size": 8, "prefetch": 0},
            "train": {"model_kwargs": {"n_layer": 1, "n_head": 2, "d_model": 32, "max_len": 32},
                      "batch_size": 8, "max_steps": steps, "eval_every_steps": max(steps // 2, 1),
                      "lr": 1e-2, "amp": "none", "log_every_steps": 1},
            "promotion": promotion}


def nights(plan: list[dict]) -> list[dict]:
    """Each night of ``plan`` (``config``, and ``grow``: [jsonl, n] written first) in turn, in one
    fresh process (one start of Prefect's temporary API for them all); their results."""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", NIGHTS, json.dumps(plan)], capture_output=True, text=True,
                         timeout=600, cwd=root)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    return [json.loads(x[len("RESULT "):]) for x in text.splitlines() if x.startswith("RESULT ")]


@pytest.mark.slow
def test_text_nights_promote_by_validation_loss(tmp_path):
    src, data = write_sources(tmp_path / "src"), tmp_path / "data"
    reg = Registry(data / "registry")

    first, second, third = nights([
        {"config": config(data, src, steps=3)},
        {"config": config(data, src, steps=60), "grow": [str(src["entries"]), 70]},
        {"config": config(data, src, steps=2, weights={"notes": 2.0})}])

    # Night 1: three steps of training. Nothing to beat: promoted; the val loss of each source kept.
    p1 = first["promotion"]
    assert p1["promoted"] and p1["reason"] == "no champion yet" and p1["metric"] == "val_loss"
    assert set(p1["loss_by_source"]) == {"notes", "entries", "quotes"}
    assert all(np.isfinite(v["candidate"]) and v["champion"] is None for v in p1["loss_by_source"].values())
    assert p1["candidate_value"] == pytest.approx(p1["eval"]["loss"])
    assert p1["unseen"]["samples_checked"] == first["dataset"]["counts"]["val"] > 0
    assert p1["warm"]["init"] == "scratch"
    d1 = first["dataset"]
    assert d1["modality"] == "tokens" and [s["name"] for s in d1["sources"]] == ["notes", "entries", "quotes"]
    assert len({s["tokenizer_sha256"] for s in d1["sources"]}) == 1
    rec1 = reg.get(p1["model_id"])
    assert rec1.metric == "val_loss" and rec1.value == pytest.approx(p1["candidate_value"])
    assert set(rec1.metrics["val"]["loss_by_source"]) == {"notes", "entries", "quotes"}
    assert reg.history()[0]["model_id"] == p1["model_id"]  # the first champion
    # what each source gave training: its weight, and the input tokens it served over all ranks
    served = first["served_by_source"]
    assert served["unit"] == "tokens" and served["served"] == {k: v["trained_tokens"] for k, v in
                                                              p1["loss_by_source"].items()}
    assert sum(served["served"].values()) == 3 * 8 * 32  # 3 steps of 8 full rows of 32 tokens
    assert {k: v["weight"] for k, v in p1["loss_by_source"].items()} == {"notes": 1.0, "entries": 1.0, "quotes": 1.0}
    assert p1["mixture"] == {"weights": {"notes": 1.0, "entries": 1.0, "quotes": 1.0},
                             "champion_weights": None, "changed": False}

    # Night 2: the .jsonl grew; 60 steps. The champion is re-graded on the grown val split (none of
    # which it trained on) and the candidate's lower loss wins.
    p2 = second["promotion"]
    d2 = second["dataset"]
    grown = next(s for s in d2["sources"] if s["name"] == "entries")
    assert grown["delta"] and sum(grown["delta"]["added"].values()) == 30
    assert [s["reused"] for s in d2["sources"]] == [True, False, True]
    assert p2["champion_before"] == p1["model_id"]
    assert p2["unseen"]["champion_samples_checked"] == p2["unseen"]["samples_checked"] == d2["counts"]["val"]
    assert p2["champion_value"] != pytest.approx(p1["candidate_value"])  # re-graded: another val split
    assert p2["candidate_value"] < p2["champion_value"]
    assert p2["promoted"] and p2["reason"].startswith("val_loss ") and " < champion " in p2["reason"]
    assert all(v["champion"] is not None for v in p2["loss_by_source"].values())
    assert [h["model_id"] for h in reg.history()] == [p1["model_id"], p2["model_id"]]
    assert reg.history()[1]["reason"] == p2["reason"]  # why it moved, in the registry
    # what the champion trained on holds no document of tonight's val split
    from sluice.stages.run.grading import token_key_hashes
    assert overlap(reg.trained_hashes(rec1), token_key_hashes(d2["sources"], ["val"])) == 0

    assert not p2["mixture"]["changed"]
    # Night 3: the same data, 2 steps, notes weighted twice as much: a worse loss than the
    # champion's, refused, reason recorded; the weight change recorded with the candidate.
    p3 = third["promotion"]
    assert p3["mixture"]["changed"] and p3["mixture"]["weights"]["notes"] == 2.0
    assert p3["mixture"]["champion_weights"]["notes"] == 1.0
    assert reg.get(p3["model_id"]).metrics["data"]["weights"]["notes"] == 2.0
    assert third["dataset"]["reused"] and p3["champion_before"] == p2["model_id"]
    assert p3["unseen"]["champion_samples_checked"] is None  # the same split: the champion's recorded value
    assert p3["champion_value"] == pytest.approx(p2["candidate_value"])
    assert not p3["promoted"] and p3["candidate_value"] > p3["champion_value"]
    assert p3["reason"].startswith("val_loss ") and " >= champion " in p3["reason"]
    assert reg.champion().model_id == p2["model_id"]
    assert set(third["gc"]) == {"notes", "entries", "quotes"}


def test_the_text_report_shows_val_loss_per_source():
    from sluice.flows.report import markdown_summary
    md = markdown_summary({"dataset": {"fingerprint": "f" * 64, "root": "d", "counts": {"train": 9, "val": 3},
                                       "sources": [{"name": "gcide", "fingerprint": "a" * 64, "counts": {"val": 2},
                                                    "weight": 0.5, "source": "jsonl:x"}]},
                           "train": {}, "promotion": {
                               "metric": "val_loss", "candidate_value": 2.5, "champion_value": 2.75,
                               "eval_split": "val", "promoted": True, "reason": "val_loss 2.5000 < champion",
                               "loss_by_source": {"gcide": {"candidate": 2.25, "champion": 2.5, "weight": 0.5,
                                                            "trained_tokens": 12345}},
                               "mixture": {"weights": {"gcide": 0.5}, "champion_weights": {"gcide": 0.25,
                                                                                           "old": 1.0},
                                           "changed": True}}})
    assert "candidate val_loss **2.5000** per token" in md
    assert "| gcide | 0.5 | 12,345 | 2.2500 | 2.5000 |" in md and "| **all** | | | 2.5000 | 2.7500 |" in md
    assert "mixture weights changed since the champion: gcide 0.25 → 0.5, old 1 → dropped" in md
    assert "source `gcide`" in md and "candidate accuracy" not in md


def test_a_loss_wins_by_being_lower(tmp_path):
    reg = Registry(tmp_path)
    ckpt = tmp_path / "c.pt"
    ckpt.write_bytes(b"x")

    def rec(value: float):
        return reg.register(Candidate(ckpt, dataset_fingerprint="f", eval_split="f/val/seq32", metric="val_loss",
                                      value=value))
    assert reg.promote_if_better(rec(3.0)).promoted
    worse = reg.promote_if_better(rec(3.1))
    assert not worse.promoted and worse.reason == "val_loss 3.1000 >= champion 3.0000 - margin 0.0000"
    assert not reg.promote_if_better(rec(2.95), margin=0.1).promoted  # not lower by more than the margin
    better = reg.promote_if_better(rec(2.5), margin=0.1)
    assert better.promoted and better.reason == "val_loss 2.5000 < champion 3.0000 - margin 0.1000"


def test_text_config_is_checked_before_anything_runs(tmp_path):
    from sluice.flows.pipeline import PipelineConfig
    c = PipelineConfig(recipe="text")
    assert c.text is not None and c.promotion.metric == "val_loss" and c.train.model == "gpt"
    assert PipelineConfig().text is None and PipelineConfig().promotion.metric == "val_acc"  # images unchanged
    assert PipelineConfig.model_validate({"recipe": "text", "selection": {"method": "infobatch"}}).selection.method \
        == "infobatch"  # keyed by document: it follows packed rows
    for bad, match in [({"selection": {"method": "selective_backprop"}}, "cannot select packed token rows"),
                       ({"promotion": {"report_split": "test"}}, "test_fraction is 0"),
                       ({"promotion": {"metric": "val_acc"}}, "val_loss"),
                       ({"warm": {"init": "champion"}}, "from scratch"),
                       ({"text": {"sources": [{"name": "a", "source": "x"}, {"name": "a", "source": "y"}]}},
                        "unique")]:
        with pytest.raises(ValueError, match=match):
            PipelineConfig.model_validate({"recipe": "text", **bad})
    with pytest.raises(ValueError, match="language model"):
        PipelineConfig.model_validate({"train": {"model": "gpt"}})


def test_a_text_job_with_infobatch_sizes_its_table_by_the_train_documents():
    from sluice.flows.pipeline import PipelineConfig, training_job
    data = {"fingerprint": "f" * 64, "vocab_size": 300, "counts": {"train": 12, "val": 3},
            "sources": [{"name": "a", "root": "/a", "weight": 1.0, "counts": {"train": 5, "val": 3}},
                        {"name": "b", "root": "/b", "weight": 2.0, "counts": {"train": 7, "val": 0}}]}
    c = PipelineConfig.model_validate({"recipe": "text", "selection": {"method": "infobatch"}})
    job = training_job(c, data, None)
    assert job.selection.split_size == 12 and job.selection.candidate_size == c.train.batch_size
    assert job.selection.config.method == "infobatch"
    assert training_job(PipelineConfig(recipe="text"), data, None).selection is None  # the recipe's: none


def test_a_champion_that_trained_on_a_val_document_is_never_graded(tmp_path):
    """The split follows the key; a changed rule (here: another seed) moves documents into val,
    and grading refuses by key, naming the count."""
    from sluice.stages.run.grading import grade_tokens, token_key_hashes
    from sluice.stages.run.text import TextPipelineConfig, prepare_text
    src = write_sources(tmp_path / "src", 10, 10, 10)
    text = {"sources": [{"name": n, "source": str(p)} for n, p in src.items()],
            "shard": {"tokenizer": "byte", "val_fraction": 0.3, "progress": False}}
    old = prepare_text(TextPipelineConfig.model_validate(text), tmp_path / "a")
    text["shard"]["seed"] = 1
    new = prepare_text(TextPipelineConfig.model_validate(text), tmp_path / "b")
    trained, graded = token_key_hashes(old["sources"], ["train"]), token_key_hashes(new["sources"], ["val"])
    assert overlap(trained, graded) > 0
    with pytest.raises(GradedOnTrainingData, match=r"trained on \d+ of that split"):
        grade_tokens(tmp_path / "missing.pt", "champion x", trained, "train", new, "val", graded,
                     seq_len=32, batch_size=8)


def test_warm_auto_trains_a_language_model_from_scratch_and_says_why(tmp_path):
    from sluice.errors import ConfigError
    from sluice.stages.run.warm import WarmStartConfig, plan_warm_start
    from sluice.stages.train.job import TrainJob
    job = TrainJob.model_validate({"config": {"model": "gpt", "num_classes": 257},
                                   "data": {"kind": "tokens", "loader": {"mixture": {"sources": [
                                       {"path": str(tmp_path), "weight": 1.0}]}}}})
    plan, why = plan_warm_start(WarmStartConfig(init="auto"), Registry(tmp_path / "reg"), job, None, tmp_path)
    assert plan is None and "tonight's data is tokens" in why
    with pytest.raises(ConfigError, match="image artifact"):
        plan_warm_start(WarmStartConfig(init="champion"), Registry(tmp_path / "reg"), job, None, tmp_path)
