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


def lock_free_in_a_child_forked_inside(hold, lock_path: Path) -> int:
    """Fork while ``hold`` (a context manager holding an flock on ``lock_path``; what it yields, if
    an int, is the lock's descriptor) is entered; the child waits until the parent has left it,
    then tries the lock without blocking. The child's exit code: 0 it took the lock, 3 the lock
    was still held (the child kept a copy of the parent's descriptor), 2 the yielded descriptor
    was still open in the child."""
    import fcntl
    import os
    r, w = os.pipe()
    with hold as inherited_fd:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                if isinstance(inherited_fd, int):
                    try:
                        os.fstat(inherited_fd)
                        code = 2
                    except OSError:
                        pass
                if code != 2:
                    os.read(r, 1)
                    fd = os.open(lock_path, os.O_RDWR)
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        code = 0
                    except BlockingIOError:
                        code = 3
            finally:
                os._exit(code)
    os.write(w, b"x")
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)
