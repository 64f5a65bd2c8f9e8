"""Prefect flows: ``prepare`` (ingest → shard), ``train`` (IL scores → train → evaluate → promote)
and ``nightly-retrain`` (both; the deployment entry point). Flows only chain tasks; each task is a
thin call into ``stages``/``storage``. With ``config.text`` the same flows run on text sources
(``stages/run/text.py``): shard each source, verify, train a language model, promote by
validation loss.

Unchanged data is not prepared twice, and the stages are what ensure it: the shard stage finds
the dataset version of the same content fingerprint (source bytes + config), the IL stage the
scores stored for the same dataset fingerprint and IL config. So these tasks keep no Prefect cache
of their own: it would fingerprint the source a second time, and could hand back the result of a
version deleted since.
"""
from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.context import FlowRunContext

from sluice.flows.pipeline import PipelineConfig, training_job
from sluice.flows.report import report_markdown
from sluice.stages.host import usable_cores


def _config(config: PipelineConfig | dict[str, Any] | None) -> PipelineConfig:
    return config if isinstance(config, PipelineConfig) else PipelineConfig.model_validate(config or {})


# ------------------------------------------------------------------ tasks


@task(name="shard", retries=1, retry_delay_seconds=5, timeout_seconds=6 * 3600)
def shard_task(prepare: dict[str, Any], out: str) -> dict[str, Any]:
    """The dataset version of this source under ``out``: found when it exists, written otherwise."""
    from sluice.stages.data.config import PrepareConfig
    from sluice.stages.data.shard import shard_dataset
    cfg = PrepareConfig.model_validate(prepare)
    s = shard_dataset(cfg.ingest, out, cfg.shard)
    get_run_logger().info("\n" + s.format())
    return s.info()


@task(name="shard-text", retries=1, retry_delay_seconds=5, timeout_seconds=6 * 3600)
def shard_text_task(text: dict[str, Any], datasets_dir: str) -> dict[str, Any]:
    """Each text source's token artifact under ``datasets_dir/<name>``, one tokenizer for all:
    found when it exists, written (on top of the last version when the source grew) otherwise."""
    from sluice.stages.run.text import TextPipelineConfig, prepare_text
    log = get_run_logger()
    return prepare_text(TextPipelineConfig.model_validate(text), datasets_dir, log=lambda line: log.info("\n" + line))


@task(name="write-shard", retries=2, retry_delay_seconds=2)
def write_shard_task(spec: dict[str, Any], shard: dict[str, Any]) -> dict[str, Any]:
    from sluice.stages.data.shard import write_shard_from_spec
    return write_shard_from_spec(spec, shard)


def _task_runner(name: str):
    if name == "threads":
        from prefect.task_runners import ThreadPoolTaskRunner
        return ThreadPoolTaskRunner(max_workers=usable_cores())
    if name == "processes":
        from prefect.task_runners import ProcessPoolTaskRunner
        return ProcessPoolTaskRunner(max_workers=usable_cores())
    if name.startswith("dask://"):
        from sluice.errors import require
        require("prefect_dask", "prefect-dask", "dask", "running the shard map on a Dask cluster")
        from prefect_dask import DaskTaskRunner
        return DaskTaskRunner(address="tcp://" + name[len("dask://"):])
    raise ValueError(f"unknown task runner {name!r}")


@task(name="irreducible-loss", retries=1, retry_delay_seconds=5, timeout_seconds=6 * 3600)
def il_task(root: str, fingerprint: str, selection: dict[str, Any], scores_root: str,
            device: str = "cpu") -> dict[str, Any]:
    """IL scores for this version: stored, carried by key from the nearest earlier version's (only
    new, changed and relabelled samples scored), or computed afresh (stages/select/il_carry.py);
    on the training device."""
    from sluice.errors import SelectionError
    from sluice.stages.load import split_arrays
    from sluice.stages.select import SelectionConfig
    from sluice.stages.select.il_carry import describe, il_scores_for_version
    from sluice.storage.artifact import open_artifact
    t0 = time.perf_counter()
    cfg = SelectionConfig.model_validate(selection)
    with open_artifact(root) as art:
        if art.fingerprint != fingerprint:
            raise SelectionError(f"the dataset at {root} is version {art.fingerprint[:16]}, not {fingerprint[:16]}")
        # the IL model never trains on removed samples (live_only for the holdout)
        s = il_scores_for_version(cfg.il, art, lambda split, live: split_arrays(art, split, live_only=live),
                                  scores_root, device=device)
    get_run_logger().info(describe(s))
    return {"path": s.path, "wall_s": time.perf_counter() - t0,
            **{k: v for k, v in s.extra.items() if isinstance(v, (int, float, bool, str))}}


