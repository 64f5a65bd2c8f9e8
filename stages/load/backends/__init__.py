"""Loader backends, one file each: ``memory``, ``ffcv``, ``webdataset``, ``dali`` (see ``base``).

Add one: a new file registering a ``Backend`` subclass with ``@LOADER_BACKENDS.register(name)``,
plus one import line below. Importing a backend module imports its library only when opened.
"""
from sluice.stages.load.backends import dali, ffcv, memory, webdataset  # noqa: F401  (each registers itself)
from sluice.stages.load.backends.base import LOADER_BACKENDS, Backend, Timings, batch_slices

__all__ = ["LOADER_BACKENDS", "Backend", "Timings", "batch_slices"]
