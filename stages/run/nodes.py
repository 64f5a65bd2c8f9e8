"""Training across several nodes from one call: the node list is configuration, and
``launch_nodes`` starts one torchrun per node, joined by torchrun's c10d rendezvous on node 0.

A node is an address (what its ranks advertise; node 0's hosts the rendezvous and the workers'
store), optionally a network namespace to run in (the simulated cluster of
``deploy/simcluster``), the NIC gloo/NCCL use, and the cores its processes are pinned to.
Nothing in a node names a command: the launcher runs ``ip netns exec`` and ``taskset`` itself,
with validated names, so a config (or a Prefect parameter) cannot make it run anything else.
Nodes elsewhere on a real network run ``deploy/torchrun-multinode.sh`` with the same job.

What listens where (multi-node only; one node keeps to loopback, see ``launch``): node 0's
torchrun agent hosts the rendezvous store on ``rdzv_port`` (all interfaces of node 0); global
rank 0 hosts the workers' store on a free port of node 0's address, a new one per restart; gloo
opens ports on each node's ``interface``. Restrict them with a firewall to the nodes' subnet.

The workers' store is per attempt (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): after a rank is
killed the nodes can disagree on their restart counts, so keys prefixed by the count (the
single-node scheme in ``dist.py``) would not meet; a fresh store per attempt needs no prefix.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sluice.errors import ConfigError, LaunchError, RendezvousError
from sluice.stages.train.job import TrainJob
from sluice.process_rules import die_with_parent_preexec, stop_group
from sluice.stages.run.launch import collect_result, prepare_run
from sluice.stages.run.node_agent import torchrun_argv, torchrun_env
from sluice.stages.train.rank import TrainResult

NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
RDZV_ERRORS = ("RendezvousTimeoutError", "RendezvousConnectionError", "RendezvousClosedError")


class NodeSpec(BaseModel):
    """One machine of the cluster, as the launcher reaches it."""
    model_config = ConfigDict(extra="forbid")
    address: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,252}$",
                         description="IP or host name the node's ranks advertise; node 0's "
                                     "hosts the rendezvous")
    netns: str | None = Field(None, pattern=NAME,
                              description="run the node's processes in this network namespace "
                                          "(a simulated node); needs root")
    interface: str | None = Field(None, pattern=r"^[A-Za-z0-9_.:-]{1,15}$",
                                  description="the NIC gloo/NCCL use (GLOO_SOCKET_IFNAME)")
    cpus: str | None = Field(None, pattern=r"^[0-9]+([,-][0-9]+)*$",
                             description="pin the node's processes to these cores (taskset -c)")

    def core_count(self) -> int | None:
        """How many cores ``cpus`` names (``0-2,5`` -> 4); None when the node is not pinned."""
        if not self.cpus:
            return None
        spans = [part.split("-") for part in self.cpus.split(",")]
        return sum(int(s[-1]) - int(s[0]) + 1 for s in spans)


class RayLaunch(BaseModel):
    """``launch.ray``: how training takes the nodes of a Ray cluster (``launch.engine: ray``)."""
    model_config = ConfigDict(extra="forbid")
    nodes: int | None = Field(None, ge=1, description="how many nodes train (one node agent each); none: every "
                              "alive node that can hold one node's ranks")
    min_nodes: int = Field(1, ge=1, description="after a node is lost, go on with no fewer nodes than this")
    cpus_per_rank: float = Field(1.0, gt=0, description="CPUs each rank reserves on its node")
    replace_wait_s: float = Field(30.0, ge=0, description="after a node is lost, how long to wait for a "
                                  "replacement before resuming on the nodes left")
    node_lost_s: float = Field(60.0, gt=0, description="a node agent that does not answer for this long is "
                               "taken as lost")
    max_node_losses: int = Field(3, ge=0, description="node losses a run survives (each one: a restart "
                                 "from the last checkpoint)")
    place_timeout_s: float = Field(120.0, gt=0, description="how long to wait for Ray to place the nodes' ranks")
    storage: str | None = Field(None, description="for nodes that share no file system: an fsspec URL every "
                                "node reaches (s3://bucket/prefix; credentials from each node's environment) "
                                "that holds the run's checkpoints, under a key named after out_dir; each node "
                                "runs from a local directory of its own and rank 0's metrics and result come "
                                "back to out_dir. None: out_dir is one path every node sees")

    @field_validator("storage")
    @classmethod
    def _a_url(cls, v: str | None) -> str | None:
        if v is not None and "://" not in v:
            raise ValueError(f"launch.ray.storage is where nodes that share no file system keep the checkpoints: "
                             f"an fsspec URL such as s3://bucket/prefix, got {v!r} (a path every node sees is "
                             "out_dir itself: leave storage unset)")
        return v.rstrip("/") if v else v


class LaunchConfig(BaseModel):
    """Where training runs: this machine (no nodes), the listed nodes, or a Ray cluster's nodes."""
    model_config = ConfigDict(extra="forbid")
    engine: Literal["torchrun", "ray"] = Field(
        "torchrun", description="torchrun: this machine, or one torchrun per launch.nodes; ray: the nodes of "
        "the Ray cluster at engine.address (a node agent per node runs its torchrun, stages/run/ray_nodes.py)")
    nodes: list[NodeSpec] = Field(default_factory=list,
                                  description="empty: this machine only (rendezvous on loopback)")
    rdzv_port: int = Field(29400, ge=1, le=65535, description="node 0's rendezvous port (engine: ray picks "
                           "a free one on node 0)")
    rdzv_timeout_s: float = Field(120.0, gt=0, description="how long nodes wait for each other")
    max_restarts: int = Field(0, ge=0, description="torchrun restarts after a rank dies; the job "
                                                   "resumes from its last checkpoint")
    ray: RayLaunch = Field(default_factory=RayLaunch)

    @model_validator(mode="after")
    def _distinct(self) -> "LaunchConfig":
        seen = [n.address for n in self.nodes]
        if self.engine == "ray" and seen:
            raise ValueError("launch.engine: ray places the ranks on the Ray cluster's nodes itself: leave "
                             "launch.nodes empty (or use engine: torchrun with the node list)")
        if len(seen) == 1:
            raise ValueError("launch.nodes lists one node: leave it empty to train on this "
                             "machine, or list every node (node 0 first)")
        if len(set(seen)) != len(seen):
            raise ValueError(f"node addresses must differ, got {seen}")
        return self


