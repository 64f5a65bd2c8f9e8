"""What every results file records about the run: command, commit, host CPU and its flags, cores,
load average — so a figure can always be traced to how and where it was measured."""
from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "fma")


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except OSError:
        return "unknown"


def cpu() -> dict[str, Any]:
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("unknown", "", platform.machine()):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"model": model, "cores": os.cpu_count(),
            "flags": sorted(f for f in FLAGS_OF_INTEREST if f in flags)}


def load_average() -> list[float]:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return []


def describe_run(module: str, argv: list[str] | None = None) -> dict[str, Any]:
    """The provenance block of a results file written by ``python -m module argv...``."""
    args = sys.argv[1:] if argv is None else argv
    return {"command": " ".join(["python -m", module, *map(shlex.quote, args)]),
            "commit": git_commit(), "host": {**cpu(), "python": platform.python_version()},
            "load_average_start": load_average()}
