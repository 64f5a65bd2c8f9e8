"""Training across simulated nodes (deploy/simcluster: one network namespace and one core per
node, joined over a shaped veth link) with real torchrun, c10d rendezvous and gloo: the same
result as on one machine, survival of a killed rank, and a bounded, named failure when a node
never joins. Skipped with the reason where namespaces cannot be created."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT
from deploy.simcluster import SimCluster, netadmin_missing
from sluice.errors import ConfigError, RendezvousError
from sluice.stages.train import TrainResult
from sluice.stages.run.launch import launch, make_job, prepare_run
from sluice.stages.run.nodes import LaunchConfig, launch_nodes
from sluice.storage.checkpoint import load_checkpoint

needs_netns = pytest.mark.skipif(bool(netadmin_missing()), reason=f"simulated cluster: {netadmin_missing()}")
QUIET = {"on_line": lambda line: None, "timeout_s": 300}


@pytest.fixture(scope="module")
def data(train_test_npz) -> tuple[dict, dict]:
    return train_test_npz


@pytest.fixture(scope="module")
def cluster():
    with SimCluster(2, rate="1gbit") as c:
        yield c


def cfg(**kw) -> dict:
    base = {"model_kwargs": {"width": 8}, "max_steps": 24, "batch_size": 32, "lr": 0.05,
            "progress": False, "torch_threads": 1,
            "comm": {"mode": "powersgd", "params": {"start_iter": 4, "rank": 2}}}
    return {**base, **kw}


@needs_netns
@pytest.mark.slow
def test_two_nodes_via_the_deploy_script_equal_two_ranks_on_one_machine(tmp_path, data, cluster):
    """deploy/torchrun-multinode.sh on each node, as an operator would run it: both nodes end
    with identical parameters, equal to a 2-rank single-machine run from the same seed."""
    out, job, _ = prepare_run(make_job(cfg(), *data), tmp_path / "nodes")
    n0 = cluster.nodes[0]
    procs = []
    for node in cluster.nodes:
        env = {**os.environ, "NNODES": "2", "NODE_RANK": str(node.index), "NPROC": "1",
               "RDZV": f"{n0.address}:29400", "LOCAL_ADDR": node.address, "IFACE": node.interface,
               "MAX_RESTARTS": "0", "RDZV_TIMEOUT": "60", "PYTHON": sys.executable}
        procs.append(node.popen(["bash", str(ROOT / "deploy" / "torchrun-multinode.sh"), str(job)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    multi = TrainResult.from_dict(json.loads((out / "result.json").read_text()))
    single = launch(make_job(cfg(), *data), nproc=2, out_dir=tmp_path / "single", **QUIET)
    assert multi.steps == single.steps == 24
    d = multi.summary["param_digests"]
    assert len(d) == 2 and d[0] == d[1]  # identical on both nodes
    assert d == single.summary["param_digests"]  # and bit-equal to one machine's 2 ranks
    assert multi.final_acc == single.final_acc
    assert multi.metrics[-1]["bytes_comm"] < multi.summary["uncompressed_bytes"]  # PowerSGD on the wire


@needs_netns
@pytest.mark.slow
def test_kill_minus_9_of_one_nodes_rank_restarts_from_checkpoint_and_finishes(tmp_path, data, cluster):
    train_spec = {**data[0], "delay_s": 0.03}  # slow storage, so the kill lands mid-run
    c = cfg(max_steps=60, checkpoint_every_steps=5, comm={"mode": "none"})
    launch_cfg = {"nodes": [n.spec() for n in cluster.nodes], "rdzv_timeout_s": 30, "max_restarts": 2}
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = launch_nodes(make_job(c, train_spec, data[1]), launch_cfg, nproc=1,
                                         out_dir=tmp_path, **QUIET)
        except Exception as e:  # surfaced below
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    ckpt = tmp_path / "checkpoints" / "last.pt"
    deadline = time.monotonic() + 120
    while not (ckpt.exists() and (tmp_path / "pids" / "rank1.pid").exists()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ckpt.exists(), box
    killed_at = load_checkpoint(ckpt)["step"]
    victim = int((tmp_path / "pids" / "rank1.pid").read_text())
    netns = subprocess.run(["ip", "netns", "identify", str(victim)], capture_output=True, text=True).stdout
    assert netns.strip() in {n.netns for n in cluster.nodes}  # a rank on a simulated node
    os.kill(victim, signal.SIGKILL)
    t.join(300)
    assert "error" not in box, box.get("error")
    r = box["result"]
    assert r.steps == 60 and r.resumed_from is not None and r.resumed_from >= killed_at
    assert r.summary["param_digests"][0] == r.summary["param_digests"][1]


@needs_netns
@pytest.mark.slow
@pytest.mark.timeout(300)  # the rendezvous gives up after rdzv_timeout_s; a hang fails here instead
def test_a_node_that_never_joins_fails_naming_it(tmp_path, data, cluster):
    cluster.nodes[1].set_link(False)  # node 1's cable is out
    try:
        with pytest.raises(RendezvousError) as e:
            launch_nodes(make_job(cfg(max_steps=4), *data),
                         {"nodes": [n.spec() for n in cluster.nodes], "rdzv_timeout_s": 5},
                         nproc=1, out_dir=tmp_path, **QUIET)
    finally:
        cluster.nodes[1].set_link(True)
    msg = str(e.value)
    assert f"node 1 ({cluster.nodes[1].address}) cannot reach the rendezvous at {cluster.nodes[0].address}:29400" in msg
    assert "node 0" in msg and "never joined" in msg


def test_node_lists_are_validated():
    with pytest.raises(ValueError, match="one node"):
        LaunchConfig(nodes=[{"address": "10.0.0.1"}])
    with pytest.raises(ValueError, match="differ"):
        LaunchConfig(nodes=[{"address": "10.0.0.1"}, {"address": "10.0.0.1"}])
    with pytest.raises(ValueError):  # names, never commands
        LaunchConfig(nodes=[{"address": "10.0.0.1", "netns": "x; reboot"}, {"address": "10.0.0.2"}])
    with pytest.raises(ConfigError, match="at least two"):
        launch_nodes({}, LaunchConfig(), nproc=1)
