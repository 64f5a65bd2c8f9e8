"""Start training from Python (what the flows call) and return rank 0's
:class:`~sluice.stages.train.rank.TrainResult`: one rank trains in this process; several run
under ``torchrun``, whose logs are streamed.

The job is a typed ``TrainJob`` (config, data specs, selection spec), validated here before
anything starts, so a bad field or an unknown model/method/hook fails in the caller.

Single node: torchrun's rendezvous on ``127.0.0.1:<free port>`` with every socket it and the
workers open on loopback (``rendezvous.py``: torchrun's own c10d stores listen on every
interface). Several nodes: every node calls ``launch`` with the same ``Rendezvous`` endpoint
(node 0's address) and ``nnodes``; node 0 hosts torchrun's c10d rendezvous, which listens on all
of node 0's interfaces (the README's security section lists every port; ``env`` can pin the
collectives to one interface with ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``). A node that
cannot reach the endpoint fails within the rendezvous's ``timeout_s`` with an error naming the
address. ``max_restarts`` lets torchrun restart all
workers after one dies (``kill -9``); they resume from the last checkpoint in ``out_dir``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import torch
from pydantic import ValidationError

from sluice.errors import ConfigError, LaunchError, RendezvousError, SluiceError, TrainError
from sluice.stages.contracts import PassThroughLoader
from sluice.stages.load.augment import Normalize
from sluice.stages.load.specs import DataSpec
from sluice.process_rules import die_with_parent_preexec, stop_group
from sluice.stages.select.spec import SelectionSpec
from sluice.stages.train.config import TrainConfig
from sluice.stages.train.job import TrainJob
from sluice.stages.run.node_agent import is_loopback, torchrun_argv
from sluice.stages.train.rank import FATAL, JOB, RESULT, TrainResult, run_rank
from sluice.storage.atomic import write_json

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on ``host`` right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_reachable(host: str, port: int, timeout_s: float) -> None:
    """Block until ``host:port`` accepts a TCP connection, or raise ``RendezvousError``."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, timeout_s)):
                return
        except OSError as e:
            last = e
            time.sleep(0.5)
    raise RendezvousError(f"cannot reach the rendezvous at {host}:{port} within {timeout_s:g}s "
                          f"({last}); is node 0 running and the port open?")


def torchrun_command(job: Path, nproc: int, endpoint: str, nnodes: int, max_restarts: int,
                     run_id: str, rdzv_timeout_s: float) -> list[str]:
    """The torchrun command line for one node: on one machine, torchrun with every socket on
    loopback (``rendezvous.py``); across machines, torchrun's own c10d rendezvous."""
    local_addr = LOOPBACK if is_loopback(endpoint.rsplit(":", 1)[0]) else None
    return torchrun_argv(sys.executable, job, nnodes, nproc, endpoint, run_id, local_addr, None,
                         rdzv_timeout_s, max_restarts)


