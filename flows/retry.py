"""Which failures a flow's task retries: only what can succeed on a second try.

A crash (any exception that is not Sluice's own), a crashed or lost rank, a run past its time
limit (``LaunchError``, ``RendezvousError``) and a failed write (``WriteError``: a full disk
may have room again) are retried. A configuration, data, selection, storage or pre-flight error
is not: the same input fails the same way, so a retry only spends the time again. A rank's own
``SluiceError`` reaches the flow as a ``TrainError`` naming it (the rank writes it to
``error.json``, ``stages/run/launch.py`` raises it), so it is not retried either; a rank's plain
Python error stays a crash, which the pre-flight (``stages/run/preflight.py``) keeps from being a
deterministic misfit of the model and the data.
"""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from sluice.errors import LaunchError, SluiceError, WriteError

# Sluice's errors a second try can get past: the machine's, not the input's.
TRANSIENT = (LaunchError, WriteError)


def retry_can_help(e: BaseException) -> bool:
    """Whether trying ``e``'s task again could end differently."""
    if isinstance(e, TRANSIENT):
        return True
    return not isinstance(e, (SluiceError, ValidationError))


def failed_with(state: Any) -> BaseException | None:
    """The exception a failed Prefect state holds (None: it holds none)."""
    data = getattr(state, "data", None)
    if isinstance(data, BaseException):
        return data
    try:
        found = state.result(raise_on_failure=False)
    except Exception:  # noqa: BLE001 - an unreadable result: nothing to classify
        return None
    return found if isinstance(found, BaseException) else None


def retry_unless_deterministic(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's ``retry_condition_fn``: go on to the task's retries unless the failure is one
    the same input repeats (``retry_can_help``); logged either way, so the run says why."""
    e = failed_with(state)
    again = e is None or retry_can_help(e)
    if not again:
        from prefect.logging.loggers import task_run_logger
        task_run_logger(task_run, task).info(f"not retrying {task.name}: {type(e).__name__} is an error the same "
                                             "input repeats (flows/retry.py)")
    return again
