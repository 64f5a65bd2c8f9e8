"""The in-process run's time limit (``launch.TimeLimited``) is a loader the trainer accepts on
every Python: from 3.12 ``isinstance`` against a runtime protocol looks members up statically
(``inspect.getattr_static``), which a wrapper forwarding only through ``__getattr__`` fails. It
did, on the GPU machine's Python 3.12: every in-process run with a time limit, the demo's
included, was refused before its first step."""
from __future__ import annotations

import inspect
import time

import numpy as np
import pytest

from sluice.errors import LaunchError
from sluice.stages.contracts import ResumableLoader
from sluice.stages.load import ArrayLoader
from sluice.stages.run.launch import TimeLimited
from sluice.stages.train import train


def _members() -> set[str]:
    own = {k for k in vars(ResumableLoader) if not k.startswith("_") or k in ("__iter__", "__len__")}
    return own | set(ResumableLoader.__annotations__)


def _loader() -> ArrayLoader:
    rng = np.random.default_rng(0)
    return ArrayLoader(rng.integers(0, 255, (64, 8, 8), dtype=np.uint8), rng.integers(0, 4, 64), 16)


def test_every_protocol_member_is_found_statically():
    wrapped = TimeLimited(_loader(), time.monotonic() + 60, 60)
    assert {"names", "device", "epoch", "set_epoch", "state_dict", "report", "__iter__"} <= _members()
    for name in sorted(_members()):
        inspect.getattr_static(wrapped, name)  # AttributeError: 3.12's isinstance would refuse it
    assert isinstance(wrapped, ResumableLoader)
    assert wrapped.names == wrapped.loader.names and len(wrapped) == 4 and wrapped.epoch == 0


def test_a_limited_loader_trains_and_stops_past_its_deadline():
    cfg = dict(model="small_cnn", model_kwargs={"width": 4}, in_channels=1, num_classes=4, max_steps=3,
               batch_size=16, progress=False, seed=0)
    r = train(cfg, TimeLimited(_loader(), time.monotonic() + 600, 600))
    assert r.steps == 3
    with pytest.raises(LaunchError, match="timeout_s=1 "):
        train(cfg, TimeLimited(_loader(), time.monotonic() - 1, 1))
