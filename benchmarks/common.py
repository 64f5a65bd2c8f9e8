"""Helpers shared by the benchmarks: timing, tables and JSON results."""
from __future__ import annotations

import os
import platform
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

RESULTS = Path(__file__).resolve().parent / "results"


@contextmanager
def timer() -> Iterator[dict]:
    box: dict[str, float] = {}
    t = time.perf_counter()
    try:
        yield box
    finally:
        box["seconds"] = time.perf_counter() - t


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
        return "-" if v is None else str(v)
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths))) for row in cells]
    return "\n".join(out)


def host_info() -> dict[str, Any]:
    """Where and from what a result was measured: git commit, CPU model and the flags that
    matter here (AVX2/AVX-512/AMX, bf16), cores, load average."""
    import subprocess
    model, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "fma")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True, cwd=Path(__file__).resolve().parent).stdout.strip()
    if not commit:  # run from an exported snapshot of the tree (git archive)
        commit, dirty = os.environ.get("SLUICE_GIT_COMMIT", "unknown"), ""
    return {"git_commit": commit + ("+dirty" if dirty else ""), "cpu_model": model,
            "cpu_flags": sorted(f for f in wanted if f in flags), "host_cores": os.cpu_count(),
            "load_avg": list(os.getloadavg()), "python": platform.python_version()}


def write_result(name: str, payload: dict[str, Any]) -> Path:
    from sluice.storage.atomic import write_json
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {**payload, "_meta": {"when": datetime.now(timezone.utc).isoformat(), **host_info()}}
    path = RESULTS / f"{name}.json"
    write_json(path, payload)
    return path
