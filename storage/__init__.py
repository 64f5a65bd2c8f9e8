"""Sluice storage: artifact layout, manifests, fingerprints and atomic writes.

Imports only the standard library, numpy, fsspec and pydantic, so any stage (or a user's own
script) can read an artifact without pulling in torch, Prefect or a loader backend.
"""
