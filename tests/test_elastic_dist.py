"""A run stopped mid-epoch on 2 ranks resumes under real torchrun on 3 ranks (keeping the global
batch) and on 1 (scaling it): every sample of the interrupted epoch is trained exactly as often
as in the uninterrupted run, and the InfoBatch table, the LR schedule and the budget carry over."""
from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from conftest import npz_specs
from deploy.simcluster import netadmin_missing
from sluice.stages.load.arrays import ArrayLoader
from sluice.stages.train.config import TrainConfig
from sluice.stages.run.launch import launch, make_job
from sluice.stages.train.schedule import lr_at
from sluice.storage.checkpoint import load_checkpoint

pytestmark = pytest.mark.slow  # torchrun launches: seconds to a minute each
QUIET = {"on_line": lambda line: None, "timeout_s": 300}
N, G = 960, 48  # an epoch is 20 steps of a global batch of 48 (48 / 3 = 16 per rank on 3 ranks)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[dict, dict]:
    train, test = npz_specs(tmp_path_factory.mktemp("data"), N, 256, test_from_train=True)
    return train, {**test, "batch_size": 128}


def job(data, world: int, **kw):
    cfg = {"model_kwargs": {"width": 4}, "max_steps": 30, "batch_size": G // world, "lr": 0.05,
           "progress": False, "torch_threads": 1, "log_samples": True, "seed": 3,
           "checkpoint_every_steps": 10,
           "lr_reference_batch": G,  # the lr refers to the starting global batch, not the resumed world's
           **kw}
    # sync_every 5: the halt at step 7 leaves 2 steps' losses pending in each rank's state
    sel = {"config": {"method": "infobatch", "params": {"prune": 0.5, "anneal": 0.9, "sync_every": 5}},
           "candidate_size": G // world, "split_size": N}
    return make_job(cfg, *data, selection=sel)


def samples(run_dir: Path, epoch: int) -> Counter:
    """Every index every rank took in ``epoch``, across all the launches in ``run_dir``."""
    out: Counter = Counter()
    for f in run_dir.glob("samples-rank*.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            if rec["epoch"] == epoch:
                out.update(rec["indices"])
    return out


def by_step(result, key: str) -> dict[int, float]:
    return {m["step"]: m[key] for m in result.metrics}


def uninterrupted_epoch0() -> Counter:
    """What the uninterrupted 2-rank run trains in epoch 0: its loaders' own epoch."""
    x = np.zeros((N, 1, 1), np.uint8)
    out: Counter = Counter()
    for r in range(2):
        out.update(int(i) for b in ArrayLoader(x, np.zeros(N), G // 2, seed=3, rank=r, world_size=2)
                   for i in b.indices)
    return out


@pytest.fixture(scope="module")
def halted(tmp_path_factory, data) -> Path:
    """A run of 2 ranks stopped after step 7 of its first epoch (checkpointed there)."""
    out = tmp_path_factory.mktemp("halted")
    half = launch(job(data, 2, halt_at_step=7), nproc=2, out_dir=out, **QUIET)
    assert half.halted and half.steps == 7
    return out


def copy_of(halted: Path, to: Path) -> Path:
    """The halted run's directory (its checkpoint and sample logs): a resume launched on it
    continues there (launch points the job's checkpoints at its own out_dir)."""
    shutil.copytree(halted, to)
    return to


def test_stop_on_two_ranks_resume_on_three_and_on_one_sample_exact(tmp_path, data, halted):
    copy_of(halted, tmp_path / "keep")
    copy_of(halted, tmp_path / "scale")
    saved = load_checkpoint(halted / "checkpoints" / "last.pt")["ranks"][0]["selector"]
    table_mean = float(saved["loss"][saved["seen"]].mean())
    epoch0 = uninterrupted_epoch0()
    assert sum(epoch0.values()) == N and set(epoch0) == set(range(N))  # G divides N: each once
    schedule = TrainConfig(**{k: v for k, v in job(data, 2).config.model_dump().items()})

    # 3 ranks, the same global batch: the same 48 samples per step, 16 on each rank
    keep = launch(job(data, 2), nproc=3, out_dir=tmp_path / "keep", **QUIET)
    assert keep.resumed_from == 7 and keep.steps == 30 and keep.summary["world_size"] == 3
    assert len(set(keep.summary["param_digests"])) == 1
    assert samples(tmp_path / "keep", 0) == epoch0  # none twice, none skipped
    assert all(by_step(keep, "lr")[s] == pytest.approx(lr_at(schedule, (s - 1) / 30, 30), rel=1e-12)
               for s in range(8, 31))  # the schedule goes on where it stopped
    # the InfoBatch loss table crossed over: the first resumed step prunes against its mean
    assert by_step(keep, "select/ib_mean_loss")[8] == pytest.approx(table_mean, rel=1e-6)

    # 1 rank, per-rank batch kept: the global batch halves, so does the lr; the budget is samples
    scale = launch(job(data, 2, resize="scale_global_batch"), nproc=1, out_dir=tmp_path / "scale", **QUIET)
    assert scale.resumed_from == 7 and scale.steps == 7 + 26 + 20  # 624 left of epoch 0, then 20 x 24
    assert samples(tmp_path / "scale", 0) == epoch0
    assert by_step(scale, "lr")[8] == pytest.approx(0.5 * lr_at(schedule, 7 / 30, 30), rel=1e-12)
    assert by_step(scale, "lr")[9] == pytest.approx(0.5 * lr_at(schedule, 7.5 / 30, 30), rel=1e-12)
    assert by_step(scale, "select/ib_mean_loss")[8] == pytest.approx(table_mean, rel=1e-6)
    assert scale.summary["stopped_by"] == "steps"


@pytest.mark.skipif(bool(netadmin_missing()), reason=f"simulated cluster: {netadmin_missing()}")
def test_stop_on_one_machine_resume_on_two_simulated_nodes_of_two_ranks(tmp_path, data, halted):
    from deploy.simcluster import SimCluster
    from sluice.stages.run.nodes import launch_nodes
    copy_of(halted, tmp_path / "nodes")
    with SimCluster(2, rate="1gbit") as c:
        r = launch_nodes(job(data, 2), {"nodes": [n.spec() for n in c.nodes], "rdzv_timeout_s": 60},
                         nproc=2, out_dir=tmp_path / "nodes", **QUIET)
    assert r.resumed_from == 7 and r.steps == 30 and r.summary["world_size"] == 4
    assert len(set(r.summary["param_digests"])) == 1
    assert samples(tmp_path / "nodes", 0) == uninterrupted_epoch0()
    worlds = {json.loads(line)["world"] for f in (tmp_path / "nodes").glob("samples-rank*.jsonl")
              for line in f.read_text().splitlines()}
    assert worlds == {2, 4}