def _loopback_env(nnodes: int, endpoint: str) -> dict[str, str]:
    """On one machine the collectives (gloo, NCCL's bootstrap) listen on loopback too."""
    if nnodes == 1 and is_loopback(endpoint.rsplit(":", 1)[0]):
        return {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    return {}


def make_job(config: TrainConfig | dict[str, Any], data: DataSpec | dict[str, Any],
             eval_data: DataSpec | dict[str, Any] | None = None,
             selection: SelectionSpec | dict[str, Any] | None = None) -> TrainJob:
    """A validated, complete ``TrainJob`` from its parts (typed or dicts of the same shape); a bad
    field, or a name no registry knows, is a ConfigError naming it."""
    return as_job({"config": config, "data": data, "eval_data": eval_data, "selection": selection})


def as_job(job: TrainJob | dict[str, Any]) -> TrainJob:
    """``job`` validated and complete: what a data spec leaves to the job (an arrays spec's batch
    size, seed and normalisation) filled in from its train config, once, before anything runs."""
    if not isinstance(job, TrainJob):
        try:
            job = TrainJob.model_validate(job)
        except ValidationError as e:
            raise ConfigError(f"invalid training job: {e}") from None
    c = job.config
    unresolved = [k for k in ("model", "input_size") if getattr(c, k) == "auto"]
    if unresolved:
        raise ConfigError(f"train.{' and train.'.join(unresolved)}: auto is resolved from the data by the pipeline "
                          "(its kind of data, stages/kinds); a job of your own gives the value")
    norm = None  # auto: resolved by the pipeline; a spec that normalises with the job's (arrays) refuses it
    if c.normalize_mean != "auto" and c.normalize_std != "auto":
        norm = Normalize(mean=c.normalize_mean, std=c.normalize_std)
    return job.model_copy(update={
        "data": job.data.completed(c.batch_size, c.seed, norm, train=True),
        "eval_data": job.eval_data.completed(c.batch_size, c.seed, norm, train=False) if job.eval_data else None})


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """Where the nodes of a several-node run meet: every node passes the same ``endpoint``
    (node 0's ``host:port``, where torchrun's c10d store listens) and ``nnodes``, and its own
    ``node_rank``; a node that cannot reach the endpoint fails within ``timeout_s``."""
    endpoint: str
    nnodes: int = 2
    node_rank: int = 0
    timeout_s: float = 60.0


def launch(job: TrainJob | dict[str, Any], nproc: int = 2, *, out_dir: str | os.PathLike | None = None,
           max_restarts: int = 0, timeout_s: float | None = None, on_line: Callable[[str], None] | None = None,
           isolate: bool = False, env: dict[str, str] | None = None,
           rendezvous: Rendezvous | None = None) -> TrainResult:
    """Run ``job`` with ``nproc`` ranks on this node; return rank 0's result. One rank on one node
    trains in this process (no torchrun, no second ``import torch``) unless ``isolate``; several
    run under torchrun, on this node alone (a loopback rendezvous) or with the other nodes of
    ``rendezvous``.

    ``out_dir`` (default: a new temp directory) receives ``job.json``, ``checkpoints/``,
    ``metrics.jsonl``, ``result.json`` and, under torchrun, ``torchrun.log``; launching again on
    the same ``out_dir`` resumes from its checkpoint. ``env`` is for torchrun's workers.
    """
    job = as_job(job)
    meet = rendezvous or Rendezvous(f"{LOOPBACK}:{free_port()}" if nproc > 1 or isolate else "", nnodes=1)
    if nproc < 1 or meet.nnodes < 1:
        raise ConfigError(f"nproc and nnodes must be >= 1, got {nproc}, {meet.nnodes}")
    if nproc == 1 and meet.nnodes == 1 and not isolate:
        return run_in_process(job, out_dir, timeout_s=timeout_s, max_restarts=max_restarts, on_line=on_line)
    host, _, port = meet.endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"the rendezvous endpoint must be 'host:port' (node 0's address), got {meet.endpoint!r}")
    if meet.node_rank > 0:  # node 0 hosts the store; the others must reach it in bounded time
        wait_reachable(host, int(port), meet.timeout_s)
    out, job_path, _ = prepare_run(job, out_dir)
    run_id = f"sluice-{uuid.uuid4().hex[:8]}" if meet.nnodes == 1 else f"sluice-{port}"
    cmd = torchrun_command(job_path, nproc, meet.endpoint, meet.nnodes, max_restarts, run_id, meet.timeout_s)
    rc, tail = _run(cmd, out / "torchrun.log", timeout_s,
                    {**_loopback_env(meet.nnodes, meet.endpoint), **(env or {})}, on_line)
    return collect_result(out, rc, tail, meet.endpoint)


def run_in_process(job: TrainJob | dict[str, Any], out_dir: str | os.PathLike | None = None, *,
                   timeout_s: float | None = None, max_restarts: int = 0,
                   on_line: Callable[[str], None] | None = None) -> TrainResult:
    """One rank in this process: the same rank entry and files as a torchrun worker's. A
    ``SluiceError`` ends the run (``error.json``, raised as ``TrainError`` naming rank 0 as
    torchrun's path does); any other exception is a crash, retried from the last checkpoint up to
    ``max_restarts`` times. ``timeout_s`` is checked between batches: past it the run stops with
    ``LaunchError``, its checkpoints kept."""
    out, _, job = prepare_run(job, out_dir)  # with its checkpoint and metrics paths filled in
    emit = on_line or (lambda s: print(s, end="", flush=True))
    deadline = time.monotonic() + timeout_s if timeout_s else None
    wrap = (lambda loader: TimeLimited(loader, deadline, timeout_s)) if deadline else None
    threads = torch.get_num_threads()
    attempt = 0
    try:
        while True:
            try:
                result = run_rank(job, out, wrap_loader=wrap)
                write_json(out / RESULT, result.to_dict())
                return result
            except LaunchError:
                raise
            except SluiceError as e:
                write_json(out / FATAL, {"type": type(e).__name__, "message": str(e), "rank": 0})
                raise TrainError(f"{type(e).__name__} (rank 0): {e}") from e
            except Exception as e:  # noqa: BLE001 - a crash: resume from the checkpoint, as torchrun would
                if attempt == max_restarts:
                    raise LaunchError(f"training crashed in-process: {type(e).__name__}: {e}") from e
                attempt += 1
                emit(f"[sluice] training crashed ({type(e).__name__}: {e}); restart {attempt} of "
                     f"{max_restarts} from the last checkpoint\n")
    finally:
        torch.set_num_threads(threads)  # the rank took every core; this process keeps its own setting


