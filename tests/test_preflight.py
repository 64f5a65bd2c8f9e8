"""A deterministic failure is said once, before training (#48): the pre-flight check runs one
batch of each split through the model before any rank starts and fails with a ``PreflightError``
naming the model, the shapes and the setting; the flow's tasks retry a crash or a lost rank, never
an error the same input repeats.

The nights run the real nightly flow through Prefect's embedded API, in one fresh process (as the
deployment runs them), on a 600-image Fashion-MNIST slice, with a test-only model registered in
that process (``probe_linear``: one Linear layer for images of a fixed side, which can fail its
first training forward once, as a crash or as a configuration error). The train task's retry
delay is set to 0 there so the retried night takes no longer than a plain one."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT
from sluice.errors import (CheckpointMismatch, ConfigError, CorruptSample, DataError, LaunchError, LoaderError,
                           PreflightError, RendezvousError, ScoresError, SelectionError, TrainError, WriteError)
from sluice.flows.retry import retry_can_help

NIGHTS = """
import json, sys
from pathlib import Path
from torch import nn
from sluice.errors import ConfigError
from sluice.stages.models import MODELS


@MODELS.register("probe_linear")
class ProbeLinear(nn.Module):
    # one Linear layer for side x side images; with `fail`, its first training forward (never the
    # pre-flight's, which runs in eval mode) raises once: a crash, or a configuration error
    def __init__(self, in_channels, num_classes, side=28, fail=None, marker=None):
        super().__init__()
        self.fail, self.marker = fail, marker
        self.fc = nn.Linear(in_channels * side * side, num_classes)

    def forward(self, x):
        if self.training and self.fail and not Path(self.marker).exists():
            Path(self.marker).write_text("failed once")
            raise (RuntimeError if self.fail == "crash" else ConfigError)(f"injected {self.fail} in the rank")
        return self.fc(x.flatten(1))


import sluice.flows.nightly as fl
from sluice.flows.pipeline import PipelineConfig
from prefect.client.orchestration import get_client
fl.train_task = fl.train_task.with_options(retry_delay_seconds=0)


def task_runs():  # by the task's function (a subflow's own run is keyed by the flow's: train, prepare)
    with get_client(sync_client=True) as client:
        return {str(r.id): {"task": r.task_key.rsplit("-", 1)[0], "run_count": r.run_count, "state": r.state_type.value}
                for r in client.read_task_runs()}


for name, cfg in json.loads(sys.argv[1]).items():
    before = task_runs()
    out = {"night": name}
    try:
        r = fl.nightly(PipelineConfig.model_validate(cfg))
        out.update(preflight=r["preflight"], steps=r["train"]["steps"], promoted=r["promotion"]["promoted"])
    except Exception as e:
        out.update(raised=type(e).__name__, message=str(e),
                   cause=type(e.__cause__).__name__ if e.__cause__ is not None else None)
    out["task_runs"] = [t for i, t in task_runs().items() if i not in before]
    print("RESULT " + json.dumps(out), flush=True)
