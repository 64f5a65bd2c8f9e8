"""Sluice storage: artifact layout, manifests, fingerprints, atomic writes, scores, checkpoints and
the model registry.

Imports only the standard library, numpy, fsspec, pydantic and ``sluice.errors``, so any stage
(or a user's own script) can read an artifact without pulling in torch, Prefect or a backend.
"""