class TimeLimited(PassThroughLoader):
    """A train loader that stops the run once ``deadline`` (monotonic) passes, between batches:
    the in-process stand-in for the torchrun watchdog. Everything else is the loader's."""

    def __init__(self, loader: Any, deadline: float, timeout_s: float):
        super().__init__(loader)
        self.deadline, self.timeout_s = deadline, timeout_s

    def __iter__(self):
        for batch in self.loader:
            if time.monotonic() > self.deadline:
                raise LaunchError(f"training exceeded timeout_s={self.timeout_s:g} and was stopped; "
                                  "its last checkpoint is kept")
            yield batch


def prepare_run(job: TrainJob | dict[str, Any], out_dir: str | os.PathLike | None) -> tuple[Path, Path, TrainJob]:
    """Validate ``job``, point its checkpoints and metrics into ``out_dir`` (default: a new
    temp directory) unless set, clear the last attempt's result and error, and write
    ``job.json`` (what torchrun's workers read, and the run's record); returns (out_dir,
    job.json, the job as written)."""
    job = as_job(job)
    cfg = job.config
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="sluice-train-"))
    out.mkdir(parents=True, exist_ok=True)
    updates: dict[str, Any] = {}
    if cfg.checkpoint_dir is None:
        updates["checkpoint_dir"] = str(out / "checkpoints")
    if cfg.metrics_path is None:
        updates["metrics_path"] = str(out / "metrics.jsonl")
    job = job.model_copy(update={"config": cfg.model_copy(update=updates)})
    for stale in (FATAL, RESULT):
        with contextlib.suppress(FileNotFoundError):
            (out / stale).unlink()
    job_path = out / JOB
    write_json(job_path, job.model_dump(mode="json"))
    return out, job_path, job


def _run(cmd: list[str], log: Path, timeout_s: float | None, env: dict[str, str] | None,
         on_line: Callable[[str], None] | None) -> tuple[int, list[str]]:
    """Run torchrun, copy its output to ``log`` and ``on_line`` (default: stdout)."""
    full_env = {**os.environ, **(env or {})}
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    emit = on_line or (lambda s: print(s, end="", flush=True))
    tail: list[str] = []
    with open(log, "a") as f, subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
            # Its own session, so a timeout can stop torchrun's whole group; tied to this process,
            # so a kill -9 of the flow does not leave it training as an orphan (on SIGTERM
            # torchrun stops its workers).
            start_new_session=True, preexec_fn=die_with_parent_preexec()) as p:
        watchdog = threading.Timer(timeout_s, _time_out, args=(p,)) if timeout_s else None
        if watchdog is not None:
            watchdog.daemon = True
            watchdog.start()
        try:
            assert p.stdout is not None
            for line in p.stdout:
                f.write(line)
                emit(line)
                tail = (tail + [line])[-60:]
            rc = p.wait()
        except BaseException:  # e.g. KeyboardInterrupt: do not leave workers behind
            stop_group(p)
            raise
        finally:
            if watchdog is not None:
                watchdog.cancel()
        if getattr(p, "_sluice_timed_out", False):
            raise LaunchError(f"training exceeded timeout_s={timeout_s:g} and was stopped. "
                              f"Log: {log}")
    return rc, tail


def _time_out(p: subprocess.Popen) -> None:
    """The watchdog: mark torchrun as timed out, then stop it and its workers."""
    p._sluice_timed_out = True  # type: ignore[attr-defined]
    stop_group(p)


def collect_result(out: Path, rc: int, tail: list[str], endpoint: str) -> TrainResult:
    """Rank 0's result in ``out``, or the error that ended the run (``error.json``, a failed
    rendezvous, torchrun's exit code) raised; also ``launch_nodes``' ending."""
    fatal = out / FATAL
    if fatal.exists():
        e = json.loads(fatal.read_text())
        raise TrainError(f"{e['type']} (rank {e['rank']}): {e['message']}")
    if rc != 0:
        text = "".join(tail)
        if "RendezvousTimeoutError" in text or "RendezvousConnectionError" in text:
            raise RendezvousError(f"rendezvous at {endpoint} failed (not all nodes joined in "
                                  f"time or the address is unreachable). Log tail:\n{text[-3000:]}")
        raise LaunchError(f"torchrun exited with code {rc}. Log tail:\n{text[-3000:]}")
    if not (out / RESULT).exists():
        raise LaunchError(f"torchrun succeeded but rank 0 wrote no {out / RESULT}")
    return TrainResult.from_dict(json.loads((out / RESULT).read_text()))
