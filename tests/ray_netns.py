"""Run a script that starts a Ray cluster inside a network namespace holding only loopback (Ray
advertises the host's own address otherwise), and read back the one ``REPORT <json>`` line it
prints: how the Ray tests keep every byte of Ray's traffic off the host's network."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from deploy.simcluster import netadmin_missing


def run_in_loopback_namespace(script: str, args: list[str], timeout_s: float) -> dict:
    """``python tests/<script> <args>`` in a fresh namespace with only ``lo`` up; its report.
    Skips where Ray is not installed or namespaces cannot be made; fails with the output's tail
    when the script fails."""
    pytest.importorskip("ray", reason="make setup installs ray (the 'ray' extra)")
    why = netadmin_missing()
    if why:
        pytest.skip(why)
    ns = f"sluice-ray-{os.getpid()}-{Path(script).stem}"[:60]
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True)
        path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
        r = subprocess.run(["ip", "netns", "exec", ns, sys.executable, str(ROOT / "tests" / script), *args],
                           capture_output=True, text=True, timeout=timeout_s, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": path})
        text = r.stdout + r.stderr
        assert r.returncode == 0, text[-6000:]
        return json.loads(next(x for x in text.splitlines() if x.startswith("REPORT "))[len("REPORT "):])
    finally:
        subprocess.run(["ip", "netns", "delete", ns], check=False)
