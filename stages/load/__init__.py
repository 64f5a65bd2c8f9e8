"""A dataset artifact → ordered, augmented batches, usable on its own in any training script::

    from sluice.stages.load import AugmentSpec, Loader
    loader = Loader("sluice-data/datasets/fashion-mnist", split="train", batch_size=256,
                    augment=AugmentSpec.standard())

Modules: ``loader`` (the ``Loader``), ``config`` (``LoaderConfig``), ``samplers`` (the order),
``sample_index`` and ``decode`` (random access to stored samples), ``augment/`` (one file per
op), ``backends/`` (one file per backend), ``arrays`` (``ArrayLoader`` over numpy arrays) and
``specs`` (typed data specs for processes that build their own loader). Importing this package
imports neither Prefect nor FFCV nor DALI.
"""
from sluice.stages.load.arrays import ArrayLoader
from sluice.stages.load.augment import AugmentSpec, TorchAugment
from sluice.stages.load.backends import LOADER_BACKENDS
from sluice.stages.load.config import LoaderConfig
from sluice.stages.load.arrays import split_arrays
from sluice.stages.load.loader import Loader
from sluice.stages.load.samplers import ResolutionSchedule, SamplerConfig, build_sampler

__all__ = ["Loader", "LoaderConfig", "AugmentSpec", "TorchAugment", "SamplerConfig",
           "ResolutionSchedule", "build_sampler", "ArrayLoader", "split_arrays", "LOADER_BACKENDS"]
