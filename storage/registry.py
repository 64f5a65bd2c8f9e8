"""Model registry: an immutable record per trained model, and a ``champion`` pointer that moves
only when a candidate beats the champion on the same evaluation split by a margin (a higher
accuracy, or a lower loss).

Layout under the registry root::

    models/<model_id>/record.json   written once, never changed
    models/<model_id>/checkpoint.pt  the candidate's checkpoint, copied in atomically
    models/<model_id>/trained_keys.npy  what it trained on (storage/lineage.py), when recorded
    models/<model_id>/checkpoint.losses.npz  its per-sample losses by key, filled as replay asks
                                     (stages/train/loss_cache.py)
    champion.json                    the pointer (and its history), replaced atomically
    .lock                            serialises promotions (flock)

A failed or crashed run never registers a record, so it can never move the pointer.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from sluice.errors import RegistryError
from sluice.storage import atomic
from sluice.storage.lineage import TrainedOn, load_hashes, save_hashes
from sluice.storage.locking import exclusive


def lower_is_better(metric: str, higher_is_better: bool | None = None) -> bool:
    """Which way ``metric`` wins: as its record says (``higher_is_better``, from the kind of data
    that measured it: accuracy higher, bits per byte lower); a record from before it said so: a
    loss (``val_loss``) lower, any other metric (``val_acc``) higher."""
    if higher_is_better is not None:
        return not higher_is_better
    return metric.endswith("loss")


class ModelRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_id: str
    created_at: str
    dataset_fingerprint: str
    eval_split: str  # "<dataset fingerprint[:16]>/<split>": what the metric was measured on
    metric: str
    value: float
    metrics: dict[str, Any] = Field(default_factory=dict)
    config: dict[str, Any] = Field(default_factory=dict)
    checkpoint: str  # relative to the registry root
    run: dict[str, Any] = Field(default_factory=dict)  # e.g. Prefect flow run id/name
    trained_on: TrainedOn | None = None  # None: registered before lineage was recorded
    warm_start: dict[str, Any] | None = None  # parent model and version, replay policy and counts
    higher_is_better: bool | None = None  # which way the metric wins (None: a record from before it was kept)
    files: dict[str, str] = Field(default_factory=dict)  # what the model needs beside its checkpoint (a tokenizer)


@dataclass(frozen=True)
class Candidate:
    """A trained model asking to be registered: its checkpoint, the dataset version and split it
    was graded on and its score there, and where it came from. ``trained_on``: the dataset
    fingerprint, the splits and the key hashes (``lineage.split_key_hashes``) the model learnt
    from, so that it is never graded on them later. ``warm_start``: the warm run's plan
    (``stages/run/warm.py``); its replayed keys file is copied in beside the record."""
    checkpoint: str | os.PathLike
    dataset_fingerprint: str
    eval_split: str
    metric: str
    value: float
    metrics: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    run: dict[str, Any] = field(default_factory=dict)
    trained_on: tuple[str, list[str], np.ndarray] | None = None
    warm_start: dict[str, Any] | None = None
    higher_is_better: bool | None = None
    files: dict[str, str | os.PathLike] = field(default_factory=dict)  # name -> file, copied in beside the record


class Decision(BaseModel):
    promoted: bool
    reason: str
    candidate: str
    champion_before: str | None = None
    champion_value: float | None = None
    candidate_value: float


def _copy_lineage(d: Path, model_id: str, trained_on: tuple[str, list[str], np.ndarray] | None) -> TrainedOn | None:
    """The key hashes the model trained on, saved beside its record, and the record's note of them."""
    if trained_on is None:
        return None
    fingerprint, splits, hashes = trained_on
    save_hashes(d / "trained_keys.npy", hashes)
    return TrainedOn(dataset_fingerprint=fingerprint, splits=list(splits), count=int(hashes.size),
                     keys_file=f"models/{model_id}/trained_keys.npy")


def _copy_warm_start(d: Path, model_id: str, warm_start: dict[str, Any] | None) -> dict[str, Any] | None:
    """The warm run's plan, its replayed keys file copied in beside the record."""
    if not (warm_start and warm_start.get("replayed_keys")):
        return warm_start
    replayed = Path(warm_start["replayed_keys"])
    atomic.write_with(d / "replayed_keys.npy", lambda tmp: shutil.copyfile(replayed, tmp))
    return {**warm_start, "replayed_keys": f"models/{model_id}/replayed_keys.npy"}


