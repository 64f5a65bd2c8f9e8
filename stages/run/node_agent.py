"""One node's torchrun: its command line (what ``launch_nodes`` runs on each listed node) and
``NodeAgent``, the Ray actor that runs it on a Ray node (``stages/run/ray_nodes.py``). Only the
standard library and the process rules: the Ray worker hosting an agent never imports torch, so
an agent starts in the time a Python process does, and its torchrun's ranks import torch once."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from sluice.process_rules import die_with_parent_preexec, stop_group
from sluice.stages.run.rendezvous import BACKEND as LOOPBACK_BACKEND

METRICS = "metrics.jsonl"
OUTCOME_FILES = ("result.json", "error.json")  # rank 0's result, a rank's fatal error (stages/train/rank.py)


def is_loopback(address: str) -> bool:
    """Whether ``address`` (an IP or host name, no port) is this machine's loopback."""
    return address.startswith("127.") or address in ("::1", "localhost")


def torchrun_env(interface: str | None) -> dict[str, str]:
    """What a node's torchrun runs with besides the caller's environment: a fresh workers'
    store per attempt (after a rank is killed the nodes can disagree on their restart counts)
    and, given the NIC, gloo and NCCL kept to it."""
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1"}
    if interface:
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = interface
    return env


def torchrun_argv(python: str, job_path: Path | str, nnodes: int, nproc: int, endpoint: str, run_id: str,
                  local_addr: str | None, is_host: bool | None, timeout_s: float, max_restarts: int) -> list[str]:
    """One node's torchrun, joined to the others by torchrun's c10d rendezvous at ``endpoint``
    (hosted by the node with ``is_host``; None: torchrun decides from the addresses); what
    ``launch`` runs on this machine, ``launch_nodes`` on each listed node and a Ray node agent
    on its node. A lone node on a loopback address keeps every store on loopback
    (``rendezvous.py``'s backend: torchrun's own c10d stores listen on every interface)."""
    t = int(timeout_s)
    alone = nnodes == 1 and is_loopback(local_addr or endpoint.rsplit(":", 1)[0])
    runner = "sluice.stages.run.rendezvous" if alone else "torch.distributed.run"
    conf = f"join_timeout={t},read_timeout={t}"
    if is_host is not None and not alone:
        conf = f"is_host={int(is_host)},{conf}"
    # no --node-rank: the c10d rendezvous assigns node ranks (global rank 0 may be on any node)
    return [python, "-m", runner, "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
            "--rdzv-backend", LOOPBACK_BACKEND if alone else "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-id", run_id, *(["--local-addr", local_addr] if local_addr else []), "--rdzv-conf", conf,
            "--max-restarts", str(max_restarts),
            "-m", "sluice.stages.train.rank", "--job", str(job_path)]


def interface_of(ip: str) -> str | None:
    """The network interface that holds ``ip`` on this machine (what gloo and NCCL should use):
    ``lo`` for a loopback address; None when no interface holds it (they then resolve the host
    name, as without Sluice)."""
    if is_loopback(ip):
        return "lo"
    try:
        import psutil  # where it is installed: every address family
        return next((name for name, addrs in psutil.net_if_addrs().items()
                     if any(a.address.split("%")[0] == ip for a in addrs)), None)
    except ImportError:
        pass
    if ":" in ip:
        return None
    import fcntl
    import struct
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # IPv4: each interface's address
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == ip:
                return name
    return None


class NodeAgent:
    """One node's torchrun, run and watched by a Ray actor placed on that node. The command is
    built here from typed values, with this node's own Python and address; nothing in it comes
    from a string a config could fill with a command.

    On nodes that share no file system (``launch.ray.storage``) the driver sends the job itself:
    the agent runs it from a local directory of its own, streams rank 0's metrics lines back with
    its output (``poll``) and hands over the result or error file at the end (``outcome``)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []
        self._reader: threading.Thread | None = None
        self.workdir: Path | None = None  # a local run directory (nodes sharing no file system)
        self._metrics_at = 0  # bytes of the local metrics file already sent

    def where(self) -> dict[str, Any]:
        """This node: its Ray address and node id, the host name, and a port free on the address
        (agent 0's torchrun hosts the rendezvous there)."""
        import ray
        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
        return {"ip": ip, "node_id": ray.get_runtime_context().get_node_id(), "host": socket.gethostname(),
                "port": port, "pid": os.getpid()}

    def start(self, job_path: str, nnodes: int, nproc: int, endpoint: str, run_id: str, is_host: bool,
              timeout_s: float, max_restarts: int, env: dict[str, str], job: dict[str, Any] | None = None) -> str:
        """Start this node's torchrun (its own session, tied to this actor: it stops with it) on
        ``job_path``, or, given ``job``, on a copy in a new local directory whose metrics file is
        local too. Returns the job file the ranks read."""
        import ray
        if job is not None:
            self.workdir = Path(tempfile.mkdtemp(prefix="sluice-node-"))
            config = {**job["config"], "metrics_path": str(self.workdir / METRICS)}
            job_path = str(self.workdir / "job.json")
            Path(job_path).write_text(json.dumps({**job, "config": config}))
        ip = ray.util.get_node_ip_address()
        cmd = torchrun_argv(sys.executable, job_path, nnodes, nproc, endpoint, run_id, ip, is_host,
                            timeout_s, max_restarts)
        full = {**torchrun_env(interface_of(ip)), **os.environ, **env}  # a NIC set on the node or by the caller wins
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full,
                                     start_new_session=True, preexec_fn=die_with_parent_preexec())
        self._reader = threading.Thread(target=self._read, name="torchrun-output", daemon=True)
        self._reader.start()
        return job_path

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def poll(self, since: int) -> tuple[list[str], int | None, list[str]]:
        """The output lines after the first ``since``, torchrun's exit code (None: running), and
        the local metrics file's new whole lines (rank 0's, on a node that runs from its own
        directory; else none)."""
        rc = self.proc.poll() if self.proc is not None else None
        if rc is not None and self._reader is not None:
            self._reader.join(5)  # every line in before the exit code is reported
        return self.lines[since:], rc, self._new_metrics()

    def _new_metrics(self) -> list[str]:
        f = self.workdir / METRICS if self.workdir is not None else None
        if f is None or not f.exists():
            return []
        with open(f, "rb") as fh:
            fh.seek(self._metrics_at)
            data = fh.read()
        whole = data[:data.rfind(b"\n") + 1]  # a line still being written waits for the next poll
        self._metrics_at += len(whole)
        return whole.decode().splitlines(keepends=True)

    def outcome(self) -> dict[str, str]:
        """The run's result and error files in this node's local directory, by name (those there)."""
        if self.workdir is None:
            return {}
        return {name: (self.workdir / name).read_text() for name in OUTCOME_FILES if (self.workdir / name).exists()}

    def stop(self) -> int | None:
        """Stop torchrun and its ranks if they still run, remove the local run directory; their
        exit code."""
        rc = None
        if self.proc is not None:
            if self.proc.poll() is None:
                stop_group(self.proc)
            rc = self.proc.poll()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return rc
