"""Scores artifacts: per-sample float32 arrays keyed by dataset fingerprint and scorer config.

A score (irreducible loss, difficulty, ...) is expensive to compute and depends only on the
dataset's content and the scorer's config, so it is stored once and reused by nightly runs and
sweeps. Layout under a scores root (a local path or fsspec URL)::

    <scores_root>/<fingerprint[:16]>/<kind>-<split>-<confighash[:16]>.npy
    <scores_root>/<fingerprint[:16]>/<kind>-<split>-<confighash[:16]>.json   (sidecar)

The array is written first and the sidecar last, both atomically, so a sidecar only ever
describes a complete array; the sidecar records the array's sha256, which loading checks.
Loading also checks the fingerprint, config hash and length and names what differs.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sluice.errors import ScoresError, ScoresNotFound
from sluice.storage.atomic import write_bytes, write_json
from sluice.storage.fingerprint import hash_obj
from sluice.storage.paths import exists, join, read_bytes

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Scores:
    """One stored score array and what it belongs to."""
    values: np.ndarray
    fingerprint: str
    kind: str
    split: str
    config: dict[str, Any]
    config_hash: str
    created: str
    path: str
    extra: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.values.shape[0])

    def check(self, fingerprint: str | None = None, length: int | None = None) -> "Scores":
        """Raise ScoresError unless these scores belong to ``fingerprint`` and have ``length``."""
        check_scores(self, fingerprint=fingerprint, length=length)
        return self


def config_hash(config: dict[str, Any]) -> str:
    """The hash that keys a scorer config (canonical JSON, so key order does not matter)."""
    return hash_obj(config)


def scores_path(scores_root: str | os.PathLike, fingerprint: str, kind: str, split: str,
                cfg_hash: str) -> str:
    """Path of the ``.npy`` for these keys (the sidecar is the same name with ``.json``)."""
    _check_name("kind", kind)
    _check_name("split", split)
    if len(fingerprint) < 16:
        raise ScoresError(f"dataset fingerprint {fingerprint!r} is too short (need >= 16 hex chars)")
    return join(scores_root, fingerprint[:16], f"{kind}-{split}-{cfg_hash[:16]}.npy")


def _check_name(what: str, name: str) -> None:
    if not name or not all(c.isalnum() or c in "_." for c in name):
        raise ScoresError(f"scores {what} {name!r} must be non-empty letters, digits, '_' or '.'")


def _sidecar(npy_path: str) -> str:
    return npy_path[: -len(".npy")] + ".json"


def validate_values(values: np.ndarray, what: str = "scores") -> np.ndarray:
    """A 1-D finite float32 copy of ``values``, or a ScoresError saying what is wrong."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ScoresError(f"{what} must be a 1-D array (one value per sample), got shape {arr.shape}")
    if arr.size == 0:
        raise ScoresError(f"{what} is empty")
    arr = arr.astype(np.float32)
    bad = ~np.isfinite(arr)
    if bad.any():
        idx = np.flatnonzero(bad)
        raise ScoresError(f"{what} has {idx.size} NaN/inf values (first at sample indices "
                          f"{idx[:5].tolist()})")
    return arr


def save_scores(scores_root: str | os.PathLike, values: np.ndarray, *, fingerprint: str,
                kind: str, split: str, config: dict[str, Any],
                extra: dict[str, Any] | None = None) -> Scores:
    """Store ``values`` (one per sample of ``split``) atomically; returns what was written."""
    arr = validate_values(values, f"{kind} scores for split {split!r}")
    h = config_hash(config)
    path = scores_path(scores_root, fingerprint, kind, split, h)
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    data = buf.getvalue()
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    meta = {"schema_version": SCHEMA_VERSION, "fingerprint": fingerprint, "kind": kind,
            "split": split, "config": config, "config_hash": h, "length": int(arr.size),
            "dtype": "float32", "sha256": hashlib.sha256(data).hexdigest(), "created": created,
            "extra": extra or {}}
    write_bytes(path, data)
    write_json(_sidecar(path), meta)
    return Scores(arr, fingerprint, kind, split, config, h, created, path, dict(extra or {}))


def open_scores(npy_path: str | os.PathLike) -> Scores:
    """Read a scores artifact by path, verifying the array against its sidecar."""
    p = os.fspath(npy_path)
    side = _sidecar(p)
    if not exists(side):
        raise ScoresNotFound(f"no scores sidecar {side} (the scores were never written, or "
                             "their write did not finish)")
    try:
        meta = json.loads(read_bytes(side))
    except ValueError as e:
        raise ScoresError(f"scores sidecar {side} is not valid JSON: {e}") from None
    try:
        data = read_bytes(p)
    except FileNotFoundError:
        raise ScoresError(f"scores array {p} is missing but its sidecar exists") from None
    if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        raise ScoresError(f"scores array {p} does not match the sha256 in its sidecar "
                          "(corrupt or replaced); delete both files to recompute")
    values = np.load(io.BytesIO(data), allow_pickle=False)
    if values.shape != (meta["length"],):
        raise ScoresError(f"scores array {p} has shape {values.shape}, sidecar says "
                          f"({meta['length']},)")
    return Scores(values, meta["fingerprint"], meta["kind"], meta["split"], meta["config"],
                  meta["config_hash"], meta["created"], p, meta.get("extra", {}))


def check_scores(scores: Scores, fingerprint: str | None = None, length: int | None = None) -> None:
    """Raise ScoresError if ``scores`` belong to another dataset or have the wrong length."""
    if fingerprint is not None and scores.fingerprint != fingerprint:
        raise ScoresError(f"{scores.kind} scores at {scores.path} belong to dataset "
                          f"{scores.fingerprint[:16]}, not {fingerprint[:16]}: recompute them "
                          "for this dataset")
    if length is not None and len(scores) != length:
        raise ScoresError(f"{scores.kind} scores at {scores.path} have {len(scores)} values but "
                          f"split {scores.split!r} has {length} samples")


def load_scores(scores_root: str | os.PathLike, *, fingerprint: str, kind: str, split: str,
                config: dict[str, Any], length: int | None = None) -> Scores:
    """Stored scores for exactly these keys; ScoresNotFound if there are none."""
    path = scores_path(scores_root, fingerprint, kind, split, config_hash(config))
    if not exists(_sidecar(path)):
        raise ScoresNotFound(f"no {kind} scores for dataset {fingerprint[:16]}, split {split!r} "
                             f"and this config (looked for {path})")
    s = open_scores(path)
    if s.config_hash != config_hash(config):
        raise ScoresError(f"scores at {path} were computed with another config")
    check_scores(s, fingerprint=fingerprint, length=length)
    return s


def find_scores(scores_root: str | os.PathLike, *, fingerprint: str, kind: str, split: str,
                config: dict[str, Any], length: int | None = None) -> Scores | None:
    """Like ``load_scores`` but None when nothing is stored (other problems still raise)."""
    try:
        return load_scores(scores_root, fingerprint=fingerprint, kind=kind, split=split,
                           config=config, length=length)
    except ScoresNotFound:
        return None
