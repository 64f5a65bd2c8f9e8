"""Evaluate and promote: grade the candidate (and, on a new dataset version, the champion) on
samples neither trained on, register the candidate with what it trained on, and move the
champion pointer only when the candidate is better (``storage.registry``)."""
from __future__ import annotations

import os
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sluice.errors import GradedOnTrainingData, RegistryError
from sluice.stages.run.grading import (candidate_lineage, champion_lineage, grade, grade_tokens, token_key_hashes,
                                       token_lineage)
from sluice.storage.lineage import split_key_hashes
from sluice.storage.manifest import SPLITS
from sluice.storage.registry import Candidate, Registry


class PromotionConfig(BaseModel):
    """Which split decides promotion (``eval_split``, the validation split by default) and which is
    only reported (``report_split``: the test split, also the one training curves are drawn on)."""
    model_config = ConfigDict(extra="forbid")
    metric: str = Field("val_acc", description="what the registry records and compares: val_acc (higher is "
                        "better); with text, <eval_split>_loss, the loss per token (lower is better)")
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


def evaluate_and_promote_tokens(promotion: PromotionConfig, registry_dir: str | os.PathLike, data: dict[str, Any],
                                trained: dict[str, Any], run: dict[str, Any], *, seq_len: int, batch_size: int,
                                config: dict[str, Any]) -> dict[str, Any]:
    """Promotion by validation loss for a language model trained on the text sources ``data``
    (``stages/run/text.prepare_text``): the candidate and (on another set of versions) the
    champion graded per token on every document of ``promotion.eval_split`` once, overall and per
    source, each after proving it trained on none of them; lower is better, by more than
    ``promotion.margin`` (nats per token)."""
    t0 = time.perf_counter()
    split, reported, metric = promotion.eval_split, promotion.report_split, promotion.metric
    if not trained.get("checkpoint"):
        raise RuntimeError("training produced no checkpoint; nothing to evaluate")
    reg = Registry(registry_dir)
    lineage = token_lineage(data)
    where = f"{lineage[1]} of these versions"
    graded = token_key_hashes(data["sources"], [split])
    how = {"seq_len": seq_len, "batch_size": batch_size}
    cand = grade_tokens(trained["checkpoint"], "candidate", lineage[2], where, data, split, graded, **how)
    report = cand if reported == split else grade_tokens(
        trained["checkpoint"], "candidate", lineage[2], where, data, reported,
        token_key_hashes(data["sources"], [reported]), **how)
    # the rows graded depend on the row length too: another length is another evaluation
    eval_split = f"{data['fingerprint'][:16]}/{split}/seq{seq_len}"
    champ = reg.champion()
    now, champ_checked, champ_eval = None, None, None
    if champ is not None:
        if (champ.metrics.get("data") or {}).get("tokenizer_sha256") != data["tokenizer_sha256"]:
            # Before registering: a refusal here leaves the registry as it was.
            what = (champ.metrics.get("data") or {}).get("tokenizer_sha256")
            raise RegistryError(
                f"champion {champ.model_id} was not trained on tokens of tonight's tokenizer "
                f"({'its ' + what[:12] if what else 'it is no language model of these sources'}, tonight's "
                f"{data['tokenizer_sha256'][:12]}): losses over other ids do not compare. Give the text "
                "pipeline its own data_root (its own registry), or keep the tokenizer.")
        if champ.eval_split == eval_split and champ.metric == metric:
            champ_eval = champ.metrics.get(split)
        else:
            hashes = reg.trained_hashes(champ)
            if hashes is None or champ.trained_on is None:
                raise GradedOnTrainingData(f"champion {champ.model_id} has no record of what it trained on, so "
                                           "nothing proves it unseen on tonight's split")
            champ_eval = grade_tokens(reg.checkpoint_path(champ), f"champion {champ.model_id}", hashes,
                                      f"{champ.trained_on.splits} of versions {champ.trained_on.dataset_fingerprint[:16]}",
                                      data, split, graded, **how)
            now, champ_checked = champ_eval["loss"], champ_eval["unseen_checked"]
    sources = {s["name"]: s["fingerprint"] for s in data["sources"]}
    weights = {s["name"]: s["weight"] for s in data["sources"]}
    rec = reg.register(Candidate(trained["checkpoint"], dataset_fingerprint=data["fingerprint"], eval_split=eval_split,
                                 metric=metric, value=cand["loss"],
                                 metrics={split: cand, reported: report, **trained["summary"],
                                          **({"champion_" + split: champ_eval} if champ_eval else {}),
                                          "data": {"modality": "tokens", "tokenizer_sha256": data["tokenizer_sha256"],
                                                   "sources": sources, "weights": weights}},
                                 config=config, run=run, trained_on=lineage))
    decision = reg.promote_if_better(rec, margin=promotion.margin, champion_value_now=now,
                                     graded_champion=champ.model_id if now is not None else None)
    unseen = {"candidate_trained_on": lineage[1], "candidate_trained_samples": int(lineage[2].size),
              "samples_checked": cand["unseen_checked"], "champion_samples_checked": champ_checked}
    champ_by_source = (champ_eval or {}).get("loss_by_source", {})
    served = (trained["summary"].get("served_by_source") or {}).get("served", {})
    by_source = {name: {"candidate": cand["loss_by_source"].get(name), "champion": champ_by_source.get(name),
                        "weight": weights.get(name), "trained_tokens": served.get(name)}
                 for name in dict.fromkeys([*weights, *cand["loss_by_source"]])}
    champ_weights = ((champ.metrics.get("data") or {}).get("weights") if champ is not None else None)
    mixture = {"weights": weights, "champion_weights": champ_weights,
               "changed": champ_weights is not None and champ_weights != weights}
    return {"model_id": rec.model_id, **decision.model_dump(), "metric": metric, "eval": cand, "report": report,
            "eval_split": split, "report_split": reported, "loss_by_source": by_source, "mixture": mixture,
            "unseen": unseen,
            "warm": trained.get("warm") or {}, "wall_s": time.perf_counter() - t0}
