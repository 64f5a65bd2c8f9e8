"""Where a run computes, decided once: ranks per GPU or core, each rank's own device, the loader on
the rank's device, one rank trained in-process, and what a GPU fault says. The counts are
arguments, so the CUDA rules are checked here without a GPU; tests marked ``gpu`` run them on one."""
from __future__ import annotations

import os

import pytest
import torch

from sluice.errors import ConfigError, LaunchError, TrainError
from sluice.flows.pipeline import PipelineConfig
from sluice.stages.host import describe, rank_device, ranks_for, usable_cores
from sluice.stages.load.config import loader_device
from sluice.stages.train.config import TrainConfig
from sluice.stages.train.faults import device_failure_line, is_device_failure, out_of_memory
from sluice.stages.run.launch import launch, make_job

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_auto_is_one_rank_per_visible_gpu_and_rank_i_uses_cuda_i(gpus):
    n = ranks_for("auto", cuda=True, gpus=gpus, cores=16)
    assert n == gpus
    assert [rank_device(True, i) for i in range(n)] == [torch.device("cuda", i) for i in range(gpus)]
    # the same rule as the pipeline config applies it, with the device count as an argument
    c = PipelineConfig.model_validate({"train": {"device": "cuda"}})
    assert c.ranks(gpus=gpus) == gpus


def test_auto_on_cpus_is_one_rank_per_core_whatever_the_gpus():
    assert ranks_for("auto", cuda=False, gpus=4, cores=16) == 16
    assert ranks_for("auto", cuda=False, gpus=0, cores=16, pinned=[3, 5]) == 3
    assert rank_device(False, 3) == torch.device("cpu")
    assert PipelineConfig.model_validate({"train": {"device": "cpu"}}).ranks(gpus=4) == usable_cores()


def test_an_explicit_nproc_wins_and_more_cuda_ranks_than_gpus_is_refused():
    assert ranks_for(2, cuda=True, gpus=4, cores=16) == 2
    assert ranks_for(3, cuda=False, gpus=0, cores=2) == 3
    with pytest.raises(ConfigError, match="each CUDA rank needs its own device"):
        ranks_for(2, cuda=True, gpus=1, cores=16)
    with pytest.raises(ConfigError, match="no GPU is visible"):
        ranks_for("auto", cuda=True, gpus=0, cores=16)
    with pytest.raises(ConfigError, match="nproc must be"):
        ranks_for(0, cuda=False, gpus=0, cores=2)


def test_the_loader_follows_the_training_device_unless_set():
    assert loader_device("auto") == torch.device("cpu")  # a loader built on its own
    assert loader_device("auto", torch.device("cuda", 3)) == torch.device("cuda", 3)
    assert loader_device("cuda", torch.device("cuda", 2)) == torch.device("cuda", 2)  # the rank's own GPU
    assert loader_device("cpu", torch.device("cuda", 1)) == torch.device("cpu")  # explicit wins
    assert loader_device("cuda:1", torch.device("cuda", 0)) == torch.device("cuda", 1)
    assert loader_device("auto", torch.device("cpu")) == torch.device("cpu")


def test_the_one_line_says_gpus_and_the_loader_device():
    line = describe("cuda", "bf16", 1, 16, 256, gpus="1 × H100", loader_device="cuda:0")
    assert line == "cuda: 1 × H100, bf16, 1 rank x 16 threads, 256 per rank, loader on cuda:0"
    assert describe("avx2", "none", 2, 1, 64) == "avx2: fp32, 2 ranks x 1 thread, 64 per rank"


def test_log_interval_auto_resolves_per_device():
    cpu = PipelineConfig.model_validate({"train": {"device": "cpu"}})
    gpu = PipelineConfig.model_validate({"train": {"device": "cuda"}})
    assert cpu.train.log_every_steps == 1 and gpu.train.log_every_steps == 50
    explicit = PipelineConfig.model_validate({"train": {"device": "cuda", "log_every_steps": 7}})
    assert explicit.train.log_every_steps == 7


def _job(data, **kw):
    base = {"model_kwargs": {"width": 8}, "max_steps": 6, "batch_size": 32, "lr": 0.05, "progress": False,
            "torch_threads": 1}
    return make_job({**base, **kw}, *data)


QUIET = {"on_line": lambda line: None}


