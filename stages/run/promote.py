"""Evaluate and promote, for every kind of data: grade the candidate (and, on another version or
another way of grading, the champion) on samples neither trained on, by the kind's metric
(accuracy for images, bits per byte for text: which way is better is the kind's), register the
candidate with what it trained on and what it needs beside its checkpoint, and move the champion
pointer only when the candidate is better (``storage.registry``)."""
from __future__ import annotations

import os
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sluice.errors import RegistryError
from sluice.stages.kinds import DataConfig, DataKind, DatasetVersion
from sluice.stages.run.grading import candidate_lineage, champion_lineage, grade
from sluice.storage.manifest import SPLITS
from sluice.storage.registry import Candidate, Registry


class PromotionConfig(BaseModel):
    """Which split decides promotion (``eval_split``, the validation split by default) and which is
    only reported (``report_split``: the test split, also the one training curves are drawn on)."""
    model_config = ConfigDict(extra="forbid")
    metric: str = Field("auto", description="what the registry records and compares: auto = <eval_split>_<the "
                        "kind's metric>: val_acc for images (higher is better), val_bpb for text (bits per "
                        "byte, lower is better)")
    eval_split: str = Field("val", description=f"the split promotion decides on: one of {', '.join(SPLITS)}")
    report_split: str = Field("test", description=f"the split only reported (and charted): one of {', '.join(SPLITS)}")
    margin: float = Field(0.0, ge=0, description="a candidate must beat the champion by more than this")

    @field_validator("eval_split", "report_split")
    @classmethod
    def _a_split(cls, v: str) -> str:
        if v not in SPLITS:
            raise ValueError(f"unknown split {v!r}; a dataset artifact has the splits {', '.join(SPLITS)}")
        return v

    def for_kind(self, kind: DataKind) -> "PromotionConfig":
        """This config with ``auto`` resolved to the kind's metric; another metric is refused."""
        want = f"{self.eval_split}_{kind.metric}"
        if self.metric not in ("auto", want):
            raise ValueError(f"promotion.metric={self.metric!r}: {kind.name} models are promoted by {kind.metric} "
                             f"on promotion.eval_split, {want} (or auto)")
        return self.model_copy(update={"metric": want})


def evaluate_and_promote(kind: DataKind, promotion: PromotionConfig, registry_dir: str | os.PathLike,
                         datasets_dir: str | os.PathLike, version: DatasetVersion, data: DataConfig,
                         trained: dict[str, Any], run: dict[str, Any], *, needs_il: bool,
                         config: dict[str, Any]) -> dict[str, Any]:
    """The promotion decision for one trained candidate on ``version``; ``trained``: the train
    stage's result (checkpoint, summary, warm)."""
    t0 = time.perf_counter()
    split, reported, metric = promotion.eval_split, promotion.report_split, promotion.metric
    if not trained.get("checkpoint"):
        raise RuntimeError("training produced no checkpoint; nothing to evaluate")
    reg = Registry(registry_dir)
    champ = reg.champion()
    why = kind.champion_refusal(champ.metrics.get("data") or {}) if champ is not None else None
    if why:  # before anything is graded or registered: the registry stays as it was
        raise RegistryError(f"champion {champ.model_id} cannot be compared with tonight's candidate: {why}")
    warm = trained.get("warm") or {}
    inherited = reg.trained_hashes(reg.get(warm["parent_model"])) if warm.get("parent_model") else None
    lineage = candidate_lineage(kind, version, needs_il, inherited)
    where = f"{lineage[1]} of this version" + (f" and its parent {warm['parent_model']}'s" if inherited is not None else "")
    files, facts = kind.model_files(version), kind.facts(version)
    how = dict(data=data, files=files, facts=facts)
    graded = kind.key_hashes(version, [split])  # read once: the candidate and the champion are graded on it
    cand = grade(kind, trained["checkpoint"], "candidate", lineage[2], where, version, split, graded, **how)
    report = cand if reported == split else grade(kind, trained["checkpoint"], "candidate", lineage[2], where,
                                                  version, reported, kind.key_hashes(version, [reported]), **how)
    eval_split = f"{version.fingerprint[:16]}/{kind.grading_key(data, split)}"
    now, champ_checked, champ_eval = None, None, None
    if champ is not None and (champ.eval_split != eval_split or champ.metric != metric):
        # Before registering: a refusal here leaves the registry as it was.
        hashes, champ_where = champion_lineage(reg, champ, kind, datasets_dir, version)
        champ_eval = grade(kind, reg.checkpoint_path(champ), f"champion {champ.model_id}", hashes, champ_where,
                           version, split, graded, data=data, files=reg.model_files(champ),
                           facts=champ.metrics.get("data") or {})
        now, champ_checked = champ_eval["value"], champ_eval["unseen_checked"]
    elif champ is not None:
        champ_eval = champ.metrics.get(split)
    weights = {s.name: s.weight for s in version.sources}
    recorded = {"kind": kind.name, "sources": {s.name: s.fingerprint for s in version.sources}, "weights": weights,
                **facts}
    rec = reg.register(Candidate(trained["checkpoint"], dataset_fingerprint=version.fingerprint, eval_split=eval_split,
                                 metric=metric, value=cand["value"],
                                 metrics={split: cand, reported: report, **trained["summary"],
                                          **({"champion_" + split: champ_eval} if now is not None else {}),
                                          "data": recorded},
                                 config=config, run=run, trained_on=lineage,
                                 warm_start=warm if warm.get("parent_model") else None,
                                 higher_is_better=kind.higher_is_better, files=files))
    decision = reg.promote_if_better(rec, margin=promotion.margin, champion_value_now=now,
                                     graded_champion=champ.model_id if now is not None else None)
    unseen = {"candidate_trained_on": lineage[1], "candidate_trained_samples": int(lineage[2].size),
              "samples_checked": cand["unseen_checked"], "champion_samples_checked": champ_checked}
    champ_weights = ((champ.metrics.get("data") or {}).get("weights") if champ is not None else None)
    return {"model_id": rec.model_id, **decision.model_dump(), "metric": metric,
            "higher_is_better": kind.higher_is_better, "eval": cand, "report": report, "eval_split": split,
            "report_split": reported, "by_source": by_source(kind, version, cand, champ_eval, trained["summary"]),
            "mixture": {"weights": weights, "champion_weights": champ_weights,
                        "changed": champ_weights is not None and champ_weights != weights},
            "unseen": unseen, "warm": warm, "wall_s": time.perf_counter() - t0}


def by_source(kind: DataKind, version: DatasetVersion, cand: dict[str, Any], champ: dict[str, Any] | None,
              summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each source's weight, what it served training, and the candidate's and champion's metric
    on it (where the grade broke it down by source)."""
    served = (summary.get("served_by_source") or {}).get("served", {})
    theirs = (champ or {}).get("by_source", {})
    return {s.name: {"weight": s.weight, "trained": served.get(s.name),
                     "candidate": cand.get("by_source", {}).get(s.name, {}).get(kind.metric),
                     "champion": theirs.get(s.name, {}).get(kind.metric)}
            for s in version.sources}
