"""The loader-backend registry and what every backend provides.

A backend turns an index order into batches, exactly in that order. Most yield raw uint8 NHWC
batches, which the ``Loader`` then transfers and augments (images of different sizes as a
``Canvas``: zero-padded, with each one's size; with ``loader.decode: device``, JPEG bytes checked
but not decoded, as ``Encoded``, which the loader decodes where the batch is made: ``canvas.py``); a backend with ``augments = True``
(DALI) decodes, augments and places batches on the device itself, drawing its random
parameters from the same ``augment.draws`` as the torch path.

Add one: a new file with a ``Backend`` subclass registered by ``@LOADER_BACKENDS.register(name)``
and one import line in ``backends/__init__.py`` (outside Sluice: the same decorator in your
module, or an entry point in group ``sluice.loader_backends``); then ``loader.backend: name``.
A backend module imports its library inside ``open`` (``sluice.errors.require``), so importing
the loader never imports FFCV or DALI.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Iterator

import numpy as np
import torch

from sluice.plugins import PluginRegistry
from sluice.stages.load.canvas import Canvas, Encoded
from sluice.stages.load.timings import Timings
from sluice.storage.artifact import DatasetArtifact

if TYPE_CHECKING:  # the loader config imports this registry; no runtime cycle
    from sluice.stages.load.config import LoaderConfig
    from sluice.stages.load.integrity import Guard

RawBatch = tuple[np.ndarray | torch.Tensor | Canvas | Encoded, np.ndarray | torch.Tensor, np.ndarray | torch.Tensor]
LOADER_BACKENDS: PluginRegistry[type["Backend"]] = PluginRegistry("loader_backends", "loader backend")


def batch_slices(n: int, batch_size: int, drop_last: bool, start_batch: int) -> list[tuple[int, int]]:
    """(lo, hi) of each batch of an ``n``-long order, from batch ``start_batch`` on."""
    stop = (n // batch_size) * batch_size if drop_last else n
    return [(lo, min(lo + batch_size, stop)) for lo in range(start_batch * batch_size, stop, batch_size)]


def decoded_sample_bytes(artifact: DatasetArtifact) -> int | None:
    """Bytes of one decoded uint8 image at the artifact's fixed shape (None: variable sizes)."""
    shape = artifact.manifest.fields.image.shape
    return None if shape is None else int(np.prod(shape))


def with_index(device: str | torch.device) -> torch.device:
    """``device`` with its index: a bare ``cuda`` is the device this rank set as current, so
    streams, pinned buffers and allocations made later (from any thread) land on it, not cuda:0.
    Resolve it in the caller's thread: a helper thread's current device is cuda:0."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


class Backend:
    """Reads one split of an artifact in any order. Subclasses set ``name`` and implement
    ``open`` and ``epoch``."""
    name: ClassVar[str] = ""
    augments: ClassVar[bool] = False  # yields finished batches (augmented, on the device)
    # Forks worker processes during each epoch (DataLoader workers): the loader then drives it
    # from the caller's thread, never its prefetch thread (sluice.process_rules, rule 2), and its fork
    # goes through sluice.process_rules.fork_safe (which refuses a helper thread).
    forks_per_epoch: bool = False
    reads_shards: ClassVar[bool] = False  # reads the tar shards by sample (remote: prefetch them)
    holds: ClassVar[str] = "the batches in flight"  # what working_bytes counts, said in auto's reason
    # Where the backend keeps what it holds and why (the memory backend: on the GPU or in pinned
    # host RAM); the loader appends it to its backend reason, so profile_report() shows it.
    placement: str = ""
    hands_encoded: bool = False  # hands over JPEG bytes for the loader to decode (decode: device)
    timings: Timings
    guard: "Guard"  # the split's damage policy: the loader hands it samples it cannot decode

    def sample_file(self, index: int) -> str:
        """The artifact file holding sample ``index`` (what a damage report names)."""
        return "?"

    @classmethod
    def open(cls, artifact: DatasetArtifact, split: str, config: "LoaderConfig",
             device: torch.device, workers: int) -> "Backend":
        raise NotImplementedError

    @classmethod
    def working_bytes(cls, artifact: DatasetArtifact, split: str, config: "LoaderConfig") -> int | None:
        """The memory this backend holds at ``config`` beyond the process itself: the decoded batches
        in flight (the loader's ``prefetch`` queue, the one being built and the caller's), or None
        where the images have no fixed shape. ``auto`` weighs it against the loader's memory budget,
        so a streaming backend is not chosen where its own buffers do not fit."""
        sample = decoded_sample_bytes(artifact)
        return None if sample is None else (config.prefetch + 2) * config.batch_size * sample

    def epoch(self, order: np.ndarray, batch_size: int, drop_last: bool, start_batch: int = 0, *,
              resolution: int | None = None, epoch: int = 0) -> Iterator[Any]:
        """Batches of ``order[start_batch * batch_size:]``, in order; the last partial batch
        unless ``drop_last``. ``resolution`` and ``epoch`` matter to augmenting backends only."""
        raise NotImplementedError

    def close(self) -> None:
        """Release files, threads and pipelines (the backend may be reopened)."""
