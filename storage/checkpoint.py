"""Training checkpoints: written atomically, read with ``weights_only=True``, checked for fit.

A checkpoint is a dict of tensors and plain Python values (no pickled objects), so loading it
cannot run code. It carries a ``compat`` record (model name and config hash); loading refuses a
checkpoint whose record differs from the caller's, naming the fields that differ.
``torch`` is imported inside the functions: the rest of ``storage`` stays torch-free.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sluice.errors import CheckpointMismatch
from sluice.storage.atomic import atomic_path

LAST = "last.pt"


def checkpoint_path(directory: str | os.PathLike) -> Path:
    """Where the latest checkpoint of a run lives."""
    return Path(directory) / LAST


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Write ``state`` atomically: readers see the previous checkpoint or this one, whole."""
    import torch
    if "compat" not in state:
        raise ValueError("a checkpoint needs a 'compat' record (model name, config hash)")
    with atomic_path(path) as tmp:
        torch.save(state, tmp)
    return Path(path)


def load_checkpoint(path: str | os.PathLike, compat: dict[str, Any] | None = None,
                    map_location: str = "cpu", ignore: tuple[str, ...] = ()) -> dict[str, Any]:
    """Load safely; if ``compat`` is given, refuse a checkpoint written for something else
    (fields named in ``ignore`` may differ, e.g. the world size of a run allowed to resize)."""
    import torch
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no checkpoint at {p}")
    try:
        state = torch.load(p, map_location=map_location, weights_only=True)
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