"""


def _night(root: Path, **train) -> dict:
    return {"data_root": str(root), "nproc": 1, "keep_versions": None, "warm": {"init": "scratch"},
            "data": {"source": "fashion-mnist", "ingest": {"limit": 600, "seed": 4},
                     "shard": {"shard_samples": 500, "workers": 1, "progress": False}},
            "selection": {"method": "none"},
            "train": {"model": "probe_linear", "max_steps": 6, "batch_size": 32, "channels_last": False,
                      "ema_decay": None, "eval_tta": "none", **train}}


@pytest.fixture(scope="module")
def nights(tmp_path_factory) -> dict[str, dict]:
    """Three nights in one process: a model built for 32×32 images on 28×28 ones; a rank that
    crashes once; a rank that raises a configuration error."""
    tmp = tmp_path_factory.mktemp("nights")
    cfgs = {"misfit": _night(tmp / "misfit", model_kwargs={"side": 32}),
            "crash": _night(tmp / "crash", model_kwargs={"fail": "crash", "marker": str(tmp / "crashed")}),
            "config": _night(tmp / "config", model_kwargs={"fail": "config", "marker": str(tmp / "refused")})}
    env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect")}  # its own embedded API: only these runs
    out = subprocess.run([sys.executable, "-c", NIGHTS, json.dumps(cfgs)], capture_output=True, text=True,
                         timeout=600, cwd=ROOT, env=env)
    text = out.stdout + out.stderr
    found = {r["night"]: {**r, "root": tmp / r["night"], "log": text}
             for r in (json.loads(x[len("RESULT "):]) for x in text.splitlines() if x.startswith("RESULT "))}
    assert set(found) == set(cfgs), text[-4000:]
    return found


def _attempts(night: dict, task: str) -> list[tuple[int, str]]:
    return [(t["run_count"], t["state"]) for t in night["task_runs"] if t["task"] == task]


@pytest.mark.slow
def test_a_model_that_cannot_take_the_data_fails_in_the_preflight_once_and_no_rank_starts(nights):
    n = nights["misfit"]
    assert n.get("raised") == "PreflightError", n
    msg = n["message"]
    assert "train.model='probe_linear'" in msg and "images [32, 1, 28, 28]" in msg, msg
    assert "mat1 and mat2 shapes cannot be multiplied" in msg and n["cause"] == "RuntimeError", msg
    assert "data.shard.image_size" in msg and "Change train.model" in msg, msg
    assert _attempts(n, "preflight_task") == [(1, "FAILED")], n["task_runs"]
    assert _attempts(n, "train_task") == [(1, "FAILED")], n["task_runs"]  # one attempt: no retry
    runs = n["root"] / "runs"
    assert not list(runs.rglob("job.json")) and not list(runs.rglob("pids")), list(runs.rglob("*"))


@pytest.mark.slow
def test_a_crash_that_a_second_try_gets_past_is_still_retried(nights):
    n = nights["crash"]
    assert "raised" not in n, n.get("message")
    assert _attempts(n, "train_task") == [(2, "COMPLETED")], n["task_runs"]
    assert n["steps"] == 6 and n["preflight"]["model"] == "probe_linear"
    assert "training crashed in-process: RuntimeError: injected crash in the rank" in n["log"]
    # the progress watcher logs from its own thread through the task's logger: where training
    # ended, and no traceback of a thread that found no run context
    assert "training: step 6 " in n["log"] and "Exception in thread" not in n["log"], n["log"][-3000:]


@pytest.mark.slow
def test_a_configuration_error_raised_in_a_rank_is_not_retried(nights):
    n = nights["config"]
    assert n.get("raised") == "TrainError" and "ConfigError (rank 0): injected config in the rank" in n["message"], n
    assert _attempts(n, "train_task") == [(1, "FAILED")], n["task_runs"]
    assert "not retrying train: TrainError" in n["log"]


# ---------------------------------------------------------------- which failures are retried

@pytest.mark.parametrize("error,again", [
    (RuntimeError("a rank's segfault, a flaky device"), True), (OSError("connection reset"), True),
    (LaunchError("torchrun exited with code 1"), True), (RendezvousError("a node was lost"), True),
    (WriteError(28, "disk full"), True),
    (ConfigError("train.lr"), False), (PreflightError("misfit"), False), (DataError("no source"), False),
    (SelectionError("bad sizes"), False), (LoaderError("no memory"), False), (ScoresError("foreign"), False),
    (CheckpointMismatch("other model"), False), (CorruptSample("rot"), False),
    (TrainError("ConfigError (rank 1): a rank's own error, from its error.json"), False),
])
def test_only_what_a_second_try_can_get_past_is_retried(error, again):
    assert retry_can_help(error) is again


def test_a_pydantic_validation_error_is_not_retried():
    from pydantic import BaseModel, ValidationError

    class Section(BaseModel):
        n: int
    with pytest.raises(ValidationError) as e:
        Section(n="many")
    assert retry_can_help(e.value) is False


# ---------------------------------------------------------------- the check on its own

def _image_job(root: str, **train):
    from sluice.flows.pipeline import PipelineConfig, training_job
    c = PipelineConfig.model_validate({"data": {"source": "fashion-mnist"}, "selection": {"method": "none"},
                                       "train": {"batch_size": 32, **train}})
    return c, training_job(c, c.kind().version_of([root]), None)


def test_the_preflight_of_a_passing_image_night_says_what_it_checked(fmnist_artifact):
    from sluice.flows.report import markdown_summary
    from sluice.stages.run.preflight import preflight
    c, job = _image_job(fmnist_artifact.root)
    state = torch.random.get_rng_state()
    report = preflight(job, c.kind().input_settings)
    assert torch.equal(torch.random.get_rng_state(), state)  # the process's draws are left as they were
    assert report.model == job.config.model == "bn_cnn" and report.task == "classify"  # auto, resolved
    assert report.batches["train"]["inputs"] == {"images": [32, 1, 28, 28]}
    assert report.batches["train"]["logits"] == [2, 10] and report.batches["eval"]["logits"] == [2, 10]
    line = report.line()
    assert "train images [32, 1, 28, 28] -> logits [2, 10]" in line and "finite outputs and losses" in line, line
    assert report.seconds > 0 and f"{1000 * report.seconds:.0f} ms" in line
    assert f"- pre-flight: {line}" in markdown_summary({"preflight": report.to_dict()})


def test_the_preflight_of_a_passing_token_night_says_what_it_checked(tmp_path):
    from sluice.flows.pipeline import PipelineConfig, training_job
    from sluice.stages.data.text import TextShardConfig, shard_text
    from sluice.stages.run.preflight import preflight
    src = tmp_path / "notes"
    src.mkdir()
    rng = np.random.default_rng(0)
    for i in range(40):
        (src / f"doc{i:03d}.txt").write_text(" ".join(rng.choice(["ab", "cd", "ef", "gh"], int(rng.integers(3, 12)))))
    root = shard_text(TextShardConfig(tokenizer="byte", val_fraction=0.2, progress=False), src, tmp_path / "art").root
    c = PipelineConfig.model_validate({"recipe": "text", "data": {"sources": [{"name": "notes", "source": str(src)}],
                                                                 "seq_len": 32, "eval_batch_size": 4, "prefetch": 0},
                                       "train": {"model_kwargs": {"n_layer": 1, "n_head": 2, "d_model": 32,
                                                                  "max_len": 32}, "batch_size": 4}})
    job = training_job(c, c.kind().version_of([root], names=["notes"]), None)
    report = preflight(job, c.kind().input_settings)
    vocab = job.config.num_classes
    assert report.model == "gpt" and report.task == "language_model"
    assert report.batches["train"]["inputs"]["input_ids"] == [4, 32]
    assert report.batches["train"]["logits"] == [2, 32, vocab] and report.batches["eval"]["logits"] == [2, 32, vocab]
    assert f"logits of {vocab} per target" in report.line()


def test_a_label_the_model_has_no_output_for_fails_naming_the_targets(tmp_path):
    """Labels up to 11 where the train config says 10 classes (a relabelled source): the loss's
    own error, said before any rank starts, whichever rows of the batch hold them."""
    from sluice.stages.load.arrays import fashion_mnist
    from sluice.stages.run.launch import make_job
    from sluice.stages.run.preflight import preflight
    from sluice.stages.train.config import TrainConfig
    x, y = fashion_mnist("train")
    np.savez(tmp_path / "train.npz", images=x[:64], labels=np.where(np.arange(64) % 2, 11, 3).astype(y.dtype))
    job = make_job(TrainConfig(model="small_cnn", num_classes=10, batch_size=32), {"kind": "arrays",
                                                                              "path": str(tmp_path / "train.npz")})
    with pytest.raises(PreflightError, match=r"targets are in \[3, 11\]: IndexError: Target 11 is out of bounds.*10 classes") as e:
        preflight(job)
    assert isinstance(e.value, ConfigError) and e.value.__cause__ is not None


def test_logits_of_the_wrong_size_fail_naming_both(tmp_path, train_test_npz):
    """A model whose head ignores num_classes: its logits do not match the task's."""
    from torch import nn
    from sluice.stages.models import MODELS
    from sluice.stages.run.launch import make_job
    from sluice.stages.run.preflight import preflight
    from sluice.stages.train.config import TrainConfig

    @MODELS.register("probe_seven_outputs", replace=True)
    def seven(in_channels: int, num_classes: int) -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * 28 * 28, 7))
    job = make_job(TrainConfig(model="probe_seven_outputs", batch_size=16), *train_test_npz)
    with pytest.raises(PreflightError, match=r"gives logits \[2, 7\].*needs \[2, 10\]"):
        preflight(job)