class Registry:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)  # created by the first register(), never by reading

    # ------------------------------------------------------------------ records
    def register(self, candidate: Candidate) -> ModelRecord:
        """Copy the candidate's checkpoint in and write an immutable record for it."""
        c = candidate
        if not math.isfinite(c.value):
            raise RegistryError(f"refusing to register a model whose {c.metric} is {c.value}")
        src = Path(c.checkpoint)
        if not src.is_file():
            raise RegistryError(f"checkpoint not found: {src}")
        now = datetime.now(timezone.utc)
        model_id = f"{now.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
        d = self.root / "models" / model_id
        d.mkdir(parents=True)  # the registry's folders appear with its first model
        atomic.write_with(d / "checkpoint.pt", lambda tmp: shutil.copyfile(src, tmp))
        files = {}
        for name, path in (c.files or {}).items():
            dest = d / f"{name}{Path(path).suffix}"
            atomic.write_with(dest, lambda tmp, path=path: shutil.copyfile(path, tmp))
            files[name] = f"models/{model_id}/{dest.name}"
        rec = ModelRecord(model_id=model_id, created_at=now.isoformat(), dataset_fingerprint=c.dataset_fingerprint,
                          eval_split=c.eval_split, metric=c.metric, value=float(c.value), metrics=c.metrics or {},
                          config=c.config or {}, checkpoint=f"models/{model_id}/checkpoint.pt", run=c.run or {},
                          trained_on=_copy_lineage(d, model_id, c.trained_on),
                          warm_start=_copy_warm_start(d, model_id, c.warm_start),
                          higher_is_better=c.higher_is_better, files=files)
        atomic.write_bytes(d / "record.json", (rec.model_dump_json(indent=2) + "\n").encode())
        return rec

    def get(self, model_id: str) -> ModelRecord:
        p = self.root / "models" / model_id / "record.json"
        if not p.is_file():
            raise RegistryError(f"no model {model_id!r} in registry {self.root}")
        return ModelRecord.model_validate_json(p.read_text())

    def checkpoint_path(self, rec: ModelRecord) -> Path:
        return self.root / rec.checkpoint

    def model_files(self, rec: ModelRecord) -> dict[str, str]:
        """What ``rec`` was registered with beside its checkpoint: name -> path."""
        return {name: str(self.root / rel) for name, rel in rec.files.items()}

    def trained_hashes(self, rec: ModelRecord) -> np.ndarray | None:
        """The key hashes ``rec`` trained on; None for a record that predates lineage."""
        if rec.trained_on is None:
            return None
        p = self.root / rec.trained_on.keys_file
        try:
            return load_hashes(p)
        except (OSError, ValueError) as e:
            raise RegistryError(f"model {rec.model_id}: what it trained on ({p}) is unreadable: {e}") from None

    def list(self) -> list[ModelRecord]:
        out = []
        for p in sorted((self.root / "models").glob("*/record.json")):
            with contextlib.suppress(ValueError, OSError):
                out.append(ModelRecord.model_validate_json(p.read_text()))
        return sorted(out, key=lambda r: r.created_at)

    # ------------------------------------------------------------------ champion
    def _pointer(self) -> dict[str, Any]:
        p = self.root / "champion.json"
        return json.loads(p.read_text()) if p.is_file() else {"model_id": None, "history": []}

    def champion(self) -> ModelRecord | None:
        mid = self._pointer().get("model_id")
        return self.get(mid) if mid else None

    def history(self) -> list[dict[str, Any]]:
        return self._pointer().get("history", [])

    def _locked(self):
        return exclusive(self.root / ".lock")

    def promote_if_better(self, candidate: ModelRecord, margin: float = 0.0,
                          champion_value_now: float | None = None, graded_champion: str | None = None) -> Decision:
        """Move the champion pointer to ``candidate`` iff it beats the champion by ``margin``
        (higher by more than it, or lower where lower is better: ``lower_is_better``).

        Both must be measured on the same evaluation split. When the champion was evaluated on
        another split (say, an older dataset version), pass ``champion_value_now``: its metric
        re-measured on the candidate's split, and ``graded_champion``, the model it was measured
        for: if another run moved the pointer meanwhile, the comparison is refused.
        """
        with self._locked():
            ptr = self._pointer()
            champ = self.get(ptr["model_id"]) if ptr.get("model_id") else None
            if champion_value_now is not None and graded_champion is not None and \
                    (champ is None or champ.model_id != graded_champion):
                raise RegistryError(f"the champion changed from {graded_champion} to "
                                    f"{champ.model_id if champ else 'none'} while the candidate was graded: "
                                    "run again to compare with the new champion")
            if champ is None:
                decision = Decision(promoted=True, reason="no champion yet", candidate=candidate.model_id,
                                    candidate_value=candidate.value)
            else:
                if champ.eval_split == candidate.eval_split and champ.metric == candidate.metric:
                    cv = champ.value
                elif champion_value_now is not None:
                    cv = champion_value_now
                else:
                    raise RegistryError(f"champion was measured by {champ.metric} on {champ.eval_split}, "
                                        f"the candidate by {candidate.metric} on {candidate.eval_split}: "
                                        "re-evaluate the champion the candidate's way")
                if lower_is_better(candidate.metric, candidate.higher_is_better):
                    better = candidate.value < cv - margin
                    reason = (f"{candidate.metric} {candidate.value:.4f} {'<' if better else '>='} champion "
                              f"{cv:.4f} - margin {margin:.4f}")
                else:
                    better = candidate.value > cv + margin
                    reason = (f"{candidate.metric} {candidate.value:.4f} {'>' if better else '<='} champion "
                              f"{cv:.4f} + margin {margin:.4f}")
                decision = Decision(promoted=better, reason=reason, candidate=candidate.model_id,
                                    champion_before=champ.model_id, champion_value=cv,
                                    candidate_value=candidate.value)
            if decision.promoted:
                history = ptr.get("history", []) + [{
                    "model_id": candidate.model_id, "at": datetime.now(timezone.utc).isoformat(),
                    "replaced": champ.model_id if champ else None, "reason": decision.reason}]
                atomic.write_json(self.root / "champion.json", {"model_id": candidate.model_id, "history": history})
            return decision

    def format_list(self) -> str:
        recs = self.list()
        if not recs:
            return f"no models registered in {self.root}"
        champ = self._pointer().get("model_id")
        lines = [f"{'':2}{'model':<24} {'created':<20} {'dataset':<17} {'metric':<10} {'value':>7}"]
        for r in recs:
            mark = "* " if r.model_id == champ else "  "
            lines.append(f"{mark}{r.model_id:<24} {r.created_at[:19]:<20} {r.dataset_fingerprint[:16]:<17} "
                         f"{r.metric:<10} {r.value:>7.4f}")
        lines.append(f"(* champion; registry {self.root})")
        return "\n".join(lines)
