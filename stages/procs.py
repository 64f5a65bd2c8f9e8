"""Process helpers shared by the stages that fork workers (shard pools, FFCV's writer,
DataLoader workers)."""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def fork_safe() -> Iterator[None]:
    """Collect garbage, then freeze the heap around a fork: a child must never run finalizers of
    its parent's garbage (a leftover DALI pipeline's ``__del__`` blocks forever in a child)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def default_sigterm() -> None:
    """Pool initializer: a forked worker dies quietly on SIGTERM (``Pool.terminate``) instead of
    running a handler it inherited from its parent (Prefect's prints a TerminationSignal
    traceback into the flow log)."""
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
