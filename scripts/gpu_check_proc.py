"""How ``scripts/gpu_check.py`` runs a step: its one-line messages, and a command run into its log
under a time limit, past which it and every process it started are killed. Standard library only,
as the check is.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path


def say(msg: str) -> None:
    print(f"gpu-check: {msg}", flush=True)


def fail(msg: str, code: int = 2) -> "SystemExit":
    print(f"gpu-check: {msg}", file=sys.stderr, flush=True)
    return SystemExit(code)


def run(cmd: list, log: Path, cwd: Path | None = None, env: dict | None = None,
        echo: bool = False, timeout: float | None = None) -> int:
    """Run ``cmd``, its output into ``log`` (and to the console with ``echo``); its exit code, or
    124 when it ran past ``timeout`` seconds (then it and every process it started is killed)."""
    with open(log, "a") as f:
        f.write(f"$ {' '.join(map(str, cmd))}\n")
        f.flush()
        p = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)

        def pump() -> None:
            for line in p.stdout:
                f.write(line)
                f.flush()
                if echo:
                    sys.stdout.write(line)
                    sys.stdout.flush()
        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kin = descendants(p.pid)  # the training ranks run in sessions of their own
            for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
                for pid in kin:
                    try:
                        os.kill(pid, sig)
                    except (ProcessLookupError, PermissionError):
                        pass
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    p.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            rc = 124
        else:  # the group's leader is gone: end what it left behind (a server, a rank)
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        reader.join(timeout=30)
        if rc == 124:
            f.write(f"gpu-check: timed out after {timeout:.0f} s; killed\n")
        return rc


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc; none where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out
