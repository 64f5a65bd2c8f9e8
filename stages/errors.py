"""Errors a stage raises for bad input, each naming what was wrong and where."""
from __future__ import annotations


class SluiceError(Exception):
    """Base class: a problem with the user's input or environment, not a bug."""


class SourceError(SluiceError):
    """A source that cannot be read at all (missing path, malformed file, empty)."""


class SampleError(SluiceError):
    """One sample that cannot be used; it is quarantined rather than failing the run."""


class TooManyBadSamples(SluiceError):
    """More samples were bad than ``max_bad_fraction`` allows."""


class MissingBackend(SluiceError, ImportError):
    """An optional backend is not installed; the message names the pip package."""


def require(module: str, package: str, purpose: str):
    """Import an optional backend, or raise MissingBackend naming the package to install."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingBackend(f"{purpose} needs the '{package}' package ({e}); "
                             f"install it with: pip install {package}") from e
