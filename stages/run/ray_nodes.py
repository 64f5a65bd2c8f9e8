"""Training on the nodes of a Ray cluster (``launch.engine: ray``): Ray places one node agent
per node and watches it; each agent runs its node's torchrun, and the nodes' torchruns form the
process group through torchrun's own c10d rendezvous, hosted by agent 0's node.

Why torchrun on Ray-placed processes, not Ray Train's ``TorchTrainer``: the ranks then run the
very same entry (``sluice.stages.train.rank``, ``run_rank``) under the same elastic agent, env
and process-group setup as ``launch`` on one machine and ``launch_nodes`` on listed nodes, so a
run's losses, evaluations and weights are the same bits at the same world size wherever it ran
(a test holds it); the checkpoints, resume at another world size and the job file are the ones
that already exist. ``TorchTrainer`` would form the group itself, with its own worker env and
checkpoint scheme, and needs ``ray[train]``'s extra packages. Ray does what it is good at here:
placing (a placement group, ``STRICT_SPREAD``: one bundle, so one agent, per node) and noticing
that a node is gone.

A lost node costs a restart, not the night: when an agent dies with its node (or stops answering
for ``launch.ray.node_lost_s``), the other agents' torchruns are stopped, the driver waits up to
``replace_wait_s`` for a replacement, then starts the ranks again on the nodes there are (no fewer
than ``min_nodes``); they resume from the last checkpoint at that world size. Every attempt, and
why it ended, is in the result's ``summary["launch"]`` and in ``ray-nodes.json``.

Where the run's files go: by default ``out_dir``, which must then be one path every node sees (a
shared file system). On nodes that share none, ``launch.ray.storage`` names object storage (an
fsspec URL, ``s3://bucket/prefix``) every node reaches: the checkpoints are written and read
there (``storage/checkpoint.py``), under a key named after ``out_dir`` (a retry of the same run
resumes from them); the driver sends each agent the job, which its node runs from a local
directory; rank 0's metrics lines come back with the output, and its result (or a rank's error)
when the attempt ends; the last checkpoint is copied into ``out_dir`` for grading.

What listens where: as ``launch_nodes`` (docs/security.md): agent 0's torchrun hosts the c10d
store on a free port of its node's address; gloo/NCCL use the interface that holds the node's
Ray address. Ray itself is reached as the data stages reach it (``stages/data/engine.connect``:
token authentication)."""
from __future__ import annotations

import contextlib
import hashlib
import os
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from sluice.errors import ConfigError, LaunchError
from sluice.stages.data.engine import EngineConfig, connect
from sluice.stages.run.launch import collect_result, prepare_run
from sluice.stages.run.node_agent import METRICS, OUTCOME_FILES, NodeAgent
from sluice.stages.run.nodes import LaunchConfig, RayLaunch, address_in_url
from sluice.stages.train.job import TrainJob
from sluice.stages.train.rank import RESULT, TrainResult
from sluice.storage import paths
from sluice.storage.atomic import write_bytes, write_json
from sluice.storage.checkpoint import checkpoint_exists, checkpoint_path

POLL_S = 0.5
NODES_FILE = "ray-nodes.json"


