"""Prefect flows: ``prepare`` (each source → its dataset version), ``train`` (IL scores → verify
→ train → evaluate → promote → report) and ``nightly-retrain`` (both, then ``gc``; the deployment
entry point). Flows only chain tasks; each task is a thin call into ``stages``/``storage``, and
everything that differs by the kind of data (images, tokens, ...) is the kind's
(``stages/kinds``): the flows never ask which kind they run.

Unchanged data is not prepared twice, and the stages are what ensure it: the shard stage finds
the dataset version of the same content fingerprint (source bytes + config), the IL stage the
scores stored for the same dataset fingerprint and IL config. So these tasks keep no Prefect cache
of their own: it would fingerprint the source a second time, and could hand back the result of a
version deleted since.
"""
from __future__ import annotations

import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.context import FlowRunContext

from sluice.flows.pipeline import PipelineConfig, prepare_data, training_job
from sluice.flows.report import report_markdown
from sluice.flows.retry import retry_unless_deterministic
from sluice.stages.host import usable_cores
from sluice.stages.kinds import DatasetVersion
from sluice.stages.train.job import TrainJob
from sluice.storage import atomic


def _config(config: PipelineConfig | dict[str, Any] | None) -> PipelineConfig:
    return config if isinstance(config, PipelineConfig) else PipelineConfig.model_validate(config or {})


def _log(line: str) -> None:
    get_run_logger().info(line)


# ------------------------------------------------------------------ tasks


@task(name="prepare-data", retries=1, retry_delay_seconds=5, timeout_seconds=6 * 3600,
      retry_condition_fn=retry_unless_deterministic)
def prepare_task(c: PipelineConfig) -> DatasetVersion:
    """Each source's dataset version under ``datasets/<name>``: found when it exists, written
    (on top of the last version when the source grew) otherwise. With ``engine: ray`` the shard
    writes run as Ray tasks inside this one Prefect task: Prefect keeps one state and one retry for
    the stage, Ray re-runs a part whose node was lost, and the stage merges the parts itself."""
    from sluice.stages.data.engine import engine_parts
    return prepare_data(c, log=_log, map_shards=engine_parts(c.engine, _log))


@task(name="write-shard", retries=2, retry_delay_seconds=2, retry_condition_fn=retry_unless_deterministic)
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


@task(name="irreducible-loss", retries=1, retry_delay_seconds=5, timeout_seconds=6 * 3600,
      retry_condition_fn=retry_unless_deterministic)
def il_task(c: PipelineConfig, version: DatasetVersion) -> dict[str, Any]:
    """IL scores for this version: stored, carried by key from the nearest earlier version's (only
    new, changed and relabelled samples scored), or computed afresh; on the training device."""
    t0 = time.perf_counter()
    from sluice.stages.data.engine import engine_parts
    s = c.kind().irreducible_loss(version, c.selection, str(c.scores_dir()), "cuda" if c.on_cuda() else "cpu",
                                  parts=engine_parts(c.engine, _log))
    _log(s.pop("describe", ""))
    return {**s, "wall_s": time.perf_counter() - t0}


@task(name="verify-data")
def verify_task(c: PipelineConfig, version: DatasetVersion) -> dict[str, Any]:
    """Every sample's checksum before any rank reads one (``sluice verify``, the cheap form): the
    result goes into the report; damage fails the run here, naming it, unless the loader skips it."""
    from sluice.stages.data.engine import engine_parts
    return c.kind().verify(version, c.data, _log, parts=engine_parts(c.engine, _log))


@task(name="preflight")
def preflight_task(job: TrainJob, input_settings: str) -> dict[str, Any]:
    """One batch of each split through the model, on the CPU, before any rank starts: a model
    that cannot take the data fails here once (``PreflightError``), naming the setting to change."""
    from sluice.stages.run.preflight import preflight
    report = preflight(job, input_settings)
    _log(f"pre-flight: {report.line()}")
    return report.to_dict()


