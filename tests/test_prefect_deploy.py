"""End to end with real components: a Prefect server on 127.0.0.1, a process work pool and
worker, ``prefect deploy`` from deploy/prefect.yaml, ``prefect deployment run --watch``.

The session's Prefect server (``prefect_server`` in conftest) serves every test here; the
worker is stopped at the end of the module, the server at the end of the session.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from prefect_stack import api
from procwatch import pids_with_env, wait_until

pytestmark = pytest.mark.slow


def _tiny(data_root: Path, **over) -> dict:
    """The tiny config whose learning ``benchmarks.tiny_budget`` measures per host class (the
    default recipe for 20 steps), on ``data_root``."""
    from benchmarks.tiny_budget import TINY
    cfg = {**copy.deepcopy(TINY), "data_root": str(data_root)}
    for k, v in over.items():
        cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, dict) else v
    return cfg


# Well under the lowest validation accuracy of the tiny config over seeds 0-4 on each host class
# (benchmarks/results/tiny_budget-*.json); chance is 0.1.
LEARNT = 0.4


@pytest.fixture(scope="module")
def stack(prefect_server):
    """The session's Prefect server, plus a process work pool, the deployments and a worker."""
    s = prefect_server
    r = s.cli("work-pool", "create", "sluice-process", "--type", "process")
    assert r.returncode == 0 or "already exists" in r.stdout + r.stderr, r.stdout + r.stderr
    r = s.cli("--no-prompt", "deploy", "--all", "--prefect-file", "deploy/prefect.yaml")
    assert r.returncode == 0, r.stdout + r.stderr
    worker = s.spawn("worker", "worker", "start", "--pool", "sluice-process")
    try:
        yield s
    finally:
        s.stop(worker)
        assert worker.poll() is not None


def test_nightly_schedule_is_the_documented_cron(stack):
    spec = yaml.safe_load((ROOT / "deploy" / "prefect.yaml").read_text())
    nightly = next(d for d in spec["deployments"] if d["name"] == "nightly")
    assert nightly["schedules"][0]["cron"] == "0 2 * * *" and nightly["schedules"][0]["timezone"]
    assert "0 2 * * *" in (ROOT / "README.md").read_text()
    dep = api(stack.url, "/deployments/name/nightly-retrain/nightly")
    (sched,) = dep["schedules"]
    assert sched["schedule"]["cron"] == "0 2 * * *" and sched["schedule"]["timezone"] == "UTC"
    assert sched["active"]
    assert api(stack.url, "/deployments/name/nightly-retrain/adhoc")["schedules"] == []


def test_deployment_runs_promote_reuse_and_fail_safely(stack, tmp_path):
    """... and, where this process can build a simulated cluster (root), the second run trains
    across two simulated nodes (launch.nodes: network namespaces, one core each, a 1 Gbit/s
    link), which changes nothing else: the dataset version and IL scores are found, not remade."""
    from deploy.simcluster import SimCluster, netadmin_missing
    from sluice.storage.registry import Registry
    data = tmp_path / "data"
    state, out = stack.run_deployment("nightly-retrain/adhoc", _tiny(data))
    assert state == "COMPLETED", out[-4000:]
    reg = Registry(data / "registry")
    champ = reg.champion()
    assert champ is not None and LEARNT < champ.value <= 1.0, champ.value
    shards_before = {p: p.stat().st_mtime_ns for p in (data / "datasets").rglob("*.tar")}
    scores_before = {p: p.stat().st_mtime_ns for p in (data / "scores").rglob("*.npy")}
    assert scores_before

    # Unchanged data: the shard and IL stages find the version and its scores; nothing is rewritten.
    with contextlib.ExitStack() as on:
        second = _tiny(data)
        if not netadmin_missing():
            c = on.enter_context(SimCluster(2, rate="1gbit"))
            second.update(nproc=1, launch={"nodes": [n.spec() for n in c.nodes], "rdzv_timeout_s": 60})
        state, out = stack.run_deployment("nightly-retrain/adhoc", second)
    assert state == "COMPLETED", out[-4000:]
    if not netadmin_missing():
        run_dir = max((data / "runs").iterdir(), key=lambda d: d.stat().st_mtime)
        assert (run_dir / "torchrun-node0.log").read_text() and (run_dir / "torchrun-node1.log").read_text()
        latest = max(reg.list(), key=lambda r: r.created_at)
        digests = latest.metrics["param_digests"]
        assert latest.metrics["world_size"] == 2 and len(digests) == 2 and digests[0] == digests[1]
    _newest_task_logged(stack, "prepare-data", "up to date (nothing rewritten)")
    _newest_task_logged(stack, "irreducible-loss", "irreducible loss reused (stored for this version)")
    assert {p: p.stat().st_mtime_ns for p in (data / "datasets").rglob("*.tar")} == shards_before
    assert {p: p.stat().st_mtime_ns for p in (data / "scores").rglob("*.npy")} == scores_before
    assert reg.champion().model_id == champ.model_id   # not replaced without a clear win
    assert len(reg.list()) == 2

    # A failing run (missing source) fails the flow and leaves the champion and datasets alone.
    state, out = stack.run_deployment("nightly-retrain/adhoc",
                                      _tiny(data, data={"source": "/no/such/source", "ingest": {"limit": 1500},
                                                        "shard": {"shard_samples": 500}}))
    assert state == "FAILED", out[-4000:]
    assert "/no/such/source" in out.split("the flow run's own log")[-1], out[-4000:]  # says what was wrong
    assert reg.champion().model_id == champ.model_id and len(reg.list()) == 2
    assert {p: p.stat().st_mtime_ns for p in (data / "datasets").rglob("*.tar")} == shards_before

    # A bad config is refused before anything runs, naming the field.
    state, out = stack.run_deployment("nightly-retrain/adhoc", _tiny(data, train={"bogus": 1}))
    assert state in ("FAILED", "UNKNOWN")  # UNKNOWN: the server refused to create the run at all
    assert "bogus" in out, out[-3000:]
    assert len(reg.list()) == 2


