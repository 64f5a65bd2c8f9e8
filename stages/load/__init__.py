"""A dataset artifact → ordered, augmented batches, usable on its own in any training script::

    from sluice.stages.load import AugmentSpec, Loader
    loader = Loader("sluice-data/datasets/fashion-mnist", split="train", batch_size=256,
                    augment=AugmentSpec.standard())

Modules: ``loader`` (the ``Loader``, a pipeline of the parts below), ``config``
(``LoaderConfig``); the parts: ``order`` (sampler and cursor; ``samplers``, ``epochs``),
``backends/`` (read and decode, one file per backend; ``choice`` picks one, ``remote`` fetches
a remote artifact's shards ahead), ``finish_batches`` (decode on the device, transfer and
augmentation; ``augment/``, one file per op; ``device_decode`` decodes JPEG batches there with
``decode: device``; ``canvas``, the batches of bytes or of mixed sizes a backend may hand over),
``prefetch`` (batches made ahead in a thread); ``profile`` (where the time went, and the verdict). Also ``sample_index`` and ``decode`` (random access to stored samples),
``arrays`` (``ArrayLoader`` over numpy arrays, ``split_arrays``) and ``specs`` (typed data specs
for processes that build their own loader). Several sources: ``mixture`` (a weighted mixture's
counts, draws and order), ``image_mixture`` (``MixtureLoader``: image artifacts mixed by weight)
and ``tokens`` (``TokenLoader``: packed rows of token artifacts, one or a mixture). Importing this package imports neither Prefect nor
FFCV nor DALI.
"""
from sluice.stages.load.arrays import ArrayLoader, split_arrays
from sluice.stages.load.augment import AugmentSpec, TorchAugment
from sluice.stages.load.backends import LOADER_BACKENDS
from sluice.stages.load.config import LoaderConfig
from sluice.stages.load.loader import Loader
from sluice.stages.load.profile import bottleneck
from sluice.stages.load.samplers import ResolutionSchedule, SamplerConfig, build_sampler

__all__ = ["Loader", "LoaderConfig", "AugmentSpec", "TorchAugment", "SamplerConfig",
           "ResolutionSchedule", "build_sampler", "ArrayLoader", "split_arrays", "LOADER_BACKENDS",
           "bottleneck"]