def node_command(node: NodeSpec, torchrun: list[str]) -> list[str]:
    """``torchrun`` as run on ``node``: inside its namespace, pinned to its cores."""
    prefix: list[str] = []
    if node.netns:
        prefix += ["ip", "netns", "exec", node.netns]
    if node.cpus:
        prefix += ["taskset", "-c", node.cpus]
    return prefix + torchrun


def node_torchrun(job_path: Path, launch: LaunchConfig, index: int, nproc: int,
                  run_id: str) -> list[str]:
    """The torchrun command line of node ``index`` (it hosts the rendezvous when 0)."""
    nodes = launch.nodes
    return torchrun_argv(sys.executable, job_path, len(nodes), nproc,
                         f"{address_in_url(nodes[0].address)}:{launch.rdzv_port}", run_id, nodes[index].address,
                         index == 0, launch.rdzv_timeout_s, launch.max_restarts)


def node_env(node: NodeSpec) -> dict[str, str]:
    """What the node's torchrun runs with besides the caller's environment."""
    return torchrun_env(node.interface)


def address_in_url(address: str) -> str:
    """An address as it goes before ``:port`` (IPv6 in brackets)."""
    return f"[{address}]" if ":" in address else address


def launch_nodes(job: TrainJob | dict[str, Any], launch: LaunchConfig | dict[str, Any],
                 nproc: int = 1, *, out_dir: str | os.PathLike | None = None,
                 timeout_s: float | None = None, env: dict[str, str] | None = None,
                 on_line: Callable[[str], None] | None = None) -> TrainResult:
    """Run ``job`` with ``nproc`` ranks on each node of ``launch.nodes``; return global rank 0's
    result. ``out_dir`` must be the same path on every node (here: one machine); it receives
    ``job.json``, the checkpoints, metrics, ``result.json`` and ``torchrun-node<i>.log``.

    Raises ``RendezvousError`` naming the node(s) and address when nodes do not all join within
    ``rdzv_timeout_s``, ``TrainError`` for a fatal error in the job, ``LaunchError`` otherwise.
    """
    cfg = launch if isinstance(launch, LaunchConfig) else LaunchConfig.model_validate(launch)
    if len(cfg.nodes) < 2:
        raise ConfigError("launch_nodes needs at least two nodes; one machine uses launch()")
    if nproc < 1:
        raise ConfigError(f"nproc must be >= 1, got {nproc}")
    if any(n.netns for n in cfg.nodes) and os.geteuid() != 0:
        raise ConfigError("nodes with netns (a simulated cluster) need root to enter namespaces")
    out, job_path, _ = prepare_run(job, out_dir)
    run_id = f"sluice-{uuid.uuid4().hex[:8]}"
    emit = on_line or (lambda s: print(s, end="", flush=True))
    runs = [_NodeRun(i, n, node_command(n, node_torchrun(job_path, cfg, i, nproc, run_id)),
                     out / f"torchrun-node{i}.log", {**os.environ, **(env or {}), **node_env(n)},
                     emit) for i, n in enumerate(cfg.nodes)]
    endpoint = f"{address_in_url(cfg.nodes[0].address)}:{cfg.rdzv_port}"
    try:
        for r in runs:
            r.start()
        _wait(runs, timeout_s, grace_s=cfg.rdzv_timeout_s + 30)
    finally:
        for r in runs:
            r.stop()
    if any(r.timed_out for r in runs):
        raise LaunchError(f"training exceeded timeout_s={timeout_s:g} and was stopped. Logs: "
                          + ", ".join(str(r.log) for r in runs))
    failed = [r for r in runs if r.rc not in (0, None)]
    if failed and not (out / "error.json").exists():
        _raise_rendezvous(failed, endpoint, cfg.rdzv_timeout_s)
    first = failed[0] if failed else runs[0]
    return collect_result(out, first.rc or 0, first.tail, endpoint)


