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


# environment variables that make PyTorch use an older CPU's kernels (an AVX2 host simulated)
SIMULATION_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def host_class_record() -> dict[str, Any]:
    """The host class a run was measured on (``sluice.stages.host``) and whether it was the CPU's
    own or simulated on a newer one through ``SIMULATION_ENV``."""
    from sluice.stages.host import cpu_class
    env = {k: os.environ[k] for k in SIMULATION_ENV if os.environ.get(k)}
    return {"host_class": cpu_class(), "host_class_simulated": env or None}


def class_tag() -> str:
    """This run's host class for a results file's name: ``avx2``, ``avx512_bf16``, ...; with
    ``-simulated`` where ``SIMULATION_ENV`` made a newer CPU act as an older one."""
    rec = host_class_record()
    return rec["host_class"] + ("-simulated" if rec["host_class_simulated"] else "")


def results_name(stem: str, bare_on: str | None = None) -> str:
    """A results file's name for this host class: ``<stem>-<class_tag()>``, or ``stem`` alone on
    the class ``bare_on`` (the files named before host classes were, measured on that class)."""
    return stem if class_tag() == bare_on else f"{stem}-{class_tag()}"


def class_of(record: dict[str, Any]) -> str:
    """A results file's host class: as recorded, else (files written before it was) from the
    recorded CPU flags by ``sluice.stages.host.classify``, the rule ``cpu_class`` uses."""
    for where in (record, record.get("_meta", {})):
        if where.get("host_class"):
            sim = where.get("host_class_simulated")
            return where["host_class"] + (" (simulated)" if sim else "")
    host = record.get("host") or record.get("_meta", {}).get("host") or {}
    if "flags" not in host:
        return "not recorded"
    from sluice.stages.host import classify
    flags = set(host["flags"])
    # every AMX CPU has AVX512; older files may not list avx512f beside amx_tile
    return classify(bool(flags & {"avx512f", "amx_tile"}), "avx512_bf16" in flags, "amx_tile" in flags)


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
            **host_class_record(), "load_average_start": load_average()}