def _newest_task_logged(stack, task: str, has: str) -> None:
    """The newest run of the task named ``task`` (in a subflow of the last deployment run)
    completed and logged ``has`` (logs reach the server in batches: waits up to 30 s)."""
    runs = api(stack.url, "/task_runs/filter", {"sort": "EXPECTED_START_TIME_DESC", "limit": 50})
    tr = next(t for t in runs if t["name"].rsplit("-", 1)[0] == task)
    assert tr["state"]["type"] == "COMPLETED", tr["state"]

    def log() -> str:
        logs = api(stack.url, "/logs/filter", {"logs": {"task_run_id": {"any_": [tr["id"]]}}, "limit": 200})
        return "\n".join(r["message"] for r in logs)
    wait_until(f"{has!r} in the {task} task's log", lambda: has in log(), 30, 1.0)


DASK_SCRIPT = """
import sys
from sluice.flows.nightly import prepare
if __name__ == "__main__":
    from distributed import LocalCluster
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster:
        r = prepare({"data_root": sys.argv[1], "prepare_runner": cluster.scheduler_address.replace("tcp", "dask"),
                     "data": {"ingest": {"limit": 1000},
                              "shard": {"shard_samples": 250, "formats": ["webdataset", "dali"]}}})
    print("ROOT", r.root)
"""


def test_shard_map_runs_on_a_dask_cluster(stack, tmp_path):
    """prepare_runner=dask://...: every shard write is a Prefect task on a (local) Dask cluster."""
    from sluice.storage.artifact import open_artifact
    script = tmp_path / "run_dask.py"
    script.write_text(DASK_SCRIPT)
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "data")], env=stack.env, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    root = next(line.split()[1] for line in r.stdout.splitlines() if line.startswith("ROOT"))
    art = open_artifact(root)
    art.verify()
    # no IL model in the default recipe, so no holdout
    counts = art.manifest.counts()  # val: ~10% of the 1,000, chosen by key
    assert counts["train"] + counts["val"] == 1000 and counts["holdout"] == 0 and counts["test"] == 1000
    assert 60 <= counts["val"] <= 140
    runs = api(stack.url, "/task_runs/filter", {"task_runs": {"name": {"like_": "write-shard"}}, "limit": 200})
    assert len([t for t in runs if t["state"]["type"] == "COMPLETED"]) >= 9  # 4 train, 1 val, 4 test shards


def _flow_run_pids(run_id: str) -> list[int]:
    """Processes executing this flow run (the worker exports its id to the run's process)."""
    return pids_with_env(f"PREFECT__FLOW_RUN_ID={run_id}")


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _wait_for(what: str, check, timeout: float = 300, every: float = 1.0):
    return wait_until(what, check, timeout, every)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds processes through /proc")
def test_killed_flow_run_is_crashed_and_the_next_run_succeeds(stack, tmp_path):
    """kill -9 of the process running a flow (OOM killer, node loss) mid-training: Prefect marks
    the run Crashed, torchrun and its ranks die with it, the registry is untouched, and the next
    run on the same data completes."""
    from sluice.storage.registry import Registry
    data = tmp_path / "data"
    long_run = _tiny(data, train={"max_steps": 100000, "batch_size": 32, "comm": {"mode": "none"}})
    r = stack.cli("deployment", "run", "nightly-retrain/adhoc", "--params", json.dumps({"config": long_run}))
    assert r.returncode == 0, r.stdout + r.stderr
    run_id = next(line.split()[-1] for line in (r.stdout + r.stderr).splitlines() if "UUID:" in line)

    def training() -> bool:
        runs = api(stack.url, "/task_runs/filter",
                    {"flow_runs": {"id": {"any_": [run_id]}}, "limit": 50})
        return any(t["name"].startswith("train-") and t["state"]["type"] == "RUNNING" for t in runs)
    _wait_for("the train task to start", training, timeout=400)
    metrics = _wait_for("training steps", lambda: list((data / "runs").rglob("metrics.jsonl")), timeout=200)
    _wait_for("a few logged steps", lambda: metrics[0].stat().st_size > 0, timeout=200)

    pids = _flow_run_pids(run_id)  # the flow's process, torchrun and the ranks inherit the id
    top = [p for p in pids if _parent(p) not in pids]
    assert len(top) == 1 and len(pids) >= 4, (top, pids)  # flow process + torchrun + 2 ranks
    os.kill(top[0], signal.SIGKILL)  # only the flow's process: the rest must follow by themselves

    _wait_for("Prefect to mark the run crashed",
              lambda: api(stack.url, f"/flow_runs/{run_id}")["state"]["type"] == "CRASHED", timeout=120)
    # torchrun and its ranks inherit the run id in their environment: all of them must be gone
    _wait_for("torchrun and its ranks to exit", lambda: not _flow_run_pids(run_id), timeout=60)
    reg = Registry(data / "registry")
    assert reg.list() == [] and reg.champion() is None

    state, out = stack.run_deployment("nightly-retrain/adhoc", _tiny(data))
    assert state == "COMPLETED", out[-4000:]
    assert reg.champion() is not None and len(reg.list()) == 1