@task(name="train", retries=1, retry_delay_seconds=10)
def train_task(cfg: dict[str, Any], data: dict[str, Any], il: dict[str, Any] | None, run_dir: str) -> dict[str, Any]:
    """``nproc`` ranks on this machine (one in this process, several under torchrun), or on each of
    ``launch.nodes``; a retry resumes from the run's last checkpoint."""
    from sluice.stages.run.training import run_training
    c = PipelineConfig.model_validate(cfg)
    il_path = il["path"] if il else None
    get_run_logger().info(f"placement: {c.resolved_for_host()}")
    # verified=True: verify_task checked every sample's checksum before this task
    return run_training(training_job(c, data, il_path, verified=True), c.warm, c.registry_dir(), il_path, run_dir, c.launch,
                        nproc=c.ranks(), timeout_s=c.train_timeout_s, log=get_run_logger().info)


@task(name="verify-text")
def verify_text_task(data: dict[str, Any]) -> dict[str, Any]:
    """Every document's checksum in every text source before training; damage fails the run here."""
    from sluice.stages.run.text import verify_text
    summary = verify_text(data)
    get_run_logger().info(f"token artifacts: {summary['samples']} documents match their checksums")
    return summary


@task(name="verify-artifact")
def verify_task(root: str, on_corrupt: str) -> dict[str, Any]:
    """Every sample's checksum before training (``sluice verify``, the cheap form): the result
    goes into the report; damage fails the run here, naming it, unless the loader skips it."""
    from sluice.stages.data.verify import check_before_training
    report, summary = check_before_training(root, on_corrupt)
    get_run_logger().info(report.format())
    return summary


@task(name="gc-dataset-versions")
def gc_task(dataset_dir: str, keep: int) -> dict[str, Any]:
    """Drop the dataset versions past the newest ``keep`` (and their files no kept version reads)."""
    from sluice.storage.gc import collect
    report = collect(dataset_dir, keep=keep)
    get_run_logger().info(report.format())
    return report.to_dict()