@pytest.mark.slow
def test_one_rank_trains_in_process_exactly_as_under_torchrun(tmp_path, train_test_npz):
    inproc = launch(_job(train_test_npz), nproc=1, out_dir=tmp_path / "in", **QUIET)
    assert (tmp_path / "in" / "pids" / "rank0.pid").read_text() == str(os.getpid())  # this process
    assert not (tmp_path / "in" / "torchrun.log").exists()
    torchrun = launch(_job(train_test_npz), nproc=1, out_dir=tmp_path / "tr", isolate=True, **QUIET)
    assert (tmp_path / "tr" / "pids" / "rank0.pid").read_text() != str(os.getpid())
    assert [m["loss"] for m in inproc.metrics] == [m["loss"] for m in torchrun.metrics]
    assert inproc.summary["param_digests"] == torchrun.summary["param_digests"]
    assert inproc.final_acc == torchrun.final_acc
    again = launch(_job(train_test_npz), nproc=1, out_dir=tmp_path / "in", **QUIET)  # resumes: done
    assert again.steps == inproc.steps and again.metrics == []


def test_in_process_errors_name_the_rank_and_the_time_limit_stops_it(tmp_path, train_test_npz):
    with pytest.raises(TrainError, match=r"\(rank 0\)"):  # a SluiceError ends the run, as under torchrun
        launch(_job(train_test_npz, normalize_mean=[0.5, 0.5], normalize_std=[0.5, 0.5]), nproc=1,
               out_dir=tmp_path / "bad", **QUIET)  # two channels' normalisation for one-channel images
    assert (tmp_path / "bad" / "error.json").exists()
    with pytest.raises(LaunchError, match="timeout_s"):
        launch(_job(train_test_npz, max_steps=10_000), nproc=1, out_dir=tmp_path / "slow", timeout_s=1.0, **QUIET)
    assert torch.get_num_threads() >= 1


def test_out_of_memory_says_the_batch_the_memory_and_what_to_set():
    cfg = TrainConfig(batch_size=256, accum_steps=1, amp="none")
    e = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.06 GiB. GPU 0 has a total capacity of "
                               "79.19 GiB of which 1.2 GiB is free.")
    msg = str(out_of_memory(e, cfg, rank=1, device=torch.device("cpu"), loader_batch=512))
    for part in ("rank 1", "train.batch_size=256 per rank", "512 candidates", "3.06 GiB",
                 "train.batch_size: 128", "train.accum_steps: 2"):
        assert part in msg, (part, msg)


def test_device_failures_are_told_apart_and_name_the_rank_and_host():
    assert is_device_failure(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert is_device_failure(RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error"))
    assert not is_device_failure(ValueError("shapes (3,) and (4,) do not match"))
    line = device_failure_line(RuntimeError("CUDA error: ECC error\nmore"), 3, torch.device("cuda", 3))
    assert "rank 3 on " in line and "(cuda:3)" in line and "ECC error" in line and "more" not in line


@cuda
@pytest.mark.gpu
def test_gpu_each_rank_sets_its_device_before_anything_allocates(tmp_path, train_test_npz):
    from sluice.stages.train.dist import place_rank
    last = torch.cuda.device_count() - 1
    assert place_rank(TrainConfig(device="auto"), last) == torch.device("cuda", last)
    assert torch.cuda.current_device() == last
    torch.cuda.set_device(0)
    with pytest.raises(ConfigError, match="has no GPU"):
        place_rank(TrainConfig(device="cuda"), last + 1)


@cuda
@pytest.mark.gpu
def test_gpu_out_of_memory_in_a_run_is_a_clear_error(tmp_path, train_test_npz):
    torch.cuda.empty_cache()
    # ~100 MB whatever the card (an H200 has 139 GiB); one batch of all 2048 training images
    # (a larger batch is refused by the loader first, before any memory is asked for)
    torch.cuda.set_per_process_memory_fraction(100e6 / torch.cuda.get_device_properties(0).total_memory)
    try:
        with pytest.raises(TrainError, match=r"out of memory on rank 0 .*train.batch_size=2048 per rank.*"
                                             r"train.batch_size: 1024"):
            launch(_job(train_test_npz, device="cuda", batch_size=2048, model="bn_cnn", model_kwargs={}),
                   nproc=1, out_dir=tmp_path, **QUIET)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


@cuda
@pytest.mark.gpu
def test_gpu_pipeline_config_resolves_to_the_gpus_here():
    c = PipelineConfig()
    assert c.on_cuda() and c.ranks() == torch.cuda.device_count()
    line = c.resolved_for_host()
    assert line.startswith(f"cuda: {torch.cuda.device_count()} × ") and line.endswith("loader on cuda:0")


@cuda
@pytest.mark.gpu
def test_gpu_one_rank_trains_in_process_and_grades_on_the_gpu(tmp_path, train_test_npz):
    from sluice.stages.train.evaluate import scoring_device
    r = launch(_job(train_test_npz, device="auto", max_steps=20), nproc=1, out_dir=tmp_path, **QUIET)
    assert (tmp_path / "pids" / "rank0.pid").read_text() == str(os.getpid())
    assert r.summary["host"].startswith("cuda")
    assert scoring_device("auto").type == "cuda"
