"""The training job for one dataset version, assembled from the pipeline's stage configs: what
the ranks train on (candidate batches), evaluate on (every sample of the report split once) and
select with."""
from __future__ import annotations

from typing import Any

from sluice.errors import ConfigError
from sluice.stages.load import AugmentSpec, LoaderConfig, SamplerConfig
from sluice.stages.load.augment import Normalize
from sluice.stages.load.mixture import MixtureConfig
from sluice.stages.load.specs import ArtifactData, TokensData
from sluice.stages.load.tokens import TokenLoaderConfig
from sluice.stages.run.text import TextPipelineConfig, check_model_fits, sources_with, token_selection_spec
from sluice.stages.select import SELECTION_METHODS, SelectionConfig, candidate_size_for
from sluice.stages.select.spec import SelectionSpec
from sluice.stages.train.config import TrainConfig
from sluice.stages.train.job import TrainJob

# Evaluation reads every sample of the report split once, in order, at a batch size that keeps
# its per-batch overhead small; it never augments beyond normalising.
EVAL_BATCH = 500


def assemble_job(train: TrainConfig, loader: LoaderConfig, augment: AugmentSpec, selection: SelectionConfig,
                 eval_split: str, data: dict[str, Any], il_path: str | None) -> TrainJob:
    """The job for one dataset version (``data``: ``ShardSummary.info()``): the train config, the
    data specs (train: candidate batches; eval: every sample of ``eval_split`` once) and the
    selection spec. With a method that picks a subset, each rank draws ``batch / ratio``
    candidates and trains on ``batch`` of them; only full candidate batches, so every rank does
    the same work. InfoBatch draws ``batch`` candidates and trains the ones it does not prune."""
    norm = Normalize(mean=train.normalize_mean, std=train.normalize_std)
    trained = train.batch_size  # samples a rank trains on per step
    sel, candidates = selection, trained  # samples a rank's loader yields per step
    if sel.method != "none":
        candidates = candidate_size_for(sel, trained)
        update = {"n_select": trained} if sel.picks_subset and sel.n_select is None else {}
        sel = SELECTION_METHODS.get(sel.method).for_training_stage(sel.model_copy(update=update))
    train_loader = loader.model_copy(update={
        "split": "train", "batch_size": candidates, "drop_last": True,
        "augment": AugmentSpec(ops=[*augment.ops, norm], channels_last=augment.channels_last or train.channels_last)})
    eval_loader = loader.model_copy(update={
        "split": eval_split, "batch_size": EVAL_BATCH, "drop_last": False, "augment": AugmentSpec(ops=[norm]),
        "resolution": None, "sampler": SamplerConfig(kind="sequential")})
    spec = None
    if sel.method != "none":
        spec = SelectionSpec(config=sel, candidate_size=candidates, split_size=data["counts"]["train"],
                             fingerprint=data["fingerprint"], il_scores=il_path)
    config = train.model_copy(update={"in_channels": data["channels"], "num_classes": data["num_classes"],
                                      "progress": False})
    return TrainJob(config=config, data=ArtifactData(root=data["root"], loader=train_loader),
                    eval_data=ArtifactData(root=data["root"], loader=eval_loader), selection=spec)


def assemble_token_job(train: TrainConfig, text: TextPipelineConfig, eval_split: str,
                       data: dict[str, Any], selection: SelectionConfig | None = None) -> TrainJob:
    """The job for a set of token artifacts (``data``: ``stages/run/text.prepare_text``): packed
    rows of the weighted mixture of the sources' train splits, evaluated on every document of
    their ``eval_split`` once (at the longest row length trained on), with the vocabulary of
    their shared tokenizer. ``selection``: ``infobatch`` prunes rows by their documents' losses
    (``stages/select/infobatch_tokens``); the other methods are refused on token rows."""
    check_model_fits(train.model_kwargs, text)
    trained, graded = sources_with(data, "train"), sources_with(data, eval_split)
    if not trained or not graded:
        raise ConfigError(f"no text source holds a {'train' if not trained else eval_split} document")
    mix = MixtureConfig(sources=[{"path": s["root"], "name": s["name"], "weight": s["weight"]} for s in trained],
                        epoch_size=text.epoch_size, seed=train.seed,
                        weight_unit="tokens" if text.weight_unit == "tokens" else "samples")
    train_loader = TokenLoaderConfig(split="train", seq_len=text.seq_len, batch_size=train.batch_size,
                                     seq_len_schedule=text.seq_len_schedule, mixture=mix, seed=train.seed,
                                     prefetch=text.prefetch)
    once = MixtureConfig(sources=[{"path": s["root"], "name": s["name"], "repeat": 1.0} for s in graded])
    eval_loader = TokenLoaderConfig(split=eval_split, seq_len=text.eval_seq_len(), batch_size=text.eval_batch_size,
                                    mixture=once, prefetch=0)
    config = train.model_copy(update={"num_classes": data["vocab_size"], "progress": False})
    spec = token_selection_spec(selection, train.batch_size, data) if selection is not None else None
    return TrainJob(config=config, data=TokensData(loader=train_loader), eval_data=TokensData(loader=eval_loader),
                    selection=spec)
