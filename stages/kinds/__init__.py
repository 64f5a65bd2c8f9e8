"""Kinds of data, a registered axis (``DATA_KINDS``): each entry owns how its sources become
versioned artifacts, how they are verified and read, its task and promotion metric, and what
selection keys on (``base``). Built-ins, one file each: ``image`` (labelled images: artifacts of
tar shards, DALI indexes and an FFCV ``.beton``; a classifier, by accuracy) and ``tokens`` (text:
token artifacts with one shared tokenizer; a language model, by bits per byte).

Add one: a file that registers a ``DataKind`` subclass with ``@DATA_KINDS.register("name")``
(its ``Config``, the pipeline's ``data:`` section for it, and its methods), plus one import line
below; then ``data: {kind: name, sources: [...]}``.
"""
from sluice.stages.kinds.base import (DATA_KINDS, DataConfig, DataKind, DatasetVersion, DataSource, Grade,
                                      SourceVersion, WarmSource, data_config, kind_claiming, kind_of, kind_owning)
from sluice.stages.kinds import image, tokens  # noqa: F401  (each registers itself)

__all__ = ["DATA_KINDS", "DataConfig", "DataKind", "DatasetVersion", "DataSource", "Grade", "SourceVersion",
           "WarmSource", "data_config", "kind_claiming", "kind_of", "kind_owning"]
