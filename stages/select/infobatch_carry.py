"""InfoBatch's per-sample table carried from the champion into a warm run.

The champion's training checkpoint holds its InfoBatch table (``InfoBatchSelector.state_dict``
in each rank's ``selector`` entry): each sample's last training loss and whether it was trained,
aligned to the split index of the champion's dataset version, plus every rank's observations not
yet all-gathered (folded in here, in rank order, as the next gather would have). A warm run of a
later version starts from it: a sample with the same key, content CRC and label
(``storage/sample_ids.py``) that the warm plan counts as already learnt keeps its loss and seen
flag at its index in tonight's split (``storage/keyed_table.py`` lays them there); every other
sample (new, changed, relabelled, removed and re-added, deleted) starts unseen, so InfoBatch never
prunes it before it has trained it.

The table travels as a plain ``.npz`` (``loss`` float32, ``seen`` bool, tonight's ``fingerprint``
and ``split``; no pickle) named by ``SelectionSpec.carried_table``; every rank loads the same file
when it builds its selector, so DDP ranks start in step. A resumed run restores its own table
from its checkpoint over it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sluice.errors import SelectionError, StorageError
from sluice.storage.artifact import open_artifact
from sluice.storage.keyed_table import KeyedTable
from sluice.storage.sample_ids import load_npz, save_npz, split_ids

TABLE = "infobatch_carried.npz"


@dataclass(frozen=True)
class CarriedTable:
    """The carried table's path (None when nothing is carried), its matched rows, and why."""
    path: str | None
    rows: int
    why: str


def checkpoint_table(state: Any) -> tuple[np.ndarray, np.ndarray] | str:
    """``(loss, seen)`` of the InfoBatch table in a training checkpoint's state, pending
    observations folded in; or why the checkpoint holds none."""
    ranks = state.get("ranks") if isinstance(state, dict) else None
    if not ranks or not all(isinstance(r, dict) for r in ranks):
        return "it holds no per-rank training state"
    sel = [r.get("selector") for r in ranks]
    if all(s is None for s in sel):
        return "it was trained without a selection method"
    if not all(isinstance(s, dict) and isinstance(s.get("loss"), torch.Tensor)
               and isinstance(s.get("seen"), torch.Tensor) for s in sel):
        return "its selector state is another method's (no InfoBatch loss and seen tables)"
    loss, seen = sel[0]["loss"], sel[0]["seen"]
    if loss.ndim != 1 or seen.shape != loss.shape or seen.dtype != torch.bool or not loss.is_floating_point():
        return f"its InfoBatch table is malformed (loss {tuple(loss.shape)}, seen {tuple(seen.shape)} {seen.dtype})"
    loss, seen = loss.float().numpy().copy(), seen.numpy().copy()
    for s in sel:  # every rank's pending observations, in rank order (flush's all-gather order)
        idx, val = s.get("pending_index"), s.get("pending_loss")
        if idx is None or not idx.numel():
            continue
        i = idx.to(torch.int64).numpy()
        if i.min() < 0 or i.max() >= loss.size or val is None or val.numel() != i.size:
            return "its InfoBatch pending observations do not fit its table"
        loss[i], seen[i] = val.float().numpy(), True
    if not np.isfinite(loss[seen]).all():
        return "its InfoBatch table holds NaN/inf losses"
    return loss, seen


def carry_table(table: tuple[np.ndarray, np.ndarray], champion_root: str | os.PathLike, root: str | os.PathLike,
                split: str, learnt: np.ndarray, out_dir: str | os.PathLike) -> CarriedTable:
    """The champion's InfoBatch table (``checkpoint_table`` of its checkpoint, trained on the
    version at ``champion_root``) mapped into the index space of ``split`` of the version at
    ``root``, for the rows ``learnt`` (tonight's indices the warm plan counts as already learnt)
    whose key, content and label are unchanged; written to ``out_dir``. Nothing is carried, and
    the reason is given, when the versions cannot be matched."""
    loss, seen = table
    with open_artifact(champion_root) as a:
        theirs, their_live = split_ids(a, split), a.live(split)
    with open_artifact(root) as a:
        ours, fingerprint = split_ids(a, split), a.fingerprint
    if theirs is None or ours is None:
        return CarriedTable(None, 0, "InfoBatch starts empty: a version was written before content sums "
                                     "(nothing to tell an unchanged sample by)")
    if loss.size != len(theirs):
        return CarriedTable(None, 0, f"InfoBatch starts empty: the champion's table holds {loss.size} rows, "
                                     f"its version's {split} split {len(theirs)} samples")
    # the champion's live samples only: a key removed and re-added sits at two indices, the old unused
    champion = KeyedTable(theirs, {"loss": np.asarray(loss, np.float32), "seen": np.asarray(seen, bool)})
    champion = champion.take(their_live)
    carried, found = champion.carry(ours, rows=learnt)
    out_loss, out_seen = carried["loss"], carried["seen"]
    rows = int(found.sum())
    path = Path(out_dir) / TABLE
    save_npz(path, {"loss": out_loss, "seen": out_seen, "fingerprint": np.array(fingerprint),
                    "split": np.array(split)})
    return CarriedTable(str(path), rows,
                        f"InfoBatch starts from the champion's table: {rows} unchanged samples carried "
                        f"({int(out_seen.sum())} with a loss); the other {len(ours) - rows} start unseen")


def load_table(path: str | os.PathLike, split_size: int, fingerprint: str | None) -> dict[str, torch.Tensor]:
    """A carried table as the selector takes it (``SelectorContext.carried``), checked against
    the split it is for."""
    try:
        data = load_npz(path)
        loss, seen = np.asarray(data["loss"]), np.asarray(data["seen"])
        theirs = str(data["fingerprint"])
    except (StorageError, KeyError) as e:
        raise SelectionError(f"carried selector table {path} is unreadable: {e}") from None
    if fingerprint is not None and theirs != fingerprint:
        raise SelectionError(f"carried selector table {path} is for dataset version {theirs[:16]}, "
                             f"this run trains on {fingerprint[:16]}")
    if loss.shape != (split_size,) or seen.shape != (split_size,) or seen.dtype != bool \
            or loss.dtype != np.float32:
        raise SelectionError(f"carried selector table {path} holds loss {loss.shape} {loss.dtype} and seen "
                             f"{seen.shape} {seen.dtype}; the split has {split_size} samples")
    if not np.isfinite(loss).all():
        raise SelectionError(f"carried selector table {path} holds NaN/inf losses")
    return {"loss": torch.from_numpy(loss.copy()), "seen": torch.from_numpy(seen.copy())}
