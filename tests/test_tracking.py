"""Nights mirrored where ML teams look (stages/track), through the front door: ``sluice run
nightly --set tracking.uri=sqlite:///PATH`` leaves an MLflow run per night (params, per-step
metrics, grades, the report, the checkpoint and the served model) and a registered version per
candidate whose ``champion`` alias follows the file registry's promotions; a worse night leaves the
alias where it was; the alias loads with ``mlflow.pytorch.load_model`` and scores the test split at
the champion's recorded accuracy. TensorBoard is a second tracker, and a third is one entry."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT
from nights import cli_night, run_dir_of
from sluice.storage.registry import Registry

pytestmark = pytest.mark.timeout(900)

MODEL = "sluice-fashion-mnist"


def run_night(root: Path, uri: str, *sets: str) -> str:
    """``sluice run nightly --set tracking.uri=URI`` in a fresh process (``nights.cli_night``)."""
    out = subprocess.run(cli_night(root, f"tracking.uri={uri}", *sets), capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-5000:]
    return text


def client(uri: str):
    from sluice.stages.track.mlflow_tracker import import_mlflow
    mlflow = import_mlflow()
    return mlflow, mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)


@pytest.fixture(scope="module")
def nights(tmp_path_factory):
    """Night 1 (40 steps) is promoted; night 2 (1 step from scratch) is worse and is not."""
    tmp = tmp_path_factory.mktemp("tracking")
    uri = f"sqlite:///{tmp / 'store' / 'mlflow.db'}"
    (tmp / "store").mkdir()
    first = run_night(tmp / "data", uri, "train.max_steps=40")
    reg = Registry(tmp / "data" / "registry")
    champion = reg.champion()
    second = run_night(tmp / "data", uri, "train.max_steps=1", "warm.init=scratch")
    return {"uri": uri, "root": tmp / "data", "registry": reg, "champion": champion, "first": first,
            "second": second}


def test_each_night_is_a_run_with_its_config_metrics_lineage_and_files(nights):
    mlflow, c = client(nights["uri"])
    exp = c.get_experiment_by_name("sluice-nightly")
    runs = {r.data.tags["sluice.model_id"]: r for r in c.search_runs([exp.experiment_id])}
    records = nights["registry"].list()
    assert sorted(runs) == sorted(r.model_id for r in records) and len(runs) == 2
    for rec in records:
        run = runs[rec.model_id]
        assert run.info.status == "FINISHED" and run.data.tags["sluice.mirror"] == "complete"
        assert run.data.params["train.batch_size"] == "32" and run.data.params["tracking.uri"] == nights["uri"]
        assert run.data.tags["sluice.dataset.fingerprint"] == rec.dataset_fingerprint
        assert run.data.tags["prefect.flow_run_id"] == rec.run["flow_run_id"]
        assert run.data.tags["sluice.lineage.trained_on"].endswith(f"{rec.trained_on.count} keys")
        assert run.data.metrics["val_acc"] == pytest.approx(rec.metrics["val"]["acc"])
        assert run.data.metrics["test_acc"] == pytest.approx(rec.metrics["test"]["acc"])
        steps = c.get_metric_history(run.info.run_id, "loss")
        assert len(steps) >= 1 and all(np.isfinite(m.value) for m in steps)
        files = {f.path for f in c.list_artifacts(run.info.run_id)}
        assert {"checkpoint.pt", "report.md", "metrics.jsonl", "model"} <= files, files
    first = records[0]
    assert runs[first.model_id].data.tags["sluice.lineage.parent_model"].startswith("none")
    assert len(c.get_metric_history(runs[first.model_id].info.run_id, "loss")) >= 2  # 40 steps, logged every 10+


def test_every_candidate_is_a_version_and_the_alias_stays_on_the_champion(nights):
    mlflow, c = client(nights["uri"])
    versions = {v.tags["sluice.model_id"]: v.version for v in c.search_model_versions(f"name='{MODEL}'")}
    records = nights["registry"].list()
    assert sorted(versions) == sorted(r.model_id for r in records)
    champion = nights["registry"].champion()
    assert champion.model_id == nights["champion"].model_id == records[0].model_id  # night 2 lost
    assert "-> not promoted" in nights["second"] or "not promoted" in nights["second"]
    assert c.get_model_version_by_alias(MODEL, "champion").version == versions[champion.model_id]
    text = (run_dir_of(nights["second"]) / "report.md").read_text()
    assert "## Tracking" in text and "up to date" in text and "mirror behind" not in text


def test_the_alias_serves_and_scores_the_test_split_at_the_recorded_accuracy(nights):
    from sluice.stages.load import AugmentSpec, Loader, LoaderConfig, SamplerConfig
    mlflow, c = client(nights["uri"])
    os.environ["MLFLOW_TRACKING_URI"] = nights["uri"]
    try:
        model = mlflow.pytorch.load_model(f"models:/{MODEL}@champion")
    finally:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    champion = nights["registry"].champion()
    version = champion.metrics["data"]["sources"]["fashion-mnist"]
    art = nights["root"] / "datasets" / "fashion-mnist" / version[:16]  # a version folder: its fingerprint[:16]
    loader = Loader(art, LoaderConfig(split="test", batch_size=250, augment=AugmentSpec(ops=[]), drop_last=False,
                                      sampler=SamplerConfig(kind="sequential"), prefetch=0))
    hits = n = 0
    with torch.no_grad():
        for pixels, labels, _ in loader:  # no ops: the stored pixels, as floats in [0, 1]
            images = (pixels * 255).round().to(torch.uint8)  # what a user has: the images themselves
            hits += int((model(images).argmax(1) == labels).sum())
            n += len(labels)
    recorded = champion.metrics["test"]
    assert n == recorded["n"]
    assert abs(hits - recorded["acc"] * n) <= 1, (hits / n, recorded["acc"])  # one image at most (float order)


def test_tensorboard_is_a_second_tracker_and_a_third_is_one_entry(nights, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from sluice.stages.kinds import kind_of
    from sluice.stages.track import TRACKERS, Mirrored, TrackingConfig, mirror_registry
    seen: dict = {}

    @TRACKERS.register("test_notebook", replace=True)
    class Notebook:  # a third tracker: one class, one registration
        name = "test_notebook"

        def __init__(self, cfg, data_root, kind):
            self.kind = kind

        def mirror(self, nights_, champion, version, log):
            seen.update(nights=[n.model_id for n in nights_], champion=champion, kind=self.kind.name)
            return Mirrored(tracker=self.name, added=seen["nights"], where="a notebook")

        def attach(self, night, files, log):
            return None

    cfg = TrackingConfig(uri=nights["uri"], loggers=["tensorboard", "test_notebook"])
    lines: list[str] = []
    out = mirror_registry(cfg, nights["root"], nights["root"] / "registry", kind_of("image"), None, lines.append)
    ids = [r.model_id for r in nights["registry"].list()]
    assert [o["tracker"] for o in out] == ["tensorboard", "test_notebook"] and not any(o["behind"] for o in out)
    assert seen == {"nights": ids, "champion": nights["champion"].model_id, "kind": "image"}
    assert out[0]["added"] == ids
    for rec in nights["registry"].list():
        acc = EventAccumulator(str(Path(rec.run["run_dir"]) / "tensorboard"))
        acc.Reload()
        tags = acc.Tags()["scalars"]
        assert "loss" in tags and "grade/val_acc" in tags and "grade/test_acc" in tags
        assert acc.Scalars("grade/test_acc")[-1].value == pytest.approx(rec.metrics["test"]["acc"], abs=1e-6)
    again = mirror_registry(cfg, nights["root"], nights["root"] / "registry", kind_of("image"), None, lines.append)
    assert again[0]["added"] == []  # written once: the marker says so


def test_the_mirror_is_idempotent_and_tracking_none_is_off(nights):
    from sluice.stages.kinds import kind_of
    from sluice.stages.track import TrackingConfig, mirror_registry
    cfg = TrackingConfig(uri=nights["uri"])
    out = mirror_registry(cfg, nights["root"], nights["root"] / "registry", kind_of("image"), None, print)
    assert out[0]["added"] == [] and out[0]["behind"] is None and out[0]["champion"] == nights["champion"].model_id
    assert mirror_registry(TrackingConfig(uri="none"), nights["root"], nights["root"] / "registry",
                           kind_of("image"), None, print) == []
    with pytest.raises(ValueError, match="unknown tracker 'wandb'"):
        TrackingConfig(loggers=["wandb"])


def test_a_text_night_registers_the_gpt_with_its_tokenizer_in_the_default_store(tmp_path):
    """The text recipe's night with tracking left at ``auto``: the SQLite store under the data
    root holds the run, ``tokenizer.json`` beside the model, and the alias serves the GPT: the same
    next-token logits as the checkpoint on the val split's tokens (the graded split), at any row length."""
    from tokenizers import Tokenizer

    from sluice.stages.train.evaluate import model_from_checkpoint
    from sluice.storage.tokens import open_token_split
    from test_text_nightly import config, nights as text_nights, write_sources
    src, data = write_sources(tmp_path / "src"), tmp_path / "data"
    (first,) = text_nights([{"config": config(data, src, steps=20)}])
    uri = f"sqlite:///{(data / 'mlflow' / 'mlflow.db').resolve()}"
    mlflow, c = client(uri)
    rec = Registry(data / "registry").champion()
    assert rec.model_id == first["promotion"]["model_id"]
    run = c.search_runs([c.get_experiment_by_name("sluice-nightly").experiment_id])[0]
    assert run.data.tags["sluice.kind"] == "tokens" and run.data.metrics["val_value"] == pytest.approx(rec.value)
    files = {f.path for f in c.list_artifacts(run.info.run_id)}
    assert {"tokenizer.json", "model", "checkpoint.pt", "report.md"} <= files, files
    tok = Tokenizer.from_file(c.download_artifacts(run.info.run_id, "tokenizer.json", str(tmp_path)))
    assert tok.get_vocab_size() == rec.config["data"]["shard"]["vocab_size"]
    os.environ["MLFLOW_TRACKING_URI"] = uri
    try:
        served = mlflow.pytorch.load_model(f"models:/sluice-{rec.config['data']['sources'][0]['name']}@champion")
    finally:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    trained, _ = model_from_checkpoint(Registry(data / "registry").checkpoint_path(rec))
    roots = [p for p in (data / "datasets").glob("*/*") if p.is_dir() and (p / "manifest.json").is_file()]
    tokens = np.concatenate([np.asarray(open_token_split(r, "val").tokens) for r in roots])  # the graded split
    assert tokens.size >= 96
    ids = torch.as_tensor(tokens[:96].astype(np.int64))
    with torch.no_grad():
        for rows in (ids.view(3, 32), ids[:80].view(4, 20)):  # any row length up to max_len
            torch.testing.assert_close(served(rows), trained(rows).float(), rtol=1e-5, atol=1e-5)