class _Attempt:
    """One start of the ranks: a placement group over ``n`` nodes, an agent on each, their
    torchruns, watched until they all end, one node is lost, one fails, or time runs out."""

    def __init__(self, ray: Any, index: int, n: int, per_node: int, bundle: dict[str, float],
                 cfg: LaunchConfig, out: Path, emit: Callable[[str], None]):
        self.ray, self.index, self.n, self.per_node, self.bundle = ray, index, n, per_node, bundle
        self.cfg, self.out, self.emit = cfg, out, emit
        self.agents: list[Any] = []
        self.where: list[dict[str, Any]] = []
        self.pg: Any = None
        self.tails: list[list[str]] = [[] for _ in range(n)]
        self.rcs: list[int | None] = [None] * n
        self.endpoint = ""
        self.t0 = time.monotonic()
        self.timing: dict[str, float] = {}  # seconds from the attempt's start: placed, agents up, torchruns started
        self.job_paths: list[str] = []  # the job file each node's ranks read

    def start(self, job_path: Path, env: dict[str, str], job: dict[str, Any] | None = None) -> None:
        """Place the agents and start their torchruns on ``job_path`` (a path every node sees) or,
        given ``job``, on a copy each agent keeps in a local directory of its own."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        ray, r = self.ray, self.cfg.ray
        self.pg = placement_group([dict(self.bundle)] * self.n, strategy="STRICT_SPREAD",
                                  name=f"sluice-train-{uuid.uuid4().hex[:8]}")
        placed = self.pg.wait(timeout_seconds=r.place_timeout_s)
        self.timing["placed_s"] = round(time.monotonic() - self.t0, 2)
        if not placed:
            raise LaunchError(f"Ray could not place {self.n} node(s) of {self.per_node} rank(s) ({self.bundle} per "
                              f"node, one node each) within launch.ray.place_timeout_s={r.place_timeout_s:g}; "
                              f"the cluster has {_cluster_nodes(ray)}")
        agent = ray.remote(max_restarts=0, max_task_retries=0)(NodeAgent)
        self.agents = [agent.options(num_cpus=self.bundle.get("CPU", 0), num_gpus=self.bundle.get("GPU", 0),
                                     scheduling_strategy=PlacementGroupSchedulingStrategy(
                                         self.pg, placement_group_bundle_index=i)).remote()
                       for i in range(self.n)]
        self.where = ray.get([a.where.remote() for a in self.agents], timeout=r.place_timeout_s)
        self.timing["agents_s"] = round(time.monotonic() - self.t0, 2)
        head = self.where[0]
        self.endpoint = f"{address_in_url(head['ip'])}:{head['port']}"
        run_id = f"sluice-{uuid.uuid4().hex[:8]}"
        self.job_paths = ray.get([a.start.remote(str(job_path), self.n, self.per_node, self.endpoint, run_id, i == 0,
                                                 self.cfg.rdzv_timeout_s, self.cfg.max_restarts, env, job)
                                  for i, a in enumerate(self.agents)], timeout=r.place_timeout_s)
        self.timing["started_s"] = round(time.monotonic() - self.t0, 2)
        self.emit(f"[sluice] ray: attempt {self.index + 1}: {self.n} node(s) x {self.per_node} rank(s), "
                  f"rendezvous at {self.endpoint}: "
                  + ", ".join(f"node {i} {w['ip']} ({w['node_id'][:8]})" for i, w in enumerate(self.where)) + "\n")

    def watch(self, deadline: float | None) -> tuple[str, int | None]:
        """Until the run ends: ("done", None), ("lost", node), ("failed", node) or ("timeout", None).
        A node is lost when its agent died or has not answered for ``node_lost_s``; a torchrun
        that exits non-zero is a failure only once every other agent has answered since (a rank
        whose peer's node just died fails too: that is the lost node's doing)."""
        from ray.exceptions import ActorUnavailableError, RayActorError
        ray, lost_s = self.ray, self.cfg.ray.node_lost_s
        pos = [0] * self.n
        answered = [time.monotonic()] * self.n  # when each agent's last answered poll was sent
        failed_at: float | None = None
        logs = [open(self.out / f"torchrun-node{i}.log", "a") for i in range(self.n)]
        metrics = None  # rank 0's lines, from a node that runs from its own directory
        try:
            while True:
                sent = time.monotonic()
                refs = [a.poll.remote(pos[i]) for i, a in enumerate(self.agents)]
                ready, _ = ray.wait(refs, num_returns=self.n, timeout=max(POLL_S, 2.0))
                for i, ref in enumerate(refs):
                    if ref not in ready:
                        continue
                    try:
                        lines, rc, rows = ray.get(ref)
                    except ActorUnavailableError:
                        continue  # not an answer; lost once it lasts node_lost_s
                    except RayActorError:
                        return "lost", i
                    answered[i] = sent
                    pos[i] += len(lines)
                    for line in lines:
                        logs[i].write(line)
                        self.emit(f"[node {i}] {line}")
                    logs[i].flush()
                    if rows:
                        metrics = metrics or open(self.out / METRICS, "a")
                        metrics.writelines(rows)
                        metrics.flush()
                    self.tails[i] = (self.tails[i] + lines)[-60:]
                    self.rcs[i] = rc
                now = time.monotonic()
                silent = [i for i in range(self.n) if now - answered[i] > lost_s]
                if silent:
                    return "lost", silent[0]
                if all(rc == 0 for rc in self.rcs):
                    return "done", None
                bad = [i for i, rc in enumerate(self.rcs) if rc not in (0, None)]
                if bad and failed_at is None:
                    failed_at = sent
                if failed_at is not None and all(t > failed_at for t in answered):
                    return "failed", bad[0]
                if deadline is not None and now > deadline:
                    return "timeout", None
                time.sleep(POLL_S)
        finally:
            for f in logs:
                f.close()
            if metrics is not None:
                metrics.close()

    def fetch_outcome(self) -> None:
        """Copy the result and error files the agents' local directories hold into ``out``
        (nodes sharing no file system), from every agent still there."""
        for a in self.agents:
            try:
                files = self.ray.get(a.outcome.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - a lost node's files are gone with it
                continue
            for name in OUTCOME_FILES:  # the names this side knows, never one the answer makes up
                if isinstance(files.get(name), str):
                    write_bytes(self.out / name, files[name].encode())

    def close(self, lost: int | None) -> None:
        """Stop the agents' torchruns (the lost node's is gone with it) and free the nodes."""
        from ray.util.placement_group import remove_placement_group
        stops = [a.stop.remote() for i, a in enumerate(self.agents) if i != lost]
        with contextlib.suppress(Exception):
            self.ray.wait(stops, num_returns=len(stops), timeout=30)
        for a in self.agents:
            with contextlib.suppress(Exception):
                self.ray.kill(a)
        if self.pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)

    def record(self, outcome: str, node: int | None) -> dict[str, Any]:
        return {"nodes": [{"ip": w["ip"], "node_id": w["node_id"], "host": w["host"]} for w in self.where],
                "ranks_per_node": self.per_node, "world_size": self.n * self.per_node, "ended": outcome,
                "job_files": self.job_paths,
                "node": node, "seconds": round(time.monotonic() - self.t0, 1), **self.timing}


def _cluster_nodes(ray: Any) -> str:
    alive = [n for n in ray.nodes() if n["Alive"]]
    return f"{len(alive)} alive node(s): " + ", ".join(
        f"{n['NodeManagerAddress']} {({k: v for k, v in n['Resources'].items() if k in ('CPU', 'GPU')})}"
        for n in alive)


def _usable(ray: Any, bundle: dict[str, float], gone: set[str]) -> list[str]:
    """The ids of the alive nodes (not among ``gone``) whose resources hold ``bundle``."""
    return [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] not in gone
            and all(n["Resources"].get(k, 0) >= v for k, v in bundle.items())]


def _ranks_per_node(ray: Any, r: RayLaunch, nproc: int | None, gpus: bool) -> int:
    """``nproc`` as given, else one per GPU of the smallest GPU node (training on CUDA), else one
    per ``cpus_per_rank`` CPUs of the smallest node that has CPUs."""
    if nproc is not None:
        return nproc
    key = "GPU" if gpus else "CPU"
    sizes = [n["Resources"].get(key, 0) for n in ray.nodes() if n["Alive"] and n["Resources"].get(key, 0) > 0]
    if not sizes:
        raise LaunchError(f"the Ray cluster has no node with a {key} to train on: {_cluster_nodes(ray)}")
    return max(1, int(min(sizes) if gpus else min(sizes) // r.cpus_per_rank))


def _nodes_for(ray: Any, r: RayLaunch, bundle: dict[str, float], gone: set[str], wanted: int | None,
               wait_s: float, emit: Callable[[str], None]) -> int:
    """How many nodes the next attempt takes: ``wanted`` (first: ``launch.ray.nodes``, else
    every usable node) once that many are usable, waiting up to ``wait_s``; then what there is,
    if no fewer than ``min_nodes``."""
    deadline = time.monotonic() + wait_s
    said = False
    while True:
        usable = len(_usable(ray, bundle, gone))
        want = wanted or r.nodes or usable
        if usable >= want and want > 0:
            return want
        if time.monotonic() >= deadline:
            break
        if not said and wait_s > 0:
            emit(f"[sluice] ray: {usable} of {want} node(s) usable; waiting up to {wait_s:g}s for more\n")
            said = True
        time.sleep(1.0)
    if usable >= r.min_nodes and usable > 0 and not (r.nodes and wanted is None):
        return usable
    raise LaunchError(f"only {usable} node(s) of the Ray cluster can hold {bundle} (wanted {want}, "
                      f"launch.ray.min_nodes={r.min_nodes}) after waiting {wait_s:g}s; {_cluster_nodes(ray)}")


def _checkpoints_in(job: TrainJob, storage: str, out: Path) -> TrainJob:
    """``job`` with its checkpoints in object storage at ``storage``/<out_dir's name>-<hash of
    its path>/checkpoints (unless the job names a checkpoint_dir itself), once the storage is
    seen to take a write (its job.json: the run's record there too)."""
    if job.config.checkpoint_dir is not None:
        if paths.is_local(job.config.checkpoint_dir):
            raise ConfigError(f"train.checkpoint_dir={job.config.checkpoint_dir!r} is a local path, but with "
                              f"launch.ray.storage the nodes share no file system: leave checkpoint_dir unset "
                              "(the checkpoints then go to the storage) or make it a URL every node reaches")
        return job
    key = f"{out.name}-{hashlib.sha256(str(out.absolute()).encode()).hexdigest()[:8]}"
    base = paths.join(storage, key)
    try:
        write_json(paths.join(base, "job.json"), job.model_dump(mode="json"))
    except (ImportError, OSError) as e:
        raise ConfigError(f"launch.ray.storage={storage!r}: cannot write the run's files there ({e}); every "
                          "node needs its fsspec package (s3fs for s3://) and credentials in its environment") from e
    return job.model_copy(update={"config": job.config.model_copy(
        update={"checkpoint_dir": paths.join(base, "checkpoints")})})


def _fetch_checkpoint(directory: str | None, out: Path) -> str | None:
    """The run's last checkpoint copied from object storage into ``out``/checkpoints (what
    grading and the registry read); None when the run wrote none."""
    src = checkpoint_path(directory) if directory else None
    if not checkpoint_exists(src):
        return None
    dest = out / "checkpoints" / "last.pt"
    write_bytes(dest, paths.read_bytes(src))
    return str(dest)


def launch_ray(job: TrainJob | dict[str, Any], launch: LaunchConfig | dict[str, Any] | None = None,
               engine: EngineConfig | dict[str, Any] | None = None, nproc: int | None = None, *,
               out_dir: str | os.PathLike | None = None, timeout_s: float | None = None,
               env: dict[str, str] | None = None, on_line: Callable[[str], None] | None = None) -> TrainResult:
    """Run ``job`` on the nodes of the Ray cluster ``engine`` names (``engine.address``; none: one
    Sluice starts on 127.0.0.1), ``nproc`` ranks per node (None: one per GPU on CUDA, else per
    ``launch.ray.cpus_per_rank`` CPUs); return global rank 0's result, with every attempt in
    ``summary["launch"]``. ``out_dir`` must be one path every node sees, unless
    ``launch.ray.storage`` names object storage for the checkpoints (nodes sharing no file system).

    Raises ``LaunchError`` when Ray cannot place the ranks, too few nodes are left after a loss,
    more than ``max_node_losses`` nodes are lost, or the run fails or times out; ``TrainError``
    for a fatal error in the job (as ``launch``)."""
    cfg = launch if isinstance(launch, LaunchConfig) else LaunchConfig.model_validate(
        {"engine": "ray", **(launch or {})})
    if cfg.engine != "ray":
        raise ConfigError("launch_ray runs launch.engine: ray; torchrun's engine is launch() or launch_nodes()")
    if nproc is not None and nproc < 1:
        raise ConfigError(f"nproc must be >= 1, got {nproc}")
    r = cfg.ray
    emit = on_line or (lambda s: print(s, end="", flush=True))
    eng = engine if isinstance(engine, EngineConfig) else EngineConfig.model_validate(engine or {"name": "ray"})
    job = job if isinstance(job, TrainJob) else TrainJob.model_validate(job)
    if job.config.torch_threads is None:  # a rank uses the CPUs it reserved, not its node's every core
        job = job.model_copy(update={"config": job.config.model_copy(
            update={"torch_threads": max(1, int(r.cpus_per_rank))})})
    out = Path(out_dir) if out_dir is not None else None
    if r.storage:  # before anything is placed: the storage takes a write, or the run does not start
        if out is None:
            raise ConfigError("launch.ray.storage keeps a run's checkpoints under a key named after out_dir: "
                              "give out_dir (a retry of the same run then resumes from them)")
        job = _checkpoints_in(job, r.storage, out)
    t_join = time.monotonic()
    ray = connect(eng.model_copy(update={"name": "ray"}), lambda s: emit(f"[sluice] {s}\n"))
    join_s = round(time.monotonic() - t_join, 2)
    has_gpu = ray.cluster_resources().get("GPU", 0) > 0
    if job.config.device == "cuda" and not has_gpu:
        raise ConfigError(f"train.device: cuda, but the Ray cluster has no GPU: {_cluster_nodes(ray)}")
    gpus = has_gpu and job.config.device != "cpu"
    out, job_path, job = prepare_run(job, out)
    shipped = job.model_dump(mode="json") if r.storage else None  # sent to each agent: no file system shared
    per_node = _ranks_per_node(ray, r, nproc, gpus)
    bundle = {"CPU": per_node * r.cpus_per_rank, **({"GPU": float(per_node)} if gpus else {})}
    deadline = time.monotonic() + timeout_s if timeout_s else None
    attempts: list[dict[str, Any]] = []
    gone: set[str] = set()
    wanted: int | None = None
    while True:
        n = _nodes_for(ray, r, bundle, gone, wanted, r.replace_wait_s if attempts else r.place_timeout_s, emit)
        wanted = wanted or n
        attempt = _Attempt(ray, len(attempts), n, per_node, bundle, cfg, out, emit)
        outcome, node = "failed", None
        try:
            attempt.start(job_path, env or {}, shipped)
            write_json(out / NODES_FILE, {"attempts": attempts + [attempt.record("running", None)]})
            outcome, node = attempt.watch(deadline)
            if shipped is not None and outcome in ("done", "failed"):
                attempt.fetch_outcome()
        finally:
            attempt.close(node if outcome == "lost" else None)
            if attempt.where:
                attempts.append(attempt.record(outcome, node))
                write_json(out / NODES_FILE, {"attempts": attempts})
        if outcome != "lost":
            break
        w = attempt.where[node]
        gone.add(w["node_id"])
        losses = sum(a["ended"] == "lost" for a in attempts)
        if losses > r.max_node_losses:
            raise LaunchError(f"{losses} node(s) lost, more than launch.ray.max_node_losses={r.max_node_losses}; "
                              f"the checkpoints in {out} are kept. Attempts: {attempts}")
        emit(f"[sluice] ray: node {node} ({w['ip']}, {w['node_id'][:8]}) lost; the ranks restart from the last "
             "checkpoint on the nodes that remain\n")
    summary = {"engine": "ray", "join_s": join_s, "attempts": attempts, "node_losses": sum(a["ended"] == "lost" for a in attempts)}
    if outcome == "timeout":
        raise LaunchError(f"training exceeded timeout_s={timeout_s:g} and was stopped; its last checkpoint is "
                          f"kept. Logs: {out}/torchrun-node*.log")
    first = node if outcome == "failed" and node is not None else 0
    result = collect_result(out, 0 if outcome == "done" else (attempt.rcs[first] or 1), attempt.tails[first],
                            attempt.endpoint)
    if shipped is not None:
        summary["storage"] = job.config.checkpoint_dir
        result.checkpoint = _fetch_checkpoint(job.config.checkpoint_dir, out)
    result.summary["launch"] = summary
    write_json(out / RESULT, result.to_dict())
    return result
