"""What a sample *is*, across dataset versions: its key, its pixels and its label.

Per-sample state computed from a sample (an irreducible loss, a champion's loss) stays valid in
the next dataset version exactly when the sample is unchanged: the same key (``lineage.hash_keys``),
the same pixels (the split's ``content.npy``, a CRC-32 of the decoded image) and the same label
(``labels.npy``, relabels included). ``SampleIds`` holds those three, aligned to a split index, so
that a table computed on one version can be joined to the next by identity instead of being
recomputed; a deleted, changed or relabelled sample simply finds no match. Tables are stored as
``.npz`` files (no pickle), written atomically.
"""
from __future__ import annotations

import io
import os
from dataclasses import dataclass

import numpy as np

from sluice.errors import StorageError
from sluice.storage import atomic
from sluice.storage.artifact import DatasetArtifact
from sluice.storage.lineage import hash_keys
from sluice.storage.paths import read_bytes

_ID_DTYPE = np.dtype([("key", "<u8"), ("content", "<u4"), ("label", "<i8")])


@dataclass(frozen=True)
class SampleIds:
    """Key hash, content CRC and label of each sample of a table, in the table's order."""
    keys: np.ndarray  # uint64
    content: np.ndarray  # uint32
    labels: np.ndarray  # int64

    def __post_init__(self) -> None:
        n = len(self.keys)
        if len(self.content) != n or len(self.labels) != n:
            raise StorageError(f"sample ids disagree in length: {n} keys, {len(self.content)} "
                               f"content sums, {len(self.labels)} labels")

    def __len__(self) -> int:
        return int(len(self.keys))

    def take(self, idx: np.ndarray) -> "SampleIds":
        """The ids of the rows ``idx``, in that order."""
        i = np.asarray(idx, dtype=np.int64)
        return SampleIds(self.keys[i], self.content[i], self.labels[i])

    def packed(self) -> np.ndarray:
        """One structured record per sample, comparable as a whole (sortable, searchable)."""
        out = np.empty(len(self), _ID_DTYPE)
        out["key"], out["content"], out["label"] = self.keys, self.content, self.labels
        return out

    def arrays(self, prefix: str = "") -> dict[str, np.ndarray]:
        """The three columns, named for an ``.npz``."""
        return {f"{prefix}keys": self.keys.astype(np.uint64), f"{prefix}content": self.content.astype(np.uint32),
                f"{prefix}labels": self.labels.astype(np.int64)}

    @classmethod
    def from_arrays(cls, data: "np.lib.npyio.NpzFile | dict", prefix: str = "") -> "SampleIds":
        return cls(np.asarray(data[f"{prefix}keys"], np.uint64), np.asarray(data[f"{prefix}content"], np.uint32),
                   np.asarray(data[f"{prefix}labels"], np.int64))


def split_ids(art: DatasetArtifact, split: str) -> SampleIds | None:
    """The ids of every sample of ``split`` (removed ones too), aligned to its index; None for a
    split written before content sums (nothing to tell an unchanged sample by)."""
    content = art.content(split)
    if content is None:
        return None
    labels = art.labels(split)
    keys = hash_keys(art.keys(split))
    return SampleIds(keys, content, labels.astype(np.int64))


def match(old: SampleIds, new: SampleIds) -> tuple[np.ndarray, np.ndarray]:
    """The rows of ``new`` that are in ``old`` (same key, content and label), and for each the
    row of ``old`` it matches: ``(new_rows, old_rows)``, both int64 and ascending in ``new_rows``."""
    if len(old) == 0 or len(new) == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    o, n = old.packed(), new.packed()
    order = np.argsort(o, kind="stable")
    pos = np.searchsorted(o[order], n)
    inside = pos < o.size
    hit = np.zeros(n.size, bool)
    hit[inside] = o[order[pos[inside]]] == n[inside]
    rows = np.flatnonzero(hit).astype(np.int64)
    return rows, order[pos[rows]].astype(np.int64)


def missing(required: SampleIds, present: SampleIds) -> np.ndarray:
    """The rows of ``required`` that ``present`` lacks (deleted, changed or relabelled since)."""
    found, _ = match(present, required)
    mask = np.ones(len(required), bool)
    mask[found] = False
    return np.flatnonzero(mask)


def save_npz(path: str | os.PathLike, arrays: dict[str, np.ndarray]) -> bytes:
    """Write ``arrays`` as one ``.npz`` atomically (local path or URL); returns the bytes written
    (so a caller can record their sha256)."""
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    data = buf.getvalue()
    atomic.write_bytes(path, data)
    return data


def load_npz(path: str | os.PathLike, data: bytes | None = None) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` (never unpickled); ``data``: its bytes when already read."""
    raw = read_bytes(path) if data is None else data
    try:
        with np.load(io.BytesIO(raw), allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (ValueError, OSError) as e:
        raise StorageError(f"{path} is not a readable .npz table: {e}") from None