def _raise_rendezvous(failed: list["_NodeRun"], endpoint: str, timeout_s: float) -> None:
    """A ``RendezvousError`` naming each node that could not join, and why, if that is what
    the failed nodes' logs say."""
    said = []
    for r in failed:
        text = "".join(r.tail)
        if "RendezvousConnectionError" in text:
            said.append(f"node {r.index} ({r.node.address}) cannot reach the rendezvous at {endpoint}")
        elif any(e in text for e in RDZV_ERRORS):
            said.append(f"node {r.index} ({r.node.address}) waited {timeout_s:g}s at {endpoint} "
                        "for nodes that never joined")
    if said:
        raise RendezvousError("; ".join(said) + ". Log tail:\n" + "".join(failed[-1].tail)[-3000:])


def _wait(runs: list["_NodeRun"], timeout_s: float | None, grace_s: float) -> None:
    """Until every node's torchrun ends, the timeout passes, or one node failed ``grace_s``
    ago and the others still run (they would wait for it forever)."""
    deadline = time.monotonic() + timeout_s if timeout_s else None
    first_fail: float | None = None
    while any(r.running() for r in runs):
        now = time.monotonic()
        if deadline is not None and now > deadline:
            for r in runs:
                r.timed_out = r.running()
            return
        if first_fail is None and any(r.rc not in (0, None) for r in runs):
            first_fail = now
        if first_fail is not None and now - first_fail > grace_s:
            return
        time.sleep(0.2)


class _NodeRun:
    """One node's torchrun: its process, its log and the last lines of its output."""

    def __init__(self, index: int, node: NodeSpec, cmd: list[str], log: Path,
                 env: dict[str, str], emit: Callable[[str], None]):
        self.index, self.node, self.cmd, self.log, self.env, self.emit = index, node, cmd, log, env, emit
        self.proc: subprocess.Popen | None = None
        self.tail: list[str] = []
        self.rc: int | None = None
        self.timed_out = False
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=self.env, start_new_session=True,
                                     preexec_fn=die_with_parent_preexec())
        self._reader = threading.Thread(target=self._read, name=f"node{self.index}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with open(self.log, "a") as f:
            for line in self.proc.stdout:
                f.write(line)
                f.flush()
                self.emit(f"[node {self.index}] {line}")
                self.tail = (self.tail + [line])[-60:]
        self.rc = self.proc.wait()

    def running(self) -> bool:
        return self.proc is not None and (self.proc.poll() is None or
                                          (self._reader is not None and self._reader.is_alive()))

    def stop(self) -> None:
        """Stop this node's torchrun and its workers if still running; collect its exit code."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            stop_group(self.proc)
        if self._reader is not None:
            self._reader.join(15)
        if self.rc is None:
            self.rc = self.proc.poll()
