"""A real Prefect server (and the processes a test adds beside it: a worker), each in its own
process group, on a free port of 127.0.0.1, with its own PREFECT_HOME. Shared by the deployment
tests and the browser test (``prefect_server`` in conftest: one server per test session)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from conftest import ROOT

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(url: str, path: str, body: dict | None = None):
    req = urllib.request.Request(url + path, data=json.dumps(body or {}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST" if body is not None else "GET")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read() or "null")


class Stack:
    """A Prefect server (with its UI when ``ui``) and what a test spawns beside it, each in its
    own process group."""

    def __init__(self, home: Path, ui: bool = True):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.base}/api"
        self.env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": self.url,
                    "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": str(ui).lower(),
                    "PREFECT_WORKER_QUERY_SECONDS": "2", "SLUICE_PROJECT_DIR": str(ROOT),
                    "PYTHONPATH": str(ROOT)}
        self.procs: list[subprocess.Popen] = []
        self.logs = home

    def spawn(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "w")
        p = subprocess.Popen([str(BIN / "prefect"), *args], env=self.env, cwd=ROOT, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        return p

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "prefect"), *args], env=self.env, cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout)

    def start(self) -> None:
        self.spawn("server", "server", "start", "--host", "127.0.0.1", "--port", str(self.port))
        deadline = time.time() + 240
        while time.time() < deadline:
            try:
                if api(self.url, "/health") is True:
                    return
            except OSError:
                pass
            if self.procs[0].poll() is not None:
                break
            time.sleep(1)
        raise RuntimeError("prefect server did not become healthy:\n" + (self.logs / "server.log").read_text()[-3000:])

    def stop(self, *procs: subprocess.Popen) -> None:
        """Stop ``procs`` (default: everything, the server last) and their process groups."""
        procs = procs or tuple(reversed(self.procs))
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def run_deployment(self, name: str, config: dict, timeout: float = 600) -> tuple[str, str]:
        r = self.cli("deployment", "run", name, "--params", json.dumps({"config": config}), "--watch",
                     "--watch-timeout", str(int(timeout)), timeout=timeout + 60)
        out = r.stdout + r.stderr
        run_id = next((line.split()[-1] for line in out.splitlines() if "UUID:" in line), "")
        state = api(self.url, f"/flow_runs/{run_id}")["state"]["type"] if run_id else "UNKNOWN"
        if state != "COMPLETED" and run_id:
            out += "\n--- the flow run's own log (errors first) ---\n" + self.flow_run_log(run_id)
        return state, out

    def flow_run_log(self, run_id: str, limit: int = 200) -> str:
        """The run's log as the server holds it, warnings and errors first: where the reason a
        run failed is (``deployment run --watch`` prints only state changes)."""
        logs = api(self.url, "/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}},
                                               "sort": "TIMESTAMP_ASC", "limit": limit})
        ordered = sorted(logs, key=lambda r: -r["level"])
        return "\n".join(f"{r['level']} {r['message']}" for r in ordered)[:6000]  # keep the errors


