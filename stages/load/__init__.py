"""A dataset artifact → ordered, augmented batches, usable on its own in any training script::

    from sluice.stages.load import AugmentSpec, Loader
    loader = Loader("sluice-data/datasets/fashion-mnist", split="train", batch_size=256,
                    augment=AugmentSpec.standard())

Every loader keeps one contract (``base.LoaderBase``: ``set_epoch(e)`` is epoch ``e``,
``state_dict`` resumes mid-epoch at any world size, profiling) and yields one batch type
(``contracts.Batch``). Modules: ``loader`` (the ``Loader``: one image artifact or a weighted
mixture of several, a pipeline of the parts below), ``config`` (``LoaderConfig``); the parts:
``mixture`` (a mixture's counts, draws and order: one source is a mixture of one), ``order``
(one source's sampler as its draw; ``samplers``, ``epochs``: the cursor),
``backends/`` (read and decode, one file per backend; ``choice`` picks one, ``remote`` fetches
a remote artifact's shards ahead), ``finish_batches`` (decode on the device, transfer and
augmentation; ``augment/``, one file per op; ``device_decode`` decodes JPEG batches there with
``decode: device``; ``canvas``, the batches of bytes or of mixed sizes a backend may hand over),
``prefetch`` (batches made ahead in a thread); ``profile`` (where the time went, and the verdict). Also ``sample_index`` and ``decode`` (random access to stored samples),
``source_reads`` (several sources' backends read as one), ``arrays`` (``ArrayLoader`` over numpy
arrays, ``split_arrays``), ``tokens`` (``TokenLoader``: packed rows of token artifacts, one or a
mixture, the token kind's way of reading; ``token_rows`` packs, ``token_cursor`` keeps the
position) and ``specs`` (typed data specs for processes that build their own loader). Importing
this package imports neither Prefect nor FFCV nor DALI.
"""
from sluice.stages.load.arrays import ArrayLoader, split_arrays
from sluice.stages.load.augment import AugmentSpec, TorchAugment
from sluice.stages.load.backends import LOADER_BACKENDS
from sluice.stages.load.base import LoaderBase
from sluice.stages.load.config import LoaderConfig
from sluice.stages.load.loader import Loader
from sluice.stages.load.mixture import MixtureConfig
from sluice.stages.load.profile import bottleneck
from sluice.stages.load.samplers import ResolutionSchedule, SamplerConfig, build_sampler
from sluice.stages.load.tokens import TokenLoader, TokenLoaderConfig

__all__ = ["Loader", "LoaderBase", "LoaderConfig", "MixtureConfig", "TokenLoader", "TokenLoaderConfig",
           "AugmentSpec", "TorchAugment", "SamplerConfig", "ResolutionSchedule", "build_sampler", "ArrayLoader",
           "split_arrays", "LOADER_BACKENDS", "bottleneck"]