@task(name="evaluate-and-promote")
def promote_task(cfg: dict[str, Any], data: dict[str, Any], trained: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    from sluice.stages.run.promote import evaluate_and_promote, evaluate_and_promote_tokens
    c = PipelineConfig.model_validate(cfg)
    if c.text is not None:
        out = evaluate_and_promote_tokens(c.promotion, c.registry_dir(), data, trained, run,
                                          seq_len=c.text.eval_seq_len(), batch_size=c.text.eval_batch_size,
                                          config=c.model_dump(mode="json"))
        get_run_logger().info(f"candidate {out['model_id']}: {out['reason']} -> "
                              f"{'PROMOTED' if out['promoted'] else 'not promoted'}; {out['metric']} by source: "
                              + ", ".join(f"{k} {v['candidate']:.4f}" + (f" (champion {v['champion']:.4f})"
                                                                           if v["champion"] is not None else "")
                                          for k, v in out["loss_by_source"].items()))
        return out
    out = evaluate_and_promote(c.promotion, c.registry_dir(), c.dataset_dir(), data, trained, run,
                               needs_il=c.selection.needs_il, config=c.model_dump(mode="json"))
    get_run_logger().info(f"candidate {out['model_id']}: {out['reason']} -> "
                          f"{'PROMOTED' if out['promoted'] else 'not promoted'}")
    return out


def run_summary(data: dict[str, Any], il: dict[str, Any] | None, trained: dict[str, Any],
                decision: dict[str, Any], curve_split: str) -> dict[str, Any]:
    """What the report shows: the training summary with the result's own step count, final
    accuracy and evaluations (the summary alone has none of them), taken on ``curve_split``."""
    return {"dataset": data, "il": il, "promotion": decision,
            "train": {**trained["summary"], "steps": trained["steps"], "final_acc": trained["final_acc"],
                      "evals": trained["evals"], "eval_split": curve_split},
            "selection": {k: v for k, v in trained["summary"].items() if k.startswith("sel")}}


@task(name="report")
def report_task(summary: dict[str, Any], metrics_path: str) -> str:
    md = report_markdown(summary, metrics_path)
    create_markdown_artifact(markdown=md, key="nightly-summary", description="Sluice nightly run summary")
    return md


# ------------------------------------------------------------------ flows

def _run_info() -> dict[str, Any]:
    ctx = FlowRunContext.get()
    if ctx and ctx.flow_run:
        return {"flow_run_id": str(ctx.flow_run.id), "flow_run_name": ctx.flow_run.name}
    return {}


@flow(name="prepare-distributed", log_prints=True)
def _prepare_on_runner(config: dict[str, Any]) -> dict[str, Any]:
    """The shard map as Prefect tasks on this flow's task runner (set by ``prepare``)."""
    from prefect.utilities.annotations import unmapped
    from sluice.stages.data.shard import shard_dataset
    c = _config(config)

    def on_runner(spec: dict[str, Any], shards: list[dict]) -> list[dict]:
        return [f.result() for f in write_shard_task.map(unmapped(spec), shards)]
    s = shard_dataset(c.prepare.ingest, c.dataset_dir(), c.prepare.shard, map_shards=on_runner)
    get_run_logger().info("\n" + s.format())
    return s.info()


@flow(name="prepare", log_prints=True)
def prepare(config: PipelineConfig | None = None) -> dict[str, Any]:
    """Ingest and shard the source into a (possibly already existing) dataset version."""
    c = _config(config)
    if c.text is not None:  # text sources: one token artifact each, one tokenizer
        return shard_text_task(c.text.model_dump(mode="json"), str(c.datasets_dir()))
    if c.prepare_runner != "local":
        runner = _task_runner(c.prepare_runner)
        return _prepare_on_runner.with_options(task_runner=runner)(c.model_dump(mode="json"))
    return shard_task(c.prepare.model_dump(mode="json"), str(c.dataset_dir()))


@flow(name="train", log_prints=True)
def train(config: PipelineConfig | None = None, data: dict[str, Any] | None = None) -> dict[str, Any]:
    """IL scores (if selection needs them) → train on torchrun → evaluate → promote."""
    c = _config(config)
    data = data or prepare(c)
    il = None
    if c.selection.needs_il:
        il = il_task(data["root"], data["fingerprint"], c.selection.model_dump(mode="json"), str(c.scores_dir()),
                     "cuda" if c.on_cuda() else "cpu")
    checked = verify_text_task(data) if c.text is not None else \
        verify_task(data["root"], c.loader.on_corrupt)  # before any rank reads a sample
    run = _run_info()
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    run_dir = c.runs_dir() / f"{stamp}-{run.get('flow_run_name', 'local')}"
    trained = train_task(c.model_dump(mode="json"), data, il, str(run_dir))
    decision = promote_task(c.model_dump(mode="json"), data, trained, run)
    report_task({**run_summary(data, il, trained, decision, c.promotion.report_split), "verify": checked},
                trained["metrics_path"])
    return {"dataset": data, "il": il, "verify": checked, "train": {k: v for k, v in trained.items() if k != "evals"},
            "promotion": decision, "run_dir": str(run_dir)}


@flow(name="nightly-retrain", log_prints=True)
def nightly(config: PipelineConfig | None = None) -> dict[str, Any]:
    """The deployment entry point: prepare, then train and promote only a better model."""
    started_at = time.time()  # what time-to-accuracy counts from
    c = _config(config)
    data = prepare(c)
    out = {**train(c, data), "started_at": started_at}
    if c.keep_versions is not None and c.text is not None:  # each source's versions
        out["gc"] = {s.name: gc_task(str(c.datasets_dir() / s.name), c.keep_versions) for s in c.text.sources}
    elif c.keep_versions is not None:  # after training: the version trained on is the newest
        out["gc"] = gc_task(str(c.dataset_dir()), c.keep_versions)
    return out
