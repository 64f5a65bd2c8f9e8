"""The process rules of ``sluice.process_rules``, each against the failure it is there to prevent."""
from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from procwatch import lock_free_in_a_child_forked_inside

from sluice.process_rules import (describe_exit, fork_safe, helper_thread, in_helper_thread, parent_only_fd,
                          stop_group)


def _fork_safe_from_here() -> str:
    try:
        with fork_safe():
            frozen = gc.get_freeze_count() > 0  # rule 1: the heap is frozen around the fork
        return "ok" if frozen else "not frozen"
    except RuntimeError as e:
        return str(e)


def test_fork_safe_refuses_a_helper_thread_only():
    """Rule 2: a fork from the loader's prefetch thread could deadlock the child; the caller's
    thread, or any thread not started as a helper (a Prefect task's), may fork."""
    seen: dict[str, object] = {}

    def work() -> None:
        seen["helper"] = in_helper_thread()
        seen["fork"] = _fork_safe_from_here()
    helper_thread(work, "test-helper").join(10)
    assert seen["helper"] is True
    assert "helper thread 'test-helper'" in str(seen["fork"]) and "rule 2" in str(seen["fork"])
    plain: list[str] = []
    t = threading.Thread(target=lambda: plain.append(_fork_safe_from_here()))
    t.start()
    t.join(10)
    assert plain == ["ok"] and _fork_safe_from_here() == "ok" and not in_helper_thread()
    assert gc.get_freeze_count() == 0  # rule 1's freeze is undone after the fork


def test_a_child_forked_while_a_lock_is_held_has_no_copy_of_it(tmp_path):
    """Rule 5: an flock belongs to the open file, which a fork shares; the child closes its copy
    at once, so the lock is free as soon as the parent lets go."""
    path = tmp_path / "lock"

    @contextlib.contextmanager
    def held():
        with parent_only_fd(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC) as fd:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield fd
    assert lock_free_in_a_child_forked_inside(held(), path) == 0, "the child kept the parent's lock descriptor"


def _gone(pid: int, timeout: float = 5.0) -> bool:
    """Whether ``pid`` has exited (a zombie left to an init that does not reap counts)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("trap", ["", "trap '' TERM; "], ids=["sigterm", "ignores-sigterm"])
def test_stop_group_stops_the_child_and_what_it_started(trap):
    """Rule 6: torchrun and its workers go together; one that ignores SIGTERM is killed after
    the grace period."""
    p = subprocess.Popen(["sh", "-c", f"{trap}sleep 60 & echo $!; wait"], stdout=subprocess.PIPE,
                         text=True, start_new_session=True)
    grandchild = int(p.stdout.readline())
    t = time.monotonic()
    stop_group(p, grace_s=1.0)
    assert p.wait(5) == (-15 if not trap else -9)
    assert _gone(grandchild), "the child's own child outlived the stop"
    assert time.monotonic() - t < 6
    p.stdout.close()


def test_a_process_entry_runs_its_imported_module_and_flushes_before_leaving(tmp_path):
    """Rule 7: under ``python -m`` the module is ``__main__``, a second copy; its entry runs in
    the imported copy (whose registries the package reads) and leaves by ``os._exit`` with the
    entry's code, its buffered output flushed first."""
    (tmp_path / "entry_mod.py").write_text(textwrap.dedent("""
        import sys

        def main():
            print("ran in", __name__)  # buffered: stdout is a pipe
            return 7 if sys.modules.get("entry_mod") is sys.modules[__name__] else 1

        if __name__ == "__main__":
            from sluice.process_rules import run_as_imported
            run_as_imported("entry_mod")
            raise SystemExit(2)  # never reached
        """))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # output stays buffered
    r = subprocess.run([sys.executable, "-m", "entry_mod"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 7, r.stderr
    assert r.stdout.strip() == "ran in entry_mod"


def test_describe_exit():
    assert describe_exit(-9) == "killed by SIGKILL" and describe_exit(3) == "exit code 3"
    assert describe_exit(-200) == "killed by signal 200"
