"""Training checkpoints: written atomically, read with ``weights_only=True``, checked for fit.

A checkpoint is a dict of tensors and plain Python values (no pickled objects), so loading it
cannot run code. It carries a ``compat`` record (model name and config hash); loading refuses a
checkpoint whose record differs from the caller's, naming the fields that differ.
The directory may be an fsspec URL (``s3://bucket/run/checkpoints``: what training on nodes
that share no file system writes to, ``launch.ray.storage``); a remote checkpoint is uploaded
whole once written (one object: readers see the previous one or this one) and read into memory.
``torch`` is imported inside the functions: the rest of ``storage`` stays torch-free.
"""
from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from sluice.errors import CheckpointMismatch
from sluice.storage import paths
from sluice.storage.atomic import atomic_path

LAST = "last.pt"


def _located(where: str | os.PathLike) -> Path | str:
    """A local path as a ``Path`` (``file://`` stripped), a remote URL as its string."""
    return paths.local_path(where) if paths.is_local(where) else os.fspath(where)


def checkpoint_path(directory: str | os.PathLike) -> Path | str:
    """Where the latest checkpoint of a run lives: a path, or a URL for a remote directory."""
    d = _located(directory)
    return d / LAST if isinstance(d, Path) else paths.join(d, LAST)


def checkpoint_exists(path: str | os.PathLike | None) -> bool:
    """Whether a checkpoint is at ``path`` (a path or URL; None: no)."""
    if path is None:
        return False
    p = _located(path)
    if isinstance(p, Path):
        return p.is_file()
    fs, where = paths.filesystem(p)
    fs.invalidate_cache(where)  # another process (rank 0, on another node) may have written it since
    return fs.exists(where)


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> Path | str:
    """Write ``state`` atomically: readers see the previous checkpoint or this one, whole."""
    import torch
    if "compat" not in state:
        raise ValueError("a checkpoint needs a 'compat' record (model name, config hash)")
    with atomic_path(path) as tmp:
        torch.save(state, tmp)
    return _located(path)


def load_checkpoint(path: str | os.PathLike, compat: dict[str, Any] | None = None,
                    map_location: str = "cpu", ignore: tuple[str, ...] = ()) -> dict[str, Any]:
    """Load safely; if ``compat`` is given, refuse a checkpoint written for something else
    (fields named in ``ignore`` may differ, e.g. the world size of a run allowed to resize)."""
    import torch
    p = _located(path)
    if not checkpoint_exists(p):
        raise FileNotFoundError(f"no checkpoint at {p}")
    try:
        src = p if isinstance(p, Path) else io.BytesIO(paths.read_bytes(p))
        state = torch.load(src, map_location=map_location, weights_only=True)
    except Exception as e:  # corrupt file or pickled objects
        raise CheckpointMismatch(f"cannot load checkpoint {p} with weights_only=True: {e}") from e
    if compat is not None:
        theirs = state.get("compat", {}) if isinstance(state, dict) else {}
        diff = sorted(k for k in set(compat) | set(theirs)
                      if k not in ignore and compat.get(k) != theirs.get(k))
        if diff:
            detail = ", ".join(f"{k}: checkpoint {theirs.get(k)!r} vs now {compat.get(k)!r}"
                               for k in diff)
            raise CheckpointMismatch(f"checkpoint {p} is incompatible with this run ({detail}); "
                                     "use another checkpoint directory or the same config")
    return state
