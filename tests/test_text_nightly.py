"""The nightly flow on text: three small text sources (a folder, a .jsonl, a Parquet file) sharded
with one BPE tokenizer learnt from all of them, a tiny GPT trained on their mixture by the same
train task, promotion by bits per byte overall and per source, a grown corpus warm-started from
the champion, and a changed tokenizer graded fairly instead of refused. Each night runs in a fresh
process through Prefect's embedded API, as the deployment runs it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sluice.errors import GradedOnTrainingData
from sluice.stages.kinds.tokens import TokenKind, TokenVersion
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
        "candidate_value", "champion_value", "champion_before", "by_source", "unseen", "eval", "warm",
        "mixture", "higher_is_better")}, "served_by_source": r["train"]["summary"].get("served_by_source"),
        "steps": r["train"]["steps"], "dataset": r["dataset"].model_dump(mode="json"), "run_dir": r["run_dir"],
        "gc": r.get("gc")}), flush=True)
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


def config(data: Path, sources: dict[str, Path], steps: int, weights: dict | None = None, vocab: int = 300,
           **promotion) -> dict:
    return {"recipe": "text", "data_root": str(data), "nproc": 1, "keep_versions": 3,
            "data": {"sources": [{"name": name, "source": str(path), "weight": (weights or {}).get(name, 1.0)}
                                 for name, path in sources.items()],
                     "shard": {"tokenizer": "bpe", "vocab_size": vocab, "val_fraction": 0.25, "progress": False},
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
def test_text_nights_promote_by_bits_per_byte_and_warm_start_on_a_grown_corpus(tmp_path):
    src, data = write_sources(tmp_path / "src"), tmp_path / "data"
    reg = Registry(data / "registry")

    first, second, third, fourth = nights([
        {"config": config(data, src, steps=3)},
        {"config": config(data, src, steps=60), "grow": [str(src["entries"]), 70]},
        {"config": config(data, src, steps=2, weights={"notes": 2.0})},
        {"config": config(data, src, steps=60, vocab=280)}])

    # Night 1: three steps of training. Nothing to beat: promoted; bits per byte of each source kept.
    p1 = first["promotion"]
    assert p1["promoted"] and p1["reason"] == "no champion yet" and p1["metric"] == "val_bpb"
    assert p1["higher_is_better"] is False
    assert set(p1["by_source"]) == {"notes", "entries", "quotes"}
    assert all(np.isfinite(v["candidate"]) and v["champion"] is None for v in p1["by_source"].values())
    assert p1["candidate_value"] == pytest.approx(p1["eval"]["value"])
    assert 0 < p1["candidate_value"] < 8  # bits per byte: at most 8 for a model no worse than uniform bytes
    assert p1["unseen"]["samples_checked"] == first["dataset"]["counts"]["val"] > 0
    assert p1["warm"]["init"] == "scratch" and "no champion" in p1["warm"]["why"]
    d1 = first["dataset"]
    assert d1["kind"] == "tokens" and [s["name"] for s in d1["sources"]] == ["notes", "entries", "quotes"]
    learnt = json.loads((Path(d1["tokenizer_file"]).parent / "learnt_from.json").read_text())
    assert [s["name"] for s in learnt["sources"]] == ["notes", "entries", "quotes"]  # one BPE from every source
    rec1 = reg.get(p1["model_id"])
    assert rec1.metric == "val_bpb" and rec1.value == pytest.approx(p1["candidate_value"])
    assert rec1.higher_is_better is False and set(rec1.files) == {"tokenizer"}  # the tokenizer kept with the model
    assert set(rec1.metrics["val"]["by_source"]) == {"notes", "entries", "quotes"}
    assert reg.history()[0]["model_id"] == p1["model_id"]  # the first champion
    # what each source gave training: its weight, and the input tokens it served over all ranks
    served = first["served_by_source"]
    assert served["unit"] == "tokens" and served["served"] == {k: v["trained"] for k, v in p1["by_source"].items()}
    assert sum(served["served"].values()) == 3 * 8 * 32  # 3 steps of 8 full rows of 32 tokens
    assert {k: v["weight"] for k, v in p1["by_source"].items()} == {"notes": 1.0, "entries": 1.0, "quotes": 1.0}
    assert p1["mixture"] == {"weights": {"notes": 1.0, "entries": 1.0, "quotes": 1.0},
                             "champion_weights": None, "changed": False}

    # Night 2: the .jsonl grew; the tokenizer is kept, so the run starts from the champion's weights
    # on the new documents plus a replay of the old. The champion is re-graded on the grown val
    # split (none of which it trained on) and the candidate wins.
    p2 = second["promotion"]
    d2 = second["dataset"]
    grown = next(s for s in d2["sources"] if s["name"] == "entries")
    assert grown["delta"] and sum(grown["delta"]["added"].values()) == 30
    assert [s["reused"] for s in d2["sources"]] == [True, False, True]
    assert d2["tokenizer_sha256"] == d1["tokenizer_sha256"]
    w = p2["warm"]
    assert w["init"] == "champion" and w["parent_model"] == p1["model_id"], w
    new_docs = d2["counts"]["train"] - d1["counts"]["train"]
    assert w["new"] == new_docs > 0 and w["replayed"] == d1["counts"]["train"]  # every old document replayed
    assert set(w["subsets"]) == {"notes", "entries", "quotes"}
    trained_on = sum(len(np.load(f)) for f in w["subsets"].values())
    assert trained_on == d2["counts"]["train"]
    assert p2["champion_before"] == p1["model_id"]
    assert p2["unseen"]["champion_samples_checked"] == p2["unseen"]["samples_checked"] == d2["counts"]["val"]
    assert p2["candidate_value"] < p2["champion_value"]
    assert p2["promoted"] and p2["reason"].startswith("val_bpb ") and " < champion " in p2["reason"]
    assert all(v["champion"] is not None for v in p2["by_source"].values())
    assert [h["model_id"] for h in reg.history()] == [p1["model_id"], p2["model_id"]]
    # what the champion trained on holds no document of tonight's val split; its heir inherits it
    version2 = TokenVersion.model_validate(d2)
    val2 = TokenKind().key_hashes(version2, ["val"])
    assert overlap(reg.trained_hashes(rec1), val2) == 0
    rec2 = reg.get(p2["model_id"])
    assert rec2.warm_start["parent_model"] == p1["model_id"]
    assert overlap(reg.trained_hashes(rec2), reg.trained_hashes(rec1)) == reg.trained_hashes(rec1).size

    assert not p2["mixture"]["changed"]
    # Night 3: the same data, 2 steps, notes weighted twice as much: no new document, so from
    # scratch; a worse bits per byte than the champion's, refused, reason recorded; the weight
    # change recorded with the candidate.
    p3 = third["promotion"]
    assert p3["warm"]["init"] == "scratch" and "nothing" in p3["warm"]["why"]
    assert p3["mixture"]["changed"] and p3["mixture"]["weights"]["notes"] == 2.0
    assert p3["mixture"]["champion_weights"]["notes"] == 1.0
    assert reg.get(p3["model_id"]).metrics["data"]["weights"]["notes"] == 2.0
    assert third["dataset"]["reused"] and p3["champion_before"] == p2["model_id"]
    assert p3["unseen"]["champion_samples_checked"] is None  # the same split: the champion's recorded value
    assert p3["champion_value"] == pytest.approx(p2["candidate_value"])
    assert not p3["promoted"] and p3["candidate_value"] > p3["champion_value"]
    assert p3["reason"].startswith("val_bpb ") and " >= champion " in p3["reason"]
    assert reg.champion().model_id == p2["model_id"]
    assert set(third["gc"]) == {"notes", "entries", "quotes"}

    # Night 4: another vocabulary, so another tokenizer and new versions of every source. The
    # champion's weights read other ids: no warm start, and it is graded on tonight's documents
    # re-tokenised with its own tokenizer (kept in the registry): promotion compares bits per byte.
    p4, d4 = fourth["promotion"], fourth["dataset"]
    assert d4["tokenizer_sha256"] != d2["tokenizer_sha256"] and d4["vocab_size"] == 280
    assert p4["warm"]["init"] == "scratch" and "tokenizer" in p4["warm"]["why"]
    assert p4["champion_before"] == p2["model_id"] and p4["unseen"]["champion_samples_checked"] > 0
    # the same val documents, re-tokenised with the champion's own tokenizer, are the very tokens it
    # was graded on when it won: the same bits per byte, whatever tonight's tokenizer
    assert p4["champion_value"] == pytest.approx(p2["candidate_value"], rel=1e-9)
    assert p4["reason"].startswith("val_bpb ") and np.isfinite(p4["candidate_value"])


def test_the_report_shows_each_sources_metric_and_the_mixture():
    from sluice.flows.report import markdown_summary
    md = markdown_summary({"dataset": {"fingerprint": "f" * 64, "counts": {"train": 9, "val": 3},
                                       "sources": [{"name": "gcide", "fingerprint": "a" * 64, "counts": {"val": 2},
                                                    "weight": 0.5, "location": "x.jsonl", "root": "r"}],
                                       "describe": ["- tokenizer `abc` (300 ids), shared by every source"]},
                           "kind": {"name": "tokens", "metric": "bpb", "higher_is_better": False,
                                    "samples": "documents", "curve": ["loss", "loss per token", [0, 9]]},
                           "train": {}, "promotion": {
                               "metric": "val_bpb", "higher_is_better": False, "candidate_value": 2.5,
                               "champion_value": 2.75, "eval_split": "val", "promoted": True,
                               "reason": "val_bpb 2.5000 < champion",
                               "by_source": {"gcide": {"candidate": 2.25, "champion": 2.5, "weight": 0.5,
                                                       "trained": 12345}},
                               "mixture": {"weights": {"gcide": 0.5}, "champion_weights": {"gcide": 0.25,
                                                                                           "old": 1.0},
                                           "changed": True}}})
    assert "candidate val_bpb **2.5000** on `val` (decides; lower is better)" in md
    assert "| gcide | 0.5 | 12,345 | 2.2500 | 2.5000 |" in md and "| **all** | | | 2.5000 | 2.7500 |" in md
    assert "mixture weights changed since the champion: gcide 0.25 → 0.5, old 1 → dropped" in md
    assert "source `gcide`" in md and "quarantined documents" in md and "tokenizer `abc`" in md


def test_a_metric_wins_the_way_its_record_says(tmp_path):
    reg = Registry(tmp_path)
    ckpt = tmp_path / "c.pt"
    ckpt.write_bytes(b"x")

    def rec(value: float, metric: str = "val_bpb", higher: bool | None = False):
        return reg.register(Candidate(ckpt, dataset_fingerprint="f", eval_split="f/val/seq32", metric=metric,
                                      value=value, higher_is_better=higher))
    assert reg.promote_if_better(rec(3.0)).promoted
    worse = reg.promote_if_better(rec(3.1))
    assert not worse.promoted and worse.reason == "val_bpb 3.1000 >= champion 3.0000 - margin 0.0000"
    assert not reg.promote_if_better(rec(2.95), margin=0.1).promoted  # not lower by more than the margin
    better = reg.promote_if_better(rec(2.5), margin=0.1)
    assert better.promoted and better.reason == "val_bpb 2.5000 < champion 3.0000 - margin 0.1000"
    # records from before the direction was kept: a loss is lower-is-better, anything else higher
    for metric, values, promoted in (("val_loss", (2.4, 2.3), True), ("val_acc", (0.5, 0.4), False)):
        reg = Registry(tmp_path / metric)
        assert reg.promote_if_better(rec(values[0], metric, None)).promoted
        assert reg.promote_if_better(rec(values[1], metric, None)).promoted is promoted


def test_text_config_is_checked_before_anything_runs(tmp_path):
    from sluice.flows.pipeline import PipelineConfig
    c = PipelineConfig(recipe="text")
    assert c.data.kind == "tokens" and c.promotion.metric == "val_bpb" and c.train.model == "gpt"
    assert PipelineConfig().data.kind == "image" and PipelineConfig().promotion.metric == "val_acc"
    assert PipelineConfig.model_validate({"recipe": "text", "selection": {"method": "infobatch"}}).selection.method \
        == "infobatch"  # keyed by document: it follows packed rows
    for bad, match in [({"selection": {"method": "selective_backprop"}}, "cannot select packed token rows"),
                       ({"promotion": {"report_split": "test"}}, "test_fraction is 0"),
                       ({"promotion": {"metric": "val_acc"}}, "val_bpb"),
                       ({"warm": {"init": "champion", "replay": "champion_loss"}}, "replay uniform"),
                       ({"data": {"sources": [{"name": "a", "source": "x"}, {"name": "a", "source": "y"}]}}, "unique"),
                       ({"train": {"model_kwargs": {"max_len": 16}}}, "max_len=16 is shorter")]:
        with pytest.raises(ValueError, match=match):
            PipelineConfig.model_validate({"recipe": "text", **bad})
    with pytest.raises(ValueError, match="language model"):
        PipelineConfig.model_validate({"train": {"model": "gpt"}})


def _token_version(counts_a: dict, counts_b: dict) -> TokenVersion:
    from sluice.stages.kinds import SourceVersion
    a = SourceVersion(name="a", location="x", root="/a", fingerprint="a" * 64, weight=1.0, counts=counts_a)
    b = SourceVersion(name="b", location="y", root="/b", fingerprint="b" * 64, weight=2.0, counts=counts_b)
    counts = {k: counts_a.get(k, 0) + counts_b.get(k, 0) for k in {*counts_a, *counts_b}}
    return TokenVersion(fingerprint="f" * 64, sources=[a, b], counts=counts, vocab_size=300, eot=0,
                        tokenizer_sha256="t" * 64, tokenizer_file="/t.json", tokens=counts)


def test_a_text_job_with_infobatch_sizes_its_table_by_the_train_documents():
    from sluice.flows.pipeline import PipelineConfig, training_job
    version = _token_version({"train": 5, "val": 3}, {"train": 7, "val": 0})
    c = PipelineConfig.model_validate({"recipe": "text", "selection": {"method": "infobatch"}})
    job = training_job(c, version, None)
    assert job.selection.split_size == 12 and job.selection.candidate_size == c.train.batch_size
    assert job.selection.config.method == "infobatch" and job.data.loader.doc_keys  # rows keyed by document
    assert [s.name for s in job.eval_data.loader.mixture.sources] == ["a"]  # b holds no val document
    plain = training_job(PipelineConfig(recipe="text"), version, None)
    assert plain.selection is None and not plain.data.loader.doc_keys  # the recipe's: none


def test_a_champion_that_trained_on_a_val_document_is_never_graded(tmp_path):
    """The split follows the key; a changed rule (here: another seed) moves documents into val,
    and grading refuses by key, naming the count."""
    from sluice.stages.kinds.tokens import TokenData
    from sluice.stages.run.grading import grade
    kind = TokenKind()
    src = write_sources(tmp_path / "src", 10, 10, 10)
    data = {"kind": "tokens", "sources": [{"name": n, "source": str(p)} for n, p in src.items()],
            "shard": {"tokenizer": "byte", "val_fraction": 0.3, "progress": False}}
    old = kind.prepare(TokenData.model_validate(data), tmp_path / "a" / "datasets", log=lambda s: None)
    data["shard"]["seed"] = 1
    again = TokenData.model_validate(data)
    new = kind.prepare(again, tmp_path / "b" / "datasets", log=lambda s: None)
    trained, graded = kind.key_hashes(old, ["train"]), kind.key_hashes(new, ["val"])
    assert overlap(trained, graded) > 0
    with pytest.raises(GradedOnTrainingData, match=r"trained on \d+ of that split"):
        grade(kind, tmp_path / "missing.pt", "champion x", trained, "train", new, "val", graded, data=again,
              files={}, facts={})
