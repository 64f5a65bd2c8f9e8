"""Sources, one file each: ``idx`` (MNIST-format IDX files), ``folder`` (an image folder),
``npz``, ``webdataset`` (existing tar shards); see ``base``. ``sluice.stages.data.ingest``
opens one from the ingest config.

Add one: a new file registering a ``Source`` subclass with ``@SOURCES.register(name)``, plus one
import line below.
"""
from sluice.stages.data.sources import folder, idx, npz, webdataset  # noqa: F401  (each registers itself)
from sluice.stages.data.sources.base import SOURCES, RawSample, Source, sanitize_key

__all__ = ["SOURCES", "Source", "RawSample", "sanitize_key"]
