"""Evaluate and promote: grade the candidate (and, on a new dataset version, the champion) on
samples neither trained on, register the candidate with what it trained on, and move the
champion pointer only when the candidate is better (``storage.registry``)."""
from __future__ import annotations

import os
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sluice.stages.run.grading import candidate_lineage, champion_lineage, grade
from sluice.storage.lineage import split_key_hashes
from sluice.storage.manifest import SPLITS
from sluice.storage.registry import Candidate, Registry


class PromotionConfig(BaseModel):
    """Which split decides promotion (``eval_split``, the validation split by default) and which is
    only reported (``report_split``: the test split, also the one training curves are drawn on)."""
    model_config = ConfigDict(extra="forbid")
    metric: str = "val_acc"
    eval_split: str = Field("val", description=f"the split promotion decides on: one of {', '.join(SPLITS)}")
    report_split: str = Field("test", description=f"the split only reported (and charted): one of {', '.join(SPLITS)}")
    margin: float = Field(0.0, ge=0, description="a candidate must beat the champion by more than this")

    @field_validator("eval_split", "report_split")
    @classmethod
    def _a_split(cls, v: str) -> str:
        if v not in SPLITS:
            raise ValueError(f"unknown split {v!r}; a dataset artifact has the splits {', '.join(SPLITS)}")
        return v

def evaluate_and_promote(promotion: PromotionConfig, registry_dir: str | os.PathLike,
                         datasets_dir: str | os.PathLike, data: dict[str, Any], trained: dict[str, Any],
                         run: dict[str, Any], *, needs_il: bool, config: dict[str, Any]) -> dict[str, Any]:
    """The promotion decision for one trained candidate on dataset version ``data`` (the
    pipeline's dataset info); ``trained``: the train stage's result (checkpoint, summary, warm)."""
    t0 = time.perf_counter()
    split, reported = promotion.eval_split, promotion.report_split
    if not trained.get("checkpoint"):
        raise RuntimeError("training produced no checkpoint; nothing to evaluate")
    reg = Registry(registry_dir)
    warm = trained.get("warm") or {}
    inherited = reg.trained_hashes(reg.get(warm["parent_model"])) if warm.get("parent_model") else None
    lineage = candidate_lineage(data["root"], data["fingerprint"], needs_il, inherited)
    where = f"{lineage[1]} of this version" + (f" and its parent {warm['parent_model']}'s" if inherited is not None else "")
    graded = split_key_hashes(data["root"], [split])  # read once: the candidate and the champion are graded on it
    cand = grade(trained["checkpoint"], "candidate", lineage[2], where, data["root"], split, graded)  # decides
    report = grade(trained["checkpoint"], "candidate", lineage[2], where, data["root"], reported) \
        if reported != split else cand
    eval_split = f"{data['fingerprint'][:16]}/{split}"
    champ = reg.champion()
    now, champ_checked = None, None
    if champ is not None and (champ.eval_split != eval_split or champ.metric != promotion.metric):
        # Before registering: a refusal here leaves the registry as it was.
        hashes, champ_where = champion_lineage(reg, champ, datasets_dir)
        regraded = grade(reg.checkpoint_path(champ), f"champion {champ.model_id}", hashes, champ_where,
                         data["root"], split, graded)
        now, champ_checked = regraded["acc"], regraded["unseen_checked"]
    rec = reg.register(Candidate(trained["checkpoint"], dataset_fingerprint=data["fingerprint"], eval_split=eval_split,
                                 metric=promotion.metric, value=cand["acc"],
                                 metrics={split: cand, reported: report, **trained["summary"]},
                                 config=config, run=run, trained_on=lineage,
                                 warm_start=warm if warm.get("parent_model") else None))
    decision = reg.promote_if_better(rec, margin=promotion.margin, champion_value_now=now,
                                     graded_champion=champ.model_id if now is not None else None)
    unseen = {"candidate_trained_on": lineage[1], "candidate_trained_samples": int(lineage[2].size),
              "samples_checked": cand["unseen_checked"], "champion_samples_checked": champ_checked}
    return {"model_id": rec.model_id, **decision.model_dump(), "eval": cand, "report": report,
            "eval_split": split, "report_split": reported, "unseen": unseen, "warm": warm,
            "wall_s": time.perf_counter() - t0}
