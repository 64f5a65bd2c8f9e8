"""Per-sample columns joined to sample identity, so they can follow a sample across versions.

A value computed from a sample (an IL score, a champion's loss, InfoBatch's last loss) stays
valid exactly while the sample is unchanged (``sample_ids.py``). A ``KeyedTable`` holds such
columns with the identity of each row; ``carry`` lays them onto another version's samples, and
the rows that find no match (new, changed, relabelled) are left for the caller to compute or to
start afresh. Stored as one ``.npz``: the identity columns, the value columns and any plain
metadata arrays the owner adds (no pickle, written atomically).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from sluice.errors import StorageError
from sluice.storage.sample_ids import SampleIds, match, save_npz


@dataclass(frozen=True)
class KeyedTable:
    """Equal-length 1-D ``columns``, row ``i`` belonging to the sample ``ids[i]``."""
    ids: SampleIds
    columns: dict[str, np.ndarray]

    def __post_init__(self) -> None:
        for name, col in self.columns.items():
            if col.shape != (len(self.ids),):
                raise StorageError(f"keyed column {name!r} has shape {col.shape}, the table {len(self.ids)} rows")

    def __len__(self) -> int:
        return len(self.ids)

    @classmethod
    def empty(cls, dtypes: dict[str, np.dtype | type]) -> "KeyedTable":
        """A table of no rows with these columns."""
        ids = SampleIds(np.empty(0, np.uint64), np.empty(0, np.uint32), np.empty(0, np.int64))
        return cls(ids, {k: np.empty(0, d) for k, d in dtypes.items()})

    def take(self, idx: np.ndarray) -> "KeyedTable":
        """The rows ``idx``, in that order."""
        i = np.asarray(idx, dtype=np.int64)
        return KeyedTable(self.ids.take(i), {k: v[i] for k, v in self.columns.items()})

    def carry(self, ids: SampleIds, rows: np.ndarray | None = None) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The columns laid onto ``ids`` (another version's samples): a row whose sample is in
        this table (same key, content and label) takes its values, every other row zero of the
        column's dtype; and which rows found theirs. ``rows``: only these rows of ``ids`` may take
        a value (default: all)."""
        if rows is None:
            found_at, src = match(self.ids, ids)
        else:
            at = np.asarray(rows, dtype=np.int64)
            hit, src = match(self.ids, ids.take(at))
            found_at = at[hit]
        found = np.zeros(len(ids), bool)
        found[found_at] = True
        out = {}
        for name, col in self.columns.items():
            out[name] = np.zeros(len(ids), col.dtype)
            out[name][found_at] = col[src]
        return out, found

    def concat(self, other: "KeyedTable") -> "KeyedTable":
        """This table's rows, then ``other``'s (the same columns)."""
        a, b = self.ids, other.ids
        ids = SampleIds(np.concatenate([a.keys, b.keys]), np.concatenate([a.content, b.content]),
                        np.concatenate([a.labels, b.labels]))
        return KeyedTable(ids, {k: np.concatenate([v, other.columns[k]]) for k, v in self.columns.items()})

    def distinct(self) -> "KeyedTable":
        """One row per sample (its first), in table order."""
        _, first = np.unique(self.ids.packed(), return_index=True)
        return self.take(np.sort(first))

    def save(self, path: str | os.PathLike, meta: dict[str, np.ndarray] | None = None) -> bytes:
        """Write the table and its owner's ``meta`` arrays as one ``.npz`` atomically; returns
        the bytes written (so the owner can record their sha256)."""
        return save_npz(path, {**self.ids.arrays(), **self.columns, **(meta or {})})

    @classmethod
    def from_arrays(cls, data: dict[str, np.ndarray], dtypes: dict[str, np.dtype | type]) -> "KeyedTable":
        """The table in ``data`` (a stored ``.npz``'s arrays, ``sample_ids.load_npz``) with the
        columns ``dtypes`` names; StorageError or KeyError when they are missing or disagree in
        length."""
        return cls(SampleIds.from_arrays(data), {k: np.asarray(data[k], d) for k, d in dtypes.items()})