@task(name="train", retries=1, retry_delay_seconds=10, retry_condition_fn=retry_unless_deterministic)
def train_task(c: PipelineConfig, version: DatasetVersion, il: dict[str, Any] | None,
               run_dir: str) -> dict[str, Any]:
    """Where the weights start (the champion's, warm, or scratch), the job assembled once and
    checked on one batch (the ``preflight`` task, run inside this one so it checks the very job
    the ranks get), then ``nproc`` ranks on this machine (one in this process, several under
    torchrun), on each of ``launch.nodes``, or on the Ray cluster's nodes (``launch.engine: ray``);
    a retry, only after a crash or a lost rank (``flows/retry.py``), resumes from the run's last
    checkpoint."""
    from sluice.stages.run.training import run_training
    from sluice.stages.run.warm import plan_start
    il_path = il["path"] if il else None
    on_ray = c.launch.engine == "ray"
    if on_ray:
        _log(f"placement: the nodes of the Ray cluster at {c.engine.address or 'a Ray instance started here'}, "
             f"{c.nproc} rank(s) per node (auto: one per GPU, else per launch.ray.cpus_per_rank CPUs)")
    else:
        _log(f"placement: {c.resolved_for_host()}")
    start = plan_start(c.warm, c.kind(), version, c.train, c.selection.method, c.registry_dir(), il_path, run_dir)
    # verified=True: verify_task checked every sample's checksum before this task
    for line in c.kind().explain(c.train, version):
        _log(f"from the data: {line}")
    job = training_job(c, version, il_path, verified=True, start=start)
    fits = preflight_task(job, c.kind().input_settings)
    # the task's own logger, bound here: the progress watcher logs from its own thread, where
    # get_run_logger() finds no run context
    log = get_run_logger().info
    nproc = (c.nproc if isinstance(c.nproc, int) else None) if on_ray else c.ranks()
    return {**run_training(job, start, run_dir, c.launch, nproc=nproc, timeout_s=c.train_timeout_s, log=log,
                           engine=c.engine),
            "preflight": fits}


@task(name="gc-dataset-versions")
def gc_task(dataset_dir: str, keep: int) -> dict[str, Any]:
    """Drop the dataset versions past the newest ``keep`` (and their files no kept version reads)."""
    from sluice.storage.gc import collect
    report = collect(dataset_dir, keep=keep)
    _log(report.format())
    return report.to_dict()


@task(name="evaluate-and-promote")
def promote_task(c: PipelineConfig, version: DatasetVersion, trained: dict[str, Any],
                 run: dict[str, Any]) -> dict[str, Any]:
    from sluice.stages.run.promote import evaluate_and_promote
    out = evaluate_and_promote(c.kind(), c.promotion, c.registry_dir(), c.datasets_dir(), version, c.data, trained,
                               run, needs_il=c.selection.needs_il, config=c.model_dump(mode="json"))
    per = ", ".join(f"{k} {v['candidate']:.4f}" + (f" (champion {v['champion']:.4f})" if v["champion"] is not None else "")
                    for k, v in out["by_source"].items() if v["candidate"] is not None)
    _log(f"candidate {out['model_id']}: {out['reason']} -> {'PROMOTED' if out['promoted'] else 'not promoted'}"
         + (f"; {out['metric']} by source: {per}" if per else ""))
    return out


def run_summary(version: DatasetVersion, il: dict[str, Any] | None, trained: dict[str, Any],
                decision: dict[str, Any], curve_split: str, kind: Any) -> dict[str, Any]:
    """What the report shows: the dataset, the training summary with the result's own step count,
    final accuracy and evaluations (the summary alone has none of them), taken on ``curve_split``,
    the promotion and how the kind's metric reads."""
    return {"dataset": {**version.model_dump(mode="json"), "root": version.root, "describe": kind.describe(version)},
            "il": il, "promotion": decision,
            "kind": {"name": kind.name, "metric": kind.metric, "higher_is_better": kind.higher_is_better,
                     "samples": kind.samples, "curve": list(kind.curve)},
            "train": {**trained["summary"], "steps": trained["steps"], "final_acc": trained["final_acc"],
                      "evals": trained["evals"], "eval_split": curve_split},
            "selection": {k: v for k, v in trained["summary"].items() if k.startswith("sel")}}


@task(name="track")
def track_task(c: PipelineConfig, version: DatasetVersion) -> list[dict[str, Any]]:
    """Every candidate in the registry mirrored to each tracker (``tracking``; MLflow by
    default): tonight's, and any an earlier night could not mirror. Never fails the night: a
    tracker that cannot be reached is reported behind."""
    from sluice.stages.track import mirror_registry
    return mirror_registry(c.tracking, c.data_root, c.registry_dir(), c.kind(), version, _log)


