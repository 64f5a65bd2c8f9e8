"""A real S3-protocol server for the tests (moto's standalone server, in its own process on
127.0.0.1): started, waited for, and its address; what the object-storage tests and the Ray
training run on nodes sharing no file system both reach through s3fs."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_s3_server(log: Path) -> tuple[subprocess.Popen, int]:
    """moto's server on a free loopback port, once it takes connections; its request log goes
    to ``log`` (a file, not a pipe: a pipe nobody reads fills, 64 KB, and the server blocks)."""
    port = free_port()
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the S3 server exited: {log.read_text()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, port
        except OSError:
            time.sleep(0.2)
    proc.terminate()
    raise RuntimeError("the S3 server did not start within 60 s")
