"""One error hierarchy for every layer: what went wrong, and whether trying again can help.

``SluiceError`` means a problem with the user's input, configuration or environment — never a
bug — and each layer has one subclass, so a caller can catch exactly what it can act on::

    SluiceError
    ├── ConfigError            a configuration that cannot work (checked before anything runs)
    │   ├── MissingDependency  an optional extra is not installed; the message names it
    │   └── PreflightError     the model, the config and the data do not fit together (one batch
    │                          through the model before any rank starts: stages/run/preflight.py)
    ├── StorageError           artifacts, scores, checkpoints, the model registry
    │   ├── WriteError         a write that failed (disk full, ...): also an OSError
    │   ├── ArtifactError (CorruptSample, TooManyCorruptSamples), ScoresError (ScoresNotFound),
    │   │   CheckpointMismatch, RegistryError
    │   │                    (GradedOnTrainingData: a model graded on samples it trained on)
    ├── DataError              sources and sharding: SourceError, SampleError, TooManyBadSamples, ShardError
    ├── LoaderError            the loader and its backends
    ├── SelectionError         sample selection
    └── TrainError             training: NonFiniteLoss, LaunchError (RendezvousError)

The torchrun worker reports a ``SluiceError`` once and is never restarted after one (the same
input would fail the same way); any other exception is a crash, which torchrun restarts from the
last checkpoint. Value-like errors also subclass ``ValueError`` so existing ``except ValueError``
code keeps working.

This module imports nothing, so every layer (``storage`` included) can use it.
"""
from __future__ import annotations


class SluiceError(Exception):
    """Root: a problem with the user's input, configuration or environment, not a bug."""


class ConfigError(SluiceError, ValueError):
    """A configuration that cannot work; the message names the field and what is allowed."""


class MissingDependency(ConfigError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


def require(module: str, package: str, extra: str, purpose: str):
    """Import an optional dependency, or raise MissingDependency naming the pip package and
    the Sluice extra that installs it."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependency(f"{purpose} needs the '{package}' package ({e}); install it "
                                f"with: pip install 'sluice[{extra}]'") from e


class PreflightError(ConfigError):
    """The model cannot take the data as configured (input shape, outputs, labels, non-finite
    values), found on one batch before any rank starts; the message names the model, the shapes
    and the setting to change, and the original error is its ``__cause__``."""


# ------------------------------------------------------------------ storage

class StorageError(SluiceError):
    """Base of the storage layer: artifacts, scores, checkpoints, the model registry."""


class WriteError(StorageError, OSError):
    """A write that failed, with the path it was writing and the reason (``errno`` is kept)."""

    def __str__(self) -> str:  # the message alone, without OSError's "[Errno 28]" prefix
        return self.strerror or super().__str__()


class ArtifactError(StorageError, ValueError):
    """A dataset artifact that is missing, incomplete or does not match its manifest."""


class CorruptSample(ArtifactError):
    """A sample whose stored bytes no longer match the checksum written with them (rot, a
    partial overwrite, a hand edit): the message names the file, the key, the split index and
    how to re-shard. ``file``, ``key``, ``index`` and ``split`` say which."""

    def __init__(self, message: str, *, file: str = "", key: str = "", index: int = -1, split: str = ""):
        super().__init__(message)
        self.file, self.key, self.index, self.split = file, key, index, split

    def __reduce__(self):  # keep the fields across processes (DataLoader workers, torchrun)
        return (_corrupt, (self.args[0], self.file, self.key, self.index, self.split))


def _corrupt(message: str, file: str, key: str, index: int, split: str) -> "CorruptSample":
    return CorruptSample(message, file=file, key=key, index=index, split=split)


class TooManyCorruptSamples(ArtifactError):
    """``loader.on_corrupt: skip`` met more damaged samples than ``max_corrupt_fraction``."""


class ScoresError(StorageError, ValueError):
    """A scores artifact that cannot be used here (other dataset, wrong length, corrupt)."""


class ScoresNotFound(ScoresError, FileNotFoundError):
    """No stored scores for this (fingerprint, kind, split, config)."""


class CheckpointMismatch(StorageError, ValueError):
    """The checkpoint was written for another model or config, or cannot be loaded safely."""


class RegistryError(StorageError, ValueError):
    """A model-registry operation refused: it says what and why."""


class GradedOnTrainingData(RegistryError):
    """A model was about to be graded on samples it trained on (storage/lineage.py)."""


# ------------------------------------------------------------------ data

class DataError(SluiceError):
    """Base of the data layer: sources, samples and the sharding stage."""


class SourceError(DataError):
    """A source that cannot be read at all (missing path, malformed file, empty)."""


class SampleError(DataError):
    """One sample that cannot be used; it is quarantined rather than failing the run."""


class TooManyBadSamples(DataError):
    """More samples were bad than ``max_bad_fraction`` allows."""


class ShardError(DataError):
    """The sharding stage could not produce an artifact; the message says why and where."""


# ------------------------------------------------------------------ load, select, train

class LoaderError(SluiceError, ValueError):
    """The loader cannot serve this request (bad sizes, state from another run, no memory)."""


class SelectionError(SluiceError, ValueError):
    """Selection cannot run with this input (bad sizes, NaN losses, foreign scores...)."""


class TrainError(SluiceError):
    """A training run that cannot go on (bad input, diverged); retrying will not help."""


class NonFiniteLoss(TrainError):
    """The loss became NaN or inf; the last good checkpoint is kept."""


class LaunchError(TrainError):
    """torchrun failed: the message carries the workers' error or the tail of their logs."""


class RendezvousError(LaunchError):
    """This node could not reach the rendezvous endpoint in time."""