@task(name="report")
def report_task(summary: dict[str, Any], metrics_path: str, run_dir: str | None = None) -> str:
    """The night's report: a Prefect artifact, and ``report.md`` in the run folder."""
    md = report_markdown(summary, metrics_path)
    create_markdown_artifact(markdown=md, key="nightly-summary", description="Sluice nightly run summary")
    if run_dir and Path(run_dir).is_dir():
        atomic.write_bytes(Path(run_dir) / "report.md", md.encode())
    return md


@task(name="track-report")
def track_report_task(c: PipelineConfig, model_id: str, run_dir: str) -> dict[str, str | None]:
    from sluice.stages.track import attach_report
    return attach_report(c.tracking, c.data_root, c.registry_dir(), c.kind(), model_id,
                         Path(run_dir) / "report.md", _log)


# ------------------------------------------------------------------ flows

def _run_info() -> dict[str, Any]:
    ctx = FlowRunContext.get()
    if ctx and ctx.flow_run:
        return {"flow_run_id": str(ctx.flow_run.id), "flow_run_name": ctx.flow_run.name}
    return {}


@flow(name="prepare-distributed", log_prints=True)
def _prepare_on_runner(config: dict[str, Any]) -> DatasetVersion:
    """The shard map as Prefect tasks on this flow's task runner (set by ``prepare``)."""
    from prefect.utilities.annotations import unmapped

    def on_runner(spec: dict[str, Any], shards: list[dict]) -> list[dict]:
        return [f.result() for f in write_shard_task.map(unmapped(spec), shards)]
    return prepare_data(_config(config), log=_log, map_shards=on_runner)


@flow(name="prepare", log_prints=True)
def prepare(config: PipelineConfig | None = None) -> DatasetVersion:
    """Every source of ``data`` as a (possibly already existing) dataset version."""
    c = _config(config)
    if c.prepare_runner != "local":
        runner = _task_runner(c.prepare_runner)
        return _prepare_on_runner.with_options(task_runner=runner)(c.model_dump(mode="json"))
    return prepare_task(c)


@flow(name="train", log_prints=True)
def train(config: PipelineConfig | None = None, data: DatasetVersion | None = None) -> dict[str, Any]:
    """IL scores (if selection needs them) → verify → train → evaluate → promote → report."""
    c = _config(config)
    version = data or prepare(c)
    il = il_task(c, version) if c.selection.needs_il else None
    checked = verify_task(c, version)  # before any rank reads a sample
    run = _run_info()
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    run_dir = c.runs_dir() / f"{stamp}-{run.get('flow_run_name', 'local')}"
    trained = train_task(c, version, il, str(run_dir))
    decision = promote_task(c, version, trained, {**run, "run_dir": str(run_dir)})
    tracked = track_task(c, version) if c.tracking.on else []
    report_task({**run_summary(version, il, trained, decision, c.promotion.report_split, c.kind()),
                 "verify": checked, "preflight": trained["preflight"], "tracking": tracked},
                trained["metrics_path"], str(run_dir))
    if tracked and decision["model_id"] in {m for t in tracked for m in t["added"]}:
        track_report_task(c, decision["model_id"], str(run_dir))
    return {"dataset": version, "il": il, "verify": checked, "preflight": trained["preflight"],
            "train": {k: v for k, v in trained.items() if k not in ("evals", "preflight")}, "promotion": decision,
            "tracking": tracked, "run_dir": str(run_dir)}


@flow(name="nightly-retrain", log_prints=True)
def nightly(config: PipelineConfig | None = None) -> dict[str, Any]:
    """The deployment entry point: prepare, then train and promote only a better model, then drop
    each source's old versions."""
    started_at = time.time()  # what time-to-accuracy counts from
    c = _config(config)
    version = prepare(c)
    out = {**train(c, version), "started_at": started_at}
    if c.keep_versions is not None:  # after training: the version trained on is the newest
        out["gc"] = {s.name: gc_task(str(c.datasets_dir() / s.name), c.keep_versions) for s in version.sources}
    return out