def test_the_preflight_reads_photos_through_the_tar_shards_not_ffcvs_compiled_pipeline(tmp_path, fmnist_artifact):
    """FFCV compiles its pipeline on first use (seconds for one batch): the check reads the same
    batch from the tar shards where the loader would use the .beton, and leaves every other
    choice alone (a configured backend; the memory backend of fixed-size images; an artifact
    without tar shards)."""
    from sluice.stages.data.config import IngestConfig, ShardConfig
    from sluice.stages.data.fashion_photos import make_fashion_photos
    from sluice.stages.data.shard import shard_dataset
    from sluice.stages.load.specs import ImagesData
    folder = make_fashion_photos(tmp_path / "photos", n=100)
    ingest = IngestConfig(source=str(folder), kind="folder", val_fraction=0, test_fraction=0, holdout_fraction=0)
    photos = shard_dataset(ingest, tmp_path / "a", ShardConfig(progress=False, workers=1)).root
    ffcv_only = shard_dataset(ingest, tmp_path / "b", ShardConfig(progress=False, workers=1, formats=["ffcv"])).root

    def backend(root, **loader):
        return ImagesData(root=root, loader=loader).for_preflight().loader.backend
    assert backend(photos) == "webdataset" and backend(photos, backend="ffcv") == "webdataset"
    assert backend(photos, backend="dali") == "dali"
    assert backend(fmnist_artifact.root) == "auto"   # fixed size: the memory backend, as the ranks read it
    assert backend(ffcv_only) == "auto"              # no tar shards to read instead
    # and the batch is the one the ranks get, shape for shape
    spec = ImagesData(root=photos, loader={"batch_size": 8, "augment": {"ops": [{"op": "center_crop", "size": 24}]}})
    cheap, ranks = (s.build(rank=0, world_size=1, device=torch.device("cpu")) for s in (spec.for_preflight(), spec))
    try:
        (a, ya, ia), (b, yb, ib) = next(iter(cheap)), next(iter(ranks))
        assert a.shape == b.shape == (8, 3, 24, 24) and torch.equal(ia, ib) and torch.equal(ya, yb)
    finally:
        cheap.close(), ranks.close()
