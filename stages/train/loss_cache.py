"""A champion's per-sample losses, cached by sample identity: computed once per sample.

A registered model's weights never change, so its loss on a sample with the same key, content CRC
and label (``storage/sample_ids.py``) is the same every night; the replay policies of a warm start
(``champion_loss``, ``reducible_loss``) would otherwise pay a forward pass over every old sample
each night. The table lives beside the checkpoint (``models/<id>/checkpoint.losses.npz`` in the
registry): a ``KeyedTable`` (``storage/keyed_table.py``) of key hashes, content CRCs, labels and
losses, plus the checkpoint's sha256 (a table for other weights is ignored); a plain ``.npz`` read
without pickle, replaced atomically. A deleted, changed or relabelled sample finds no row and is
computed afresh, as is every sample of a version written before content sums.
"""
from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from sluice.errors import StorageError
from sluice.stages.train.evaluate import per_sample_losses
from sluice.storage.artifact import open_artifact
from sluice.storage.fingerprint import sha256_file
from sluice.storage.keyed_table import KeyedTable
from sluice.storage.sample_ids import load_npz, split_ids

log = logging.getLogger(__name__)
SUFFIX = ".losses.npz"
COLUMN = "losses"  # the stored column of losses
Compute = Callable[[str | os.PathLike, str | os.PathLike, str, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class KeyedLosses:
    """The losses asked for (in the order asked), and how many came from the cache."""
    values: np.ndarray
    cached: int
    computed: int


def cache_path(checkpoint: str | os.PathLike) -> Path:
    """Where a checkpoint's loss table lives: beside it, one per checkpoint file."""
    p = Path(checkpoint)
    return p.with_name(p.stem + SUFFIX)


def losses_by_key(checkpoint: str | os.PathLike, artifact: str | os.PathLike, split: str,
                  indices: np.ndarray, *, cache: str | os.PathLike | None = None,
                  compute: Compute = per_sample_losses) -> KeyedLosses:
    """The checkpoint's loss on each of ``indices`` (split indices of ``artifact``): from the
    cache for samples it has seen unchanged, ``compute``d (one forward pass) for the rest, which
    are then added to the cache."""
    idx = np.asarray(indices, dtype=np.int64)
    with open_artifact(artifact) as art:
        ids = split_ids(art, split)
    if ids is None or idx.size == 0:
        return KeyedLosses(np.asarray(compute(checkpoint, artifact, split, idx), np.float32), 0, int(idx.size))
    target = Path(cache) if cache is not None else cache_path(checkpoint)
    sha = sha256_file(checkpoint)
    known = _load(target, sha)
    want = ids.take(idx)
    carried, found = known.carry(want)
    out, miss = carried[COLUMN], np.flatnonzero(~found)
    if miss.size:
        fresh = np.asarray(compute(checkpoint, artifact, split, idx[miss]), np.float32)
        out[miss] = fresh
        _save(target, sha, known.concat(KeyedTable(want.take(miss), {COLUMN: fresh})))
    log.info("champion losses: %d from the cache, %d computed (%s)", idx.size - miss.size, miss.size, target)
    return KeyedLosses(out, int(idx.size - miss.size), int(miss.size))


def _load(path: Path, sha: str) -> KeyedTable:
    """The cached rows for the checkpoint with ``sha`` (none when the file is missing, another
    checkpoint's, or unreadable: it is rebuilt, never trusted)."""
    empty = KeyedTable.empty({COLUMN: np.float32})
    if not path.is_file():
        return empty
    try:
        data = load_npz(path)
        if str(data["checkpoint_sha256"]) != sha:
            return empty
        table = KeyedTable.from_arrays(data, {COLUMN: np.float32})
    except (StorageError, KeyError) as e:
        warnings.warn(f"the loss cache {path} is unreadable ({e}); rebuilding it", stacklevel=3)
        return empty
    return table


def _save(path: Path, sha: str, table: KeyedTable) -> None:
    """Replace the table atomically; a registry that cannot be written only costs the cache."""
    table = table.distinct()  # one row per identity
    table = table.take(np.flatnonzero(np.isfinite(table.columns[COLUMN])))  # an infinite loss is recomputed
    try:
        table.save(path, {"checkpoint_sha256": np.array(sha)})
    except OSError as e:  # WriteError is an OSError
        warnings.warn(f"could not write the loss cache {path} ({e}); the losses were computed all the same",
                      stacklevel=3)
