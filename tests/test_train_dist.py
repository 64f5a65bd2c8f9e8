"""The train stage under real ``torchrun``: 2 processes over gloo on 127.0.0.1 (no mocks)."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from sluice.errors import RendezvousError, TrainError
from sluice.stages.train import TrainResult
from sluice.stages.run.launch import Rendezvous, free_port, launch, make_job
from sluice.storage.checkpoint import load_checkpoint

pytestmark = pytest.mark.slow  # torchrun launches: seconds to a minute each
QUIET = {"on_line": lambda line: None}  # no time limits here: a hang is pytest-timeout's to catch


@pytest.fixture(scope="module")
def data(train_test_npz) -> tuple[dict, dict]:
    return train_test_npz


def cfg(**kw) -> dict:
    base = {"model_kwargs": {"width": 8}, "max_steps": 24, "batch_size": 32, "lr": 0.05,
            "progress": False, "torch_threads": 1}
    base.update(kw)
    return base


@pytest.mark.parametrize("mode", ["none", "fp16", "bf16", "powersgd"])
def test_two_ranks_every_comm_mode_trains_and_keeps_ranks_identical(tmp_path, data, mode):
    # tiny buckets: several DDP buckets per step, where torch's own powerSGD_hook breaks on gloo
    comm = {"mode": mode, "bucket_cap_mb": 0.005, "params": {"start_iter": 4, "rank": 1} if mode == "powersgd" else {}}
    r = launch(make_job(cfg(comm=comm), *data), nproc=2, out_dir=tmp_path, **QUIET)
    assert isinstance(r, TrainResult) and r.steps == 24 and r.final_acc is not None
    digests = r.summary["param_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]  # identical weights on both ranks
    assert r.metrics[-1]["loss"] < r.metrics[0]["loss"]
    full = r.summary["uncompressed_bytes"]
    last = r.metrics[-1]["bytes_comm"]
    expect = {"none": full, "fp16": full // 2, "bf16": full // 2}
    if mode in expect:
        assert last == expect[mode]
    else:
        assert 0 < last < full / 4  # rank-1 factors of a tiny CNN
        assert r.metrics[0]["bytes_comm"] == full  # plain all-reduce before start_iter
    assert (tmp_path / "metrics.jsonl").exists() and (tmp_path / "checkpoints" / "last.pt").exists()


def test_resume_after_stop_matches_uninterrupted_run_powersgd(tmp_path, data):
    c = cfg(comm={"mode": "powersgd", "params": {"start_iter": 3, "rank": 2}},
            checkpoint_every_steps=5)
    full = launch(make_job(c, *data), nproc=2, out_dir=tmp_path / "full", **QUIET)
    half = launch(make_job({**c, "halt_at_step": 13}, *data), nproc=2, out_dir=tmp_path / "b", **QUIET)
    assert half.halted and half.steps == 13
    state = load_checkpoint(tmp_path / "b" / "checkpoints" / "last.pt")
    assert state["comm"]["errors"] and state["comm"]["qs"]  # hook state saved as plain tensors
    rest = launch(make_job(c, *data), nproc=2, out_dir=tmp_path / "b", **QUIET)
    assert rest.resumed_from == 13 and rest.steps == 24
    a = load_checkpoint(full.checkpoint)["model"]
    b = load_checkpoint(rest.checkpoint)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert full.summary["param_digests"] == rest.summary["param_digests"]
    # an incompatible config on the same checkpoint directory is refused with a message
    with pytest.raises(TrainError, match="incompatible"):
        launch(make_job({**c, "lr": 0.2}, *data), nproc=2, out_dir=tmp_path / "b", **QUIET)


def test_kill_minus_9_one_rank_restarts_from_checkpoint_and_finishes(tmp_path, data):
    train_spec = {**data[0], "delay_s": 0.03}  # slow storage, so the kill lands mid-run
    c = cfg(max_steps=80, checkpoint_every_steps=5)
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = launch(make_job(c, train_spec, data[1]), nproc=2, out_dir=tmp_path,
                                   max_restarts=2, **QUIET)
        except Exception as e:  # surfaced below
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    ckpt, pid_file = tmp_path / "checkpoints" / "last.pt", tmp_path / "pids" / "rank1.pid"
    while not (ckpt.exists() and pid_file.exists()) and t.is_alive():
        time.sleep(0.1)
    assert ckpt.exists() and t.is_alive(), box  # a checkpoint, and the run still going
    killed_at = load_checkpoint(ckpt)["step"]
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    t.join()
    assert "error" not in box, box.get("error")
    r = box["result"]
    assert r.steps == 80 and r.resumed_from is not None and r.resumed_from >= killed_at
    assert r.summary["param_digests"][0] == r.summary["param_digests"][1]


def test_unreachable_rendezvous_is_refused_before_launching_naming_the_address(tmp_path, data):
    port = free_port()  # nothing listens here
    with pytest.raises(RendezvousError, match=f"127.0.0.1:{port}"):
        launch(make_job(cfg(), *data), nproc=1, out_dir=tmp_path / "run",
               rendezvous=Rendezvous(f"127.0.0.1:{port}", nnodes=2, node_rank=1, timeout_s=2), **QUIET)
    assert not (tmp_path / "run").exists()  # refused before torchrun (and its own waits) started


def test_rendezvous_host_gives_up_when_a_node_never_joins(tmp_path, data):
    endpoint = f"127.0.0.1:{free_port()}"
    with pytest.raises(RendezvousError, match=endpoint):
        launch(make_job(cfg(max_steps=2), *data), nproc=1, out_dir=tmp_path,
               rendezvous=Rendezvous(endpoint, nnodes=2, node_rank=0, timeout_s=3), **QUIET)


def test_launch_timeout_stops_the_job(tmp_path, data):
    slow = {**data[0], "delay_s": 0.2}
    with pytest.raises(Exception, match="timeout_s"):  # 500 steps of slow storage: far over 8 s
        launch(make_job(cfg(max_steps=500), slow), nproc=2, out_dir=tmp_path, on_line=lambda s: None,
               timeout_s=8)


def test_nan_under_torchrun_fails_clearly_without_restart_loop(tmp_path, data, installed_plugins):
    """A selection method from a package outside Sluice, reached by its entry-point name in the
    workers; its NaN weights stop the run once, clearly, with no restart loop."""
    sel = {"config": {"method": "fixed_count", "n_select": 16, "params": {"nan_after": 7}},
           "candidate_size": 32, "split_size": 2048}
    with pytest.raises(TrainError, match="NonFiniteLoss.*step 8.*last good checkpoint"):
        launch(make_job(cfg(checkpoint_every_steps=3), *data, selection=sel), nproc=2,
               out_dir=tmp_path, max_restarts=1, **QUIET)
    assert load_checkpoint(tmp_path / "checkpoints" / "last.pt")["step"] == 6
    log = (tmp_path / "torchrun.log").read_text()
    assert log.count("NonFiniteLoss") >= 1
