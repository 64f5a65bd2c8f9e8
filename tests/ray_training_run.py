"""Run inside a network namespace that has only loopback (tests/test_ray_training.py starts it):
a real 3-node Ray cluster (a 0-CPU head, two 1-CPU worker nodes, token authentication, every
node on 127.0.0.1, node failures noticed within seconds), training through ``launch.engine:
ray`` against the same job under torchrun on one machine, then a run whose rendezvous host
node is removed mid-run; the same with the checkpoints in object storage (a real S3-protocol
server, moto's, on 127.0.0.1) for nodes that share no file system. Prints one JSON line: what
the test checks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ["RAY_AUTH_MODE"] = "token"
os.environ["RAY_AUTH_TOKEN"] = "sluice-test-" + os.urandom(16).hex()
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
out = Path(sys.argv[1])
# object storage for nodes that share no file system: an S3-protocol server on loopback, reached
# by every node through the environment the cluster's processes inherit (as a user's endpoint is)
from s3_server import start_s3_server  # noqa: E402

out.mkdir(parents=True, exist_ok=True)
s3_server, S3_PORT = start_s3_server(out / "moto.log")
os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                  AWS_ENDPOINT_URL=f"http://127.0.0.1:{S3_PORT}")

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from conftest import npz_specs  # noqa: E402
from sluice.stages.run.launch import launch, make_job  # noqa: E402
from sluice.stages.run.ray_nodes import NODES_FILE, launch_ray  # noqa: E402
from sluice.storage.checkpoint import checkpoint_exists, load_checkpoint  # noqa: E402

MIB = 2**20
BUCKET = "sluice-test"
t0 = time.time()
cluster = Cluster(initialize_head=True, head_node_args={
    "node_ip_address": "127.0.0.1", "num_cpus": 0, "object_store_memory": 80 * MIB, "include_dashboard": False,
    "_system_config": {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000,
                       "health_check_failure_threshold": 3}})
workers = [cluster.add_node(node_ip_address="127.0.0.1", num_cpus=1, object_store_memory=80 * MIB) for _ in range(2)]
cluster.wait_for_nodes()
ray.init(address=cluster.address, log_to_driver=False)
import s3fs  # noqa: E402

s3 = s3fs.S3FileSystem()
s3.mkdir(BUCKET)
report: dict = {"started_s": round(time.time() - t0, 1), "address": cluster.address,
                "nodes": len([n for n in ray.nodes() if n["Alive"]])}
listening = subprocess.run(["ss", "-Hltn"], capture_output=True, text=True).stdout.split("\n")
report["listening"] = sorted({line.split()[3].rsplit(":", 1)[0] for line in listening if line.strip()})

(out / "data").mkdir(parents=True, exist_ok=True)
train, test = npz_specs(out / "data", 2048, 512)
quiet = {"on_line": lambda line: None, "timeout_s": 300}
engine = {"name": "ray", "address": cluster.address}


def cfg(**kw) -> dict:
    return {"model_kwargs": {"width": 8}, "max_steps": 24, "batch_size": 32, "lr": 0.05, "progress": False,
            "torch_threads": 1, "eval_every_steps": 12, **kw}


def evals(result) -> list:  # what an evaluation found, without when and how long it took
    return [{k: v for k, v in e.items() if k not in ("elapsed_s", "wall_time")} for e in result.evals]


def losses(run: Path) -> list:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "step" in r and "loss" in r]


# 1. the same job: 2 nodes x 1 rank through Ray, and 2 ranks under torchrun on one machine
said: list[str] = []
t = time.time()
on_ray = launch_ray(make_job(cfg(), train, test), {"ray": {"nodes": 2}}, engine, out_dir=out / "ray",
                    on_line=said.append, timeout_s=300)
report["ray_s"] = round(time.time() - t, 1)
t = time.time()
single = launch(make_job(cfg(), train, test), nproc=2, out_dir=out / "single", **quiet)
report["single_s"] = round(time.time() - t, 1)
report["same"] = {
    "steps": [on_ray.steps, single.steps],
    "digests": [on_ray.summary["param_digests"], single.summary["param_digests"]],
    "acc": [on_ray.final_acc, single.final_acc],
    "evals": evals(on_ray) == evals(single), "n_evals": len(single.evals),
    "losses": losses(out / "ray") == losses(out / "single"), "n_losses": len(losses(out / "single")),
    "world": on_ray.summary.get("world_size"),
    "launch": on_ray.summary["launch"],
    "node_lines": sum(line.startswith("[node ") for line in said),
    "said": [line for line in said if line.startswith("[sluice]")]}

# 1b. the same job on nodes sharing no file system: checkpoints in object storage, the job sent
t = time.time()
on_s3 = launch_ray(make_job(cfg(checkpoint_every_steps=12), train, test),
                   {"ray": {"nodes": 2, "storage": f"s3://{BUCKET}/runs"}}, engine,
                   out_dir=out / "s3", on_line=lambda line: None, timeout_s=300)
report["s3_s"] = round(time.time() - t, 1)
stored = sorted(s3.find(f"{BUCKET}/runs"))
a = on_s3.summary["launch"]["attempts"][0]
report["s3"] = {
    "digests": on_s3.summary["param_digests"], "acc": on_s3.final_acc, "steps": on_s3.steps,
    "evals": evals(on_s3) == evals(single), "losses": losses(out / "s3") == losses(out / "single"),
    "ended": a["ended"], "world": a["world_size"], "storage": on_s3.summary["launch"].get("storage"),
    "stored": stored, "job_files": a["job_files"], "out": str(out / "s3"),
    "local_checkpoint": on_s3.checkpoint,
    "same_checkpoint": bool(on_s3.checkpoint) and Path(on_s3.checkpoint).read_bytes() == s3.cat(
        next((x for x in stored if x.endswith("checkpoints/last.pt")), f"{BUCKET}/none")),
    "node_dirs_left": [p for p in a["job_files"] if Path(p).exists()]}

# 2. the node that hosts the rendezvous (agent 0's) removed mid-run: a restart on the node left;
# then again with a replacement node added at once: a restart on two nodes again
train_slow = {**train, "delay_s": 0.03}  # slow storage, so the removal lands mid-run


def add_node():
    workers.append(cluster.add_node(node_ip_address="127.0.0.1", num_cpus=1, object_store_memory=80 * MIB))
    cluster.wait_for_nodes()


def lose_a_node(run: Path, replace_wait_s: float, replacement: bool, storage: str | None = None) -> dict:
    box: dict = {}
    said: list[str] = []

    def go() -> None:
        try:
            box["result"] = launch_ray(make_job(cfg(max_steps=60, checkpoint_every_steps=5, eval_every_steps=30),
                                                train_slow, test),
                                       {"ray": {"replace_wait_s": replace_wait_s, "node_lost_s": 20,
                                                "storage": storage}}, engine,
                                       out_dir=run, on_line=said.append, timeout_s=400)
        except Exception as e:  # noqa: BLE001 - reported
            box["error"] = f"{type(e).__name__}: {e}"

    th = threading.Thread(target=go)
    th.start()
    deadline = time.monotonic() + 200

    def checkpoint() -> str | Path | None:  # where the run's checkpoint is, once written
        if storage is None:
            return run / "checkpoints" / "last.pt"
        s3.invalidate_cache()
        found = [x for x in s3.glob(f"{storage[len('s3://'):]}/{run.name}-*/checkpoints/last.pt")]
        return f"s3://{found[0]}" if found else None

    while not (checkpoint_exists(checkpoint()) and (run / NODES_FILE).exists()) and time.monotonic() < deadline \
            and th.is_alive():
        time.sleep(0.2)
    ckpt = checkpoint()
    lost: dict = {"checkpoint_before": checkpoint_exists(ckpt)}
    if lost["checkpoint_before"]:
        lost["killed_at"] = load_checkpoint(ckpt)["step"]
        host_node = json.loads((run / NODES_FILE).read_text())["attempts"][-1]["nodes"][0]["node_id"]
        victim = next(w for w in workers if w.node_id == host_node)
        cluster.remove_node(victim, allow_graceful=False)
        workers.remove(victim)
        lost["removed"] = True
        if replacement:
            add_node()
    th.join(420)
    lost["alive_nodes_after"] = len([n for n in ray.nodes() if n["Alive"]])
    if "result" in box:
        r = box["result"]
        lost.update(steps=r.steps, resumed_from=r.resumed_from, launch=r.summary["launch"], checkpoint=r.checkpoint,
                    world=r.summary.get("world_size"), digests=r.summary["param_digests"])
    lost["error"] = box.get("error")
    lost["said"] = [line for line in said if line.startswith("[sluice]")]
    return lost


report["lost"] = lose_a_node(out / "lost", 3, replacement=False)
add_node()
report["replaced"] = lose_a_node(out / "replaced", 60, replacement=True, storage=f"s3://{BUCKET}/runs")
# 3. the nightly flow through the front door on the cluster's two nodes (Prefect's temporary API on loopback)
night = [sys.executable, "-m", "sluice.flows.cli", "run", "nightly", "--data-root", str(out / "night")]
for kv in ("data.source=fashion-mnist", "data.ingest.limit=600", "data.shard.shard_samples=300",
           "data.shard.progress=false", "selection.method=none", "train.batch_size=32", "train.max_steps=12",
           "tracking.uri=none", "launch.engine=ray", "nproc=1", f"engine.address={cluster.address}"):
    night += ["--set", kv]
t = time.time()
flow = subprocess.run(night, capture_output=True, text=True, timeout=400)
text = flow.stdout + flow.stderr
report["night"] = {"rc": flow.returncode, "tail": text[-3000:], "s": round(time.time() - t, 1),
                   "attempts": [x for x in text.splitlines() if "ray: attempt" in x],
                   "node_lines": sum("[node " in x for x in text.splitlines()),
                   "report": next((Path(x.split("run directory    : ")[1].split()[0], "report.md").read_text()
                                   for x in text.splitlines() if x.startswith("run directory")), "")}
report["orphans"] = subprocess.run(["pgrep", "-f", "sluice.stages.train.rank"], capture_output=True,
                                   text=True).stdout.split()
ray.shutdown()
cluster.shutdown()
s3_server.terminate()
print("REPORT " + json.dumps(report), flush=True)
