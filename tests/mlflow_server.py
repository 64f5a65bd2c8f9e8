"""A real ``mlflow server`` on loopback for the tracking tests: full MLflow from its own
virtualenv (``.venv-mlflow``, made by ``make setup``: its pins clash with this project's), a SQLite
store and an artifacts folder of the test's own, one worker, no job runner. Stop and start it again
on the same store and port to stage an outage."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from sluice.process_rules import stop_group

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("SLUICE_MLFLOW_VENV", ROOT / ".venv-mlflow"))


def missing() -> str | None:
    """Why no server can start here (None when it can)."""
    if not (VENV / "bin" / "mlflow").is_file():
        return f"no MLflow server at {VENV}/bin/mlflow: `make setup` (scripts/setup.sh) installs it"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    def __init__(self, folder: Path, port: int | None = None):
        self.folder, self.port = folder, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        folder.mkdir(parents=True, exist_ok=True)

    def start(self, timeout: float = 120.0) -> "MlflowServer":
        # no telemetry from the server or, through it, from the UI the browser test loads
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
               "DO_NOT_TRACK": "true"}
        env.pop("MLFLOW_TRACKING_URI", None)
        cmd = [str(VENV / "bin" / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port),
               "--backend-store-uri", f"sqlite:///{self.folder / 'mlflow.db'}",
               "--artifacts-destination", str(self.folder / "artifacts"), "--workers", "1"]
        log = open(self.folder / "server.log", "a")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.folder,
                                     start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited ({self.proc.returncode}): "
                                   + (self.folder / "server.log").read_text()[-3000:])
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"mlflow server did not answer /health in {timeout:.0f} s: "
                           + (self.folder / "server.log").read_text()[-3000:])

    def stop(self) -> None:
        """The server and every process it started (its own process group), gone."""
        if self.proc is None:
            return
        stop_group(self.proc, grace_s=20)
        self.proc.wait(10)
        self.proc = None
