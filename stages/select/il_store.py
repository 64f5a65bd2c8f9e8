"""The IL model and what it saw, stored beside the scores it produced, so the next dataset
version can score only its new samples with the same model.

Beside ``<kind>-<split>-<hash>.npy`` (``storage/scores.py``)::

    <kind>-<split>-<hash>.model.pt   the IL model's state dict (``torch.load(weights_only=True)``)
    <kind>-<split>-<hash>.ids.npz    a ``KeyedTable`` of the scored samples, aligned to the scores
                                     (keys/content/labels: key hash, content CRC and label; valid:
                                     which values are that model's loss, False for a removed index's
                                     filler), plus holdout_*: the same ids of each holdout sample
                                     the model trained on

Both are written before the scores and their sidecar, which records their sha256 under
``extra["il_model"]``: the sidecar (written last) vouches for the model, as it does for the array.
Invariant: every valid value of one scores file is the stored model's loss on that sample.
"""
from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sluice.errors import StorageError
from sluice.stages.models import build_model
from sluice.stages.pixels import channels_last
from sluice.stages.select.config import ILModelConfig
from sluice.storage import atomic
from sluice.storage.keyed_table import KeyedTable
from sluice.storage.paths import exists, read_bytes
from sluice.storage.sample_ids import SampleIds, load_npz
from sluice.storage.scores import Scores, config_hash, save_scores, scores_path

MODEL_SUFFIX, IDS_SUFFIX = ".model.pt", ".ids.npz"


@dataclass(frozen=True)
class ILModelRecord:
    """An IL model and what it learnt from: what is stored beside every score it produced."""
    weights: bytes  # its state dict as ``torch.save`` bytes (``model_bytes``)
    in_channels: int
    num_classes: int
    trained_on: str  # fingerprint of the version whose holdout trained the model
    holdout: SampleIds  # what it trained on

    def model(self, config: ILModelConfig, device: str | torch.device = "cpu") -> torch.nn.Module:
        """The IL model, rebuilt and loaded, in eval mode."""
        return rebuild_model(config, self.in_channels, self.num_classes, self.weights, device)


def rebuild_model(config: ILModelConfig, in_channels: int, num_classes: int, weights: bytes,
                  device: str | torch.device = "cpu") -> torch.nn.Module:
    """An IL model built from ``config`` and loaded from its ``model_bytes``, in eval mode."""
    m = build_model(config.architecture, in_channels=in_channels, num_classes=num_classes, **config.model_kwargs)
    m.load_state_dict(_state(weights))
    return channels_last(m.to(device)).eval()


@dataclass(frozen=True)
class StoredIL(ILModelRecord):
    """A stored scores record with the model that made it and the identities it covers."""
    scores: Scores
    scored: SampleIds  # aligned to scores.values
    valid: np.ndarray  # bool, aligned to scores.values

    def by_id(self) -> KeyedTable:
        """The model's scores by sample (column ``score``), a removed index's filler left out."""
        return KeyedTable(self.scored, {"score": self.scores.values}).take(np.flatnonzero(self.valid))


def _state(weights: bytes) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(weights), map_location="cpu", weights_only=True)


def side_paths(npy_path: str) -> tuple[str, str]:
    """The model's and the ids' paths beside a scores array."""
    stem = npy_path[: -len(".npy")]
    return stem + MODEL_SUFFIX, stem + IDS_SUFFIX


def model_bytes(model: torch.nn.Module) -> bytes:
    """The model's state dict as ``torch.save`` bytes (tensors only: loadable with weights_only)."""
    buf = io.BytesIO()
    torch.save({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, buf)
    return buf.getvalue()


def save_il(scores_root: str, values: np.ndarray, *, fingerprint: str, kind: str, split: str,
            config: dict[str, Any], extra: dict[str, Any], il: ILModelRecord, scored: SampleIds,
            valid: np.ndarray) -> Scores:
    """Store the model and ids, then the scores whose sidecar vouches for them."""
    if len(scored) != len(values) or len(valid) != len(values):
        raise StorageError(f"{len(values)} scores but ids for {len(scored)} and {len(valid)} valid flags")
    npy = scores_path(scores_root, fingerprint, kind, split, config_hash(config))
    model_path, ids_path = side_paths(npy)
    atomic.write_bytes(model_path, il.weights)
    ids = KeyedTable(scored, {"valid": np.asarray(valid, bool)}).save(ids_path, il.holdout.arrays("holdout_"))
    meta = {"model_sha256": hashlib.sha256(il.weights).hexdigest(), "ids_sha256": hashlib.sha256(ids).hexdigest(),
            "in_channels": int(il.in_channels), "num_classes": int(il.num_classes), "trained_on": il.trained_on}
    return save_scores(scores_root, values, fingerprint=fingerprint, kind=kind, split=split, config=config,
                       extra={**extra, "il_model": meta})


def load_il(scores: Scores) -> tuple[StoredIL | None, str]:
    """The model and ids stored with ``scores``, or None and why they cannot be used (scores
    written before models were stored, a side file missing, or one that is not what the sidecar
    recorded)."""
    meta = scores.extra.get("il_model")
    if not isinstance(meta, dict):
        return None, f"the scores at {scores.path} were stored without their IL model"
    model_path, ids_path = side_paths(scores.path)
    if not exists(model_path) or not exists(ids_path):
        return None, f"the IL model or ids stored with {scores.path} are missing"
    raw_model, raw_ids = read_bytes(model_path), read_bytes(ids_path)
    if hashlib.sha256(raw_model).hexdigest() != meta.get("model_sha256") or \
            hashlib.sha256(raw_ids).hexdigest() != meta.get("ids_sha256"):
        return None, f"the IL model or ids stored with {scores.path} differ from what its sidecar recorded"
    try:
        state = _state(raw_model)
        ids = load_npz(ids_path, raw_ids)
        holdout, scored = SampleIds.from_arrays(ids, "holdout_"), KeyedTable.from_arrays(ids, {"valid": bool})
    except (StorageError, KeyError, RuntimeError, ValueError, OSError) as e:
        return None, f"the IL model or ids stored with {scores.path} are unreadable: {e}"
    if len(scored) != len(scores) or not isinstance(state, dict):
        return None, f"the ids stored with {scores.path} do not cover its {len(scores)} scores"
    return StoredIL(weights=raw_model, in_channels=int(meta["in_channels"]), num_classes=int(meta["num_classes"]),
                    trained_on=str(meta.get("trained_on", scores.fingerprint)), holdout=holdout, scores=scores,
                    scored=scored.ids, valid=scored.columns["valid"]), ""
