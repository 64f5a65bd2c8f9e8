"""Helpers shared by the benchmarks: timing, tables and JSON results."""
from __future__ import annotations

import platform
import statistics
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


def write_result(name: str, payload: dict[str, Any]) -> Path:
    from sluice.storage.atomic import write_json
    RESULTS.mkdir(parents=True, exist_ok=True)
    from benchmarks.hostinfo import cpu, git_commit, host_class_record, load_average
    payload = {**payload, "_meta": {"when": datetime.now(timezone.utc).isoformat(), "commit": git_commit(),
                                    "host": cpu(), "host_cores": cpu()["cores"], **host_class_record(),
                                    "load_average": load_average(), "python": platform.python_version()}}
    path = RESULTS / f"{name}.json"
    write_json(path, payload)
    return path


def paired_overhead(on_s: list[float], off_s: list[float]) -> float:
    """1 - the median over rounds of (off epoch time / on epoch time): each round ran both arms
    back to back, so the host's drift between rounds cancels (shown beside the ratio of medians,
    which decides the goal)."""
    return 1 - statistics.median(off / on for on, off in zip(on_s, off_s))


def rerun_in_loopback_namespace(module: str, argv: list[str], flag: str, why: str) -> int:
    """``python -m module argv`` again, inside a fresh network namespace that holds only loopback
    (root: ``ip netns``), with the environment variable ``flag`` set to 1 so the rerun knows it is
    inside; the benchmarks that start a Ray cluster use it (Ray advertises the host's own address
    otherwise). ``why`` says what needs the namespace when one cannot be made."""
    import os
    import subprocess
    import sys
    from deploy.simcluster import netadmin_missing
    missing = netadmin_missing()
    if missing:
        print(f"{module} needs a network namespace ({why}): {missing}", file=sys.stderr)
        return 2
    ns = f"sluice-{module.rsplit('.', 1)[-1].replace('_', '-')}-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True)
        return subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-m", module, *argv],
                              cwd=Path(__file__).resolve().parents[1], env={**os.environ, flag: "1"}).returncode
    finally:
        subprocess.run(["ip", "netns", "delete", ns], check=False)
