"""Irreducible-loss scores carried across dataset versions by key: a new version reuses
the nearest earlier version's scores for every unchanged train sample and scores only its new,
changed and relabelled ones, with the same stored IL model.

An IL score is a fixed model's loss on a fixed (pixels, label): reusing it for a sample with the
same key, content CRC and label (``storage/sample_ids.py``, carried by ``storage/keyed_table.py``)
gives exactly the value a rescoring by that model would. The model may be kept only while what
it learnt from is still tonight's holdout: every holdout sample it trained on must still be
there, live, with the same content and label. A deleted one (a deletion request: no model may
keep what it learnt from it), a changed or a relabelled one forces a retrain on tonight's holdout
and a full rescore; so does a holdout that has grown by more than ``il.refresh_growth`` since
(the model would be stale).

The record says what happened, in ``Scores.extra``: ``reused`` (this very version's scores were
found stored), ``reused_from`` (the version whose scores were carried, or None), ``reused_samples``
(live samples whose score was carried), ``scored`` (samples the IL model scored tonight) and
``retrained`` (why an earlier model could not be kept, when one was found).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from sluice.errors import ScoresError, SelectionError
from sluice.stages.data.engine import Parts
from sluice.stages.select.config import ILModelConfig
from sluice.stages.select.il_model import (IL_KIND, Scorer, check_inputs, fit_and_score, irreducible_loss_scores,
                                           resolved_config, score_key, score_with, to_float_images)
from sluice.stages.select.il_parts import scorer
from sluice.stages.select.il_store import ILModelRecord, StoredIL, load_il, model_bytes, save_il
from sluice.storage.artifact import DatasetArtifact
from sluice.storage.ancestry import ancestry
from sluice.storage.sample_ids import SampleIds, missing, split_ids
from sluice.storage.scores import Scores, find_scores

# (split, live_only) -> (uint8 NHWC images, int64 labels), index-aligned unless live_only: the
# caller's loader (stages.load.split_arrays), called only when something must be (re)scored.
Arrays = Callable[[str, bool], tuple[np.ndarray, np.ndarray]]
LOOKBACK = 64  # ancestors searched for stored scores, nearest first (each is one existence check)


def il_scores_for_version(config: ILModelConfig, art: DatasetArtifact, arrays: Arrays, scores_root: str, *,
                          split: str = "train", device: str | torch.device = "cpu",
                          parts: Parts | None = None) -> Scores:
    """IL scores of every ``split`` sample of the version ``art``, aligned to its index: stored
    ones when this version has them, else carried from the nearest ancestor's and completed
    with its model, else computed afresh (model and ids stored beside them for the next version).
    ``parts``: where the scoring pass runs (the engine's: ``il_parts``), else here."""
    hold_all, train_ids = split_ids(art, "holdout"), split_ids(art, split)
    hold_live = art.live("holdout")
    hold_labels, train_labels = art.labels("holdout")[hold_live], art.labels(split)
    # emptiness and the class count from the labels alone, so nothing is decoded before it is needed
    num_classes = check_inputs(hold_labels, hold_labels, train_labels, train_labels, split, None)
    cfg = resolved_config(config, device)
    key = score_key(cfg, num_classes)
    fp = art.fingerprint
    found = find_scores(scores_root, fingerprint=fp, kind=IL_KIND, split=split, config=key, length=len(train_labels))
    if found is not None:
        return _with(found, reused=True)
    if hold_all is None or train_ids is None:  # written before content sums: no identity to carry by
        hx, hy = arrays("holdout", True)
        tx, ty = arrays(split, False)
        s = irreducible_loss_scores(cfg, hx, hy, tx, ty, fp, scores_root, num_classes=num_classes,
                                    split=split, device=device)
        return _with(s, reused_from=None, reused_samples=0, scored=len(ty),
                     retrained="this version has no content sums (written by an older Sluice)")
    holdout = hold_all.take(hold_live)
    score = scorer(parts, cfg, num_classes) if parts is not None else None
    target = _Target(cfg, art, arrays, scores_root, split, key, train_ids, device, score)
    stored, why = _nearest(scores_root, art, split, key)
    if stored is not None:
        why = _refusal(stored, holdout, cfg.refresh_growth, _channels(art))
        if not why:
            return _carry(target, stored)
    return _full(target, holdout, num_classes, why or None)


@dataclass(frozen=True)
class _Target:
    """The split being scored, how its samples are read, and where its scores are stored."""
    cfg: ILModelConfig  # resolved
    art: DatasetArtifact
    arrays: Arrays
    scores_root: str
    split: str
    key: dict
    ids: SampleIds  # every sample of the split, aligned to its index
    device: str | torch.device
    score: Scorer | None = None  # where the scoring pass runs (None: here)

    def save(self, values: np.ndarray, valid: np.ndarray, extra: dict, il: ILModelRecord) -> Scores:
        """Store the scores with the model that made them (and the ids they cover)."""
        s = save_il(self.scores_root, values, fingerprint=self.art.fingerprint, kind=IL_KIND, split=self.split,
                    config=self.key, extra=extra, il=il, scored=self.ids, valid=valid)
        return _with(s, reused=False)


def _with(s: Scores, **extra) -> Scores:
    return Scores(s.values, s.fingerprint, s.kind, s.split, s.config, s.config_hash, s.created, s.path,
                  {**s.extra, **extra})


def _channels(art: DatasetArtifact) -> int | None:
    shape = art.manifest.fields.image.shape
    return shape[2] if shape else None


def _nearest(scores_root: str, art: DatasetArtifact, split: str, key: dict) -> tuple[StoredIL | None, str]:
    """The nearest ancestor's stored scores with a usable model (None, and why, when there is none)."""
    why = ""
    for anc in ancestry(art.root, art.manifest)[:LOOKBACK]:
        try:
            s = find_scores(scores_root, fingerprint=anc, kind=IL_KIND, split=split, config=key)
        except ScoresError as e:  # corrupt or partial: look further back, and say so if nothing is found
            why = why or f"the scores of version {anc[:16]} are unusable ({e})"
            continue
        if s is None:
            continue
        stored, bad = load_il(s)
        if stored is not None:
            return stored, ""
        why = why or bad
    return None, why


def _refusal(stored: StoredIL, holdout: SampleIds, refresh_growth: float, channels: int | None) -> str:
    """Why the stored model may not score tonight's samples ('' when it may)."""
    trained = len(stored.holdout)
    gone = missing(stored.holdout, holdout)
    if gone.size:
        return (f"{gone.size} of the {trained} holdout samples the IL model of version {stored.trained_on[:16]} "
                "trained on were deleted, changed or relabelled since: retrained on tonight's holdout")
    growth = len(holdout) / max(trained, 1) - 1
    if growth > refresh_growth:
        return (f"the holdout grew by {growth:.0%} since the IL model of version {stored.trained_on[:16]} was "
                f"trained (more than il.refresh_growth {refresh_growth:.0%}): retrained on tonight's holdout")
    if channels is not None and channels != stored.in_channels:
        return f"the images have {channels} channels, the stored IL model takes {stored.in_channels}"
    return ""


def _carry(t: _Target, stored: StoredIL) -> Scores:
    """The stored values for unchanged samples, the stored model's for the live rest."""
    carried, valid = stored.by_id().carry(t.ids)  # a removed index is never read: 0 is its filler
    values = carried["score"]
    live = t.art.live(t.split)
    todo = live[~valid[live]]
    t0 = time.perf_counter()
    acc = stored.scores.extra.get("scored_accuracy")
    if todo.size:
        tx, ty = t.arrays(t.split, False)
        vals, acc = score_with(stored.model(t.cfg, t.device), t.cfg, tx[todo], ty[todo], stored.num_classes,
                               t.split, t.device, t.score)
        values[todo], valid[todo] = vals, True
    old = stored.scores.extra
    extra = {"train_seconds": 0.0, "score_seconds": round(time.perf_counter() - t0, 3),
             "holdout_size": len(stored.holdout), "holdout_accuracy": old.get("holdout_accuracy"),
             # on tonight's newly scored samples when there are any (unseen by the model, as before)
             "scored_split": t.split, "scored_accuracy": acc,
             "reused_from": stored.scores.fingerprint, "reused_samples": int(live.size - todo.size),
             "scored": int(todo.size), "retrained": None}
    return t.save(values, valid, extra, stored)


def _full(t: _Target, holdout: SampleIds, num_classes: int, why: str | None) -> Scores:
    """A model trained on tonight's live holdout scores every sample; it is stored with them."""
    hx, hy = t.arrays("holdout", True)
    tx, ty = t.arrays(t.split, False)
    if len(hy) != len(holdout) or len(ty) != len(t.ids):
        raise SelectionError(f"the loader gave {len(hy)} holdout and {len(ty)} {t.split} samples; the "
                             f"artifact has {len(holdout)} live holdout and {len(t.ids)} {t.split} samples")
    values, extra, model = fit_and_score(t.cfg, hx, hy, tx, ty, num_classes, t.split, t.device, t.score)
    il = ILModelRecord(weights=model_bytes(model), in_channels=int(to_float_images(hx[:1], t.cfg).shape[1]),
                       num_classes=num_classes, trained_on=t.art.fingerprint, holdout=holdout)
    extra = {**extra, "reused_from": None, "reused_samples": 0, "scored": int(len(ty)), "retrained": why}
    return t.save(values, np.ones(len(ty), bool), extra, il)


def describe(s: Scores) -> str:
    """One line for the log and the report: stored, carried (how many reused and scored, from
    which version) or computed (and why an earlier model was not kept)."""
    x = s.extra
    if x.get("reused"):
        return f"irreducible loss reused (stored for this version): {s.path}"
    if x.get("reused_from"):
        return (f"irreducible loss carried from version {x['reused_from'][:16]}: {x.get('reused_samples', 0)} "
                f"samples reused, {x.get('scored', 0)} new, changed or relabelled scored with its IL model: {s.path}")
    why = f" ({x['retrained']})" if x.get("retrained") else ""
    return (f"irreducible loss computed: an IL model trained on {x.get('holdout_size', '?')} holdout samples "
            f"scored {x.get('scored', len(s))}{why}: {s.path}")
