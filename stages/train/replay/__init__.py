"""Replay policies for warm-started runs (``warm.replay``): one file each, registered by name.

Add one: a file registering a function ``ReplayContext -> split indices`` with
``@REPLAY_POLICIES.register``, plus one import line below.
"""
from sluice.stages.train.replay import champion_loss, reducible_loss, uniform  # noqa: F401  each registers itself
from sluice.stages.train.replay.base import REPLAY_POLICIES, ReplayContext, ReplayPolicy

__all__ = ["REPLAY_POLICIES", "ReplayContext", "ReplayPolicy"]