def test_an_unreachable_server_or_a_missing_client_leaves_the_mirror_behind_not_the_night(nights, monkeypatch):
    from mlflow_server import free_port

    from sluice.errors import MissingDependency
    from sluice.stages.kinds import kind_of
    from sluice.stages.track import TrackingConfig, mirror_registry
    from sluice.stages.track import mlflow_tracker
    down = TrackingConfig(uri=f"http://127.0.0.1:{free_port()}", timeout_s=2)
    out = mirror_registry(down, nights["root"], nights["root"] / "registry", kind_of("image"), None, print)
    assert out[0]["behind"].endswith("does not answer ([Errno 111] Connection refused)") and out[0]["retry"]
    assert out[0]["added"] == []

    def not_installed():
        raise MissingDependency("tracking.loggers names mlflow, which is not installed")
    monkeypatch.setattr(mlflow_tracker, "import_mlflow", not_installed)
    out = mirror_registry(TrackingConfig(uri=nights["uri"]), nights["root"], nights["root"] / "registry",
                          kind_of("image"), None, print)
    assert "not installed" in out[0]["behind"] and out[0]["retry"] is False


def test_mlflow_telemetry_is_off_unless_the_user_turns_it_on(monkeypatch):
    """MLflow 3 reports usage to its vendor by default: Sluice's client turns that off (tests and
    benchmarks send nothing past loopback), and leaves a user's own setting alone."""
    from sluice.stages.track.mlflow_tracker import import_mlflow
    monkeypatch.delenv("MLFLOW_DISABLE_TELEMETRY", raising=False)
    import_mlflow()
    assert os.environ["MLFLOW_DISABLE_TELEMETRY"] == "true"
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "false")
    import_mlflow()
    assert os.environ["MLFLOW_DISABLE_TELEMETRY"] == "false"
