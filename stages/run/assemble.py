"""The training job for one night, assembled once, complete and typed: the train config as the
data version makes it (classes, channels or vocabulary) and as the warm start sets it, the data
specs the kind builds (train: candidate batches; eval: every sample of the eval split once) and
the selection spec. Nothing downstream reshapes it: the ranks build their loaders and selector
from it as it is."""
from __future__ import annotations

from sluice.stages.kinds import DataConfig, DataKind, DatasetVersion
from sluice.stages.run.warm import Start
from sluice.stages.select import SELECTION_METHODS, SelectionConfig, candidate_size_for
from sluice.stages.select.spec import SelectionSpec
from sluice.stages.train.config import TrainConfig
from sluice.stages.train.job import TrainJob


def assemble_job(kind: DataKind, train: TrainConfig, data: DataConfig, selection: SelectionConfig, eval_split: str,
                 version: DatasetVersion, il_path: str | None, start: Start, *, verified: bool = False) -> TrainJob:
    """The job for ``version`` (the kind's data, a warm ``start``'s subsets and budget). With a
    method that picks a subset, each rank draws ``batch / ratio`` candidates and trains on
    ``batch`` of them; only full candidate batches, so every rank does the same work. InfoBatch
    draws ``batch`` candidates and trains the ones it does not prune. ``verified``: every
    checksum was checked before (the ranks' loaders do not again)."""
    config = kind.config_for(train, version).model_copy(update={"progress": False})
    plan = start.plan
    if plan is not None:
        config = plan.warm_config(config)
    trained = train.batch_size  # samples a rank trains on per step
    sel, candidates = selection, trained  # samples a rank's loader yields per step
    if sel.method != "none":
        candidates = candidate_size_for(sel, trained)
        update = {"n_select": trained} if sel.picks_subset and sel.n_select is None else {}
        sel = SELECTION_METHODS.get(sel.method).for_training_stage(sel.model_copy(update=update))
    data_spec, eval_spec = kind.data_specs(config, data, version, eval_split=eval_split, batch_size=candidates,
                                           selects=sel.method != "none", subsets=plan.subsets if plan else None,
                                           verified=verified)
    spec = None
    if sel.method != "none":
        spec = SelectionSpec(config=sel, candidate_size=candidates, split_size=kind.selection_size(version),
                             fingerprint=version.fingerprint, il_scores=il_path,
                             carried_table=plan.selector_state if plan else None)
    return TrainJob(config=config, data=data_spec, eval_data=eval_spec, selection=spec)
