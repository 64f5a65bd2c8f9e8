"""Every rule for starting other processes (fork, spawn, torchrun), each with why, in one place.

It sits below every layer (``storage`` uses rule 5), so any module may import it. The rules:

1. **Fork with a collected, frozen heap** (``fork_safe``): a child must never run finalizers
   of its parent's garbage; a leftover DALI pipeline's ``__del__`` blocks forever in a child.
2. **Never fork from a helper thread** (``helper_thread``; ``fork_safe`` refuses): a fork copies
   every lock another thread held, held, into a child that can never release it; and Linux's
   parent-death signal (rule 3) fires when the forking *thread* exits. So the loader runs a
   backend that forks workers each epoch (``Backend.forks_per_epoch``: DataLoader workers) in
   the caller's thread, without its prefetch thread, and opens backends in the caller's thread.
3. **A child dies with its parent** (``die_with_parent``, ``die_with_parent_preexec``): after a
   ``kill -9`` of the parent nothing it started goes on writing files or training as an orphan.
4. **First thing in a forked worker** (``child_start``): drop the thread-exit callbacks of the
   parent's threads (they fail at the child's exit and turn exit code 0 into 1) and take the
   default SIGTERM (the parent's handler, Prefect's, prints a traceback when a pool stops it).
5. **A descriptor that holds a lock is the parent's only** (``parent_only_fd``): an ``flock``
   belongs to the open file, which a fork shares, so a child forked while a cache lock is held
   would keep it held after the parent lets go, then wait on it forever itself. Every child
   closes its copies at once (an at-fork hook registered when this module is imported).
6. **Stop a child's whole process group** (``stop_group``): torchrun and its workers run in a
   session of their own, so a timeout or Ctrl-C stops all of them, never the agent alone.
7. **A process entry runs its imported module** (``run_as_imported``): under ``python -m`` the
   module is ``__main__``, a second copy whose registrations land in registries the package
   never reads; and it leaves by ``os._exit`` (gloo's and the loader's threads can abort a
   finished process in interpreter teardown, which torchrun reports as a failure).

``describe_exit`` says how a child ended. ``sluice.stages.worker_pool`` builds the forked worker pool
(``map_forked``) on these rules.
"""
from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import threading
from typing import Callable, Iterator, NoReturn


# ---------------------------------------------------------------- rules 1 and 2: where to fork
_helper = threading.local()


def helper_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """Start ``target`` in a daemon thread that must never fork (rule 2); returns it started."""
    def run() -> None:
        _helper.active = True
        target()
    th = threading.Thread(target=run, name=name, daemon=True)
    th.start()
    return th


def in_helper_thread() -> bool:
    """Whether this thread was started by ``helper_thread`` (and so must not fork)."""
    return getattr(_helper, "active", False)


@contextlib.contextmanager
def fork_safe() -> Iterator[None]:
    """Around every fork: refuse a helper thread (rule 2), then collect garbage and freeze the
    heap so that no child runs its parent's finalizers (rule 1)."""
    if in_helper_thread():
        raise RuntimeError(f"a fork from helper thread {threading.current_thread().name!r}: fork "
                           "from the caller's thread (sluice.process_rules, rule 2)")
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# ---------------------------------------------------------------- rules 3 and 4: in the child
def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies (``PR_SET_PDEATHSIG``).

    Called first thing in a child (a forked worker, or torchrun through ``preexec_fn``). If the
    parent died before the call took effect, the signal is sent at once. Linux only; a no-op
    elsewhere. Linux sends the signal when the parent *thread* that forked exits (rule 2).
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, int(sig))  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)


def die_with_parent_preexec() -> Callable[[], None] | None:
    """A ``subprocess.Popen(preexec_fn=...)`` that ties the child to this process (see
    ``die_with_parent``); None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()
    return lambda: die_with_parent(parent)


def forget_parent_threads() -> None:
    """In a forked child: drop the thread-exit callbacks inherited from the parent.

    Libraries register them for their own background threads (Prefect's log and event workers),
    which do not exist in a fork; run at the child's exit they fail (Prefect's raise an
    AssertionError in ``threading._shutdown``) and turn the child's clean exit into exit code 1.
    """
    with contextlib.suppress(AttributeError):  # CPython's list of them (3.9+)
        threading._threading_atexits.clear()  # type: ignore[attr-defined]


def default_sigterm() -> None:
    """In a forked worker: die quietly on SIGTERM (``Pool.terminate``) instead of running a
    handler inherited from the parent (Prefect's prints a TerminationSignal traceback)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def child_start(parent_pid: int) -> None:
    """First thing in a forked pool worker (rules 3 and 4)."""
    forget_parent_threads()
    default_sigterm()
    die_with_parent(parent_pid)


# ---------------------------------------------------------------- rule 5: lock descriptors
# Descriptors open in this process that no child may keep. _PARENT_ONLY_GUARD keeps a fork from
# falling between an open (or close) and its record here, where the child would inherit a lock
# file it does not know of (a hang seen on a clean clone).
_PARENT_ONLY: set[int] = set()
_PARENT_ONLY_GUARD = threading.Lock()


@contextlib.contextmanager
def parent_only_fd(path: str | os.PathLike, flags: int, mode: int = 0o600) -> Iterator[int]:
    """``os.open(path, flags, mode)`` for the block; a process forked meanwhile closes its copy
    first thing (rule 5). The block's end closes the parent's."""
    with _PARENT_ONLY_GUARD:  # no fork between opening the file and recording it
        fd = os.open(path, flags, mode)
        _PARENT_ONLY.add(fd)
    try:
        yield fd
    finally:
        with _PARENT_ONLY_GUARD:
            if fd in _PARENT_ONLY:  # (not when a fork from inside this block closed the child's copy)
                _PARENT_ONLY.discard(fd)
                os.close(fd)  # closing the last copy releases an flock


def _close_parent_only_fds() -> None:
    for fd in list(_PARENT_ONLY):
        with contextlib.suppress(OSError):
            os.close(fd)
    _PARENT_ONLY.clear()
    _PARENT_ONLY_GUARD.release()  # taken by the forking thread before the fork


os.register_at_fork(before=_PARENT_ONLY_GUARD.acquire, after_in_parent=_PARENT_ONLY_GUARD.release,
                    after_in_child=_close_parent_only_fds)


# ---------------------------------------------------------------- rules 6 and 7: spawned processes
def stop_group(p: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop a child started with ``start_new_session=True`` and everything it started (rule 6):
    SIGTERM to its process group (torchrun stops its workers on it), SIGKILL after ``grace_s``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)


def run_as_imported(module: str, entry: str = "main") -> NoReturn:
    """The whole ``if __name__ == "__main__":`` body of a process entry (rule 7): run
    ``module.entry()`` from the imported module, flush, and leave with its exit code without
    interpreter teardown (results are written before it returns)."""
    import importlib
    code = getattr(importlib.import_module(module), entry)()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))


def describe_exit(code: int) -> str:
    """How a child process ended, from its exit code (negative: the signal that killed it)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
