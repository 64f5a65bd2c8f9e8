"""Finding a test's processes through /proc and waiting on a condition with a deadline: shared
by the drills, the deployment tests and the loopback test."""
from __future__ import annotations

import time
from pathlib import Path


def pids_with_env(entry: str) -> list[int]:
    """Live processes whose environment holds ``entry`` ("NAME=value"): every process a test
    started inherits it, so this finds them all, zombies left out."""
    want = entry.encode()
    pids = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if want in env.read_bytes().split(b"\0") and Path(env.parent, "stat").read_text().split(") ")[1][0] != "Z":
                pids.append(int(env.parent.name))
        except (OSError, IndexError):
            continue
    return pids


def wait_until(what: str, check, timeout: float, every: float = 0.1):
    """``check()``'s first true value; an AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
