"""``mlflow``: every night a run in one experiment (the resolved config as params, each logged
step's metrics, the grades, the report, the checkpoint and the served model as artifacts, the
dataset and its lineage and the Prefect flow run as tags), every candidate a version of one
registered model, and the ``champion`` alias moved where the file registry's champion is.

Idempotent by model id (tag ``sluice.model_id``): a night already mirrored is left as it is, a run
left half-written by a failure is replaced, and an unreachable server leaves the mirror behind
(said in the report) for the next night to catch up. The client is ``mlflow-skinny``
(``pip install 'sluice[mlflow]'``); with the embedded SQLite store it needs no server at all."""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

from sluice.errors import MissingDependency
from sluice.stages.track.config import TrackingConfig
from sluice.stages.track.registry import TRACKERS, Mirrored, Night

TAG_ID = "sluice.model_id"
TAG_DONE = "sluice.mirror"  # "complete" once every part of the run is logged
BAD_KEY = re.compile(r"[^A-Za-z0-9_\-./ :]")
PARAM_MAX = 6000


def resolve_uri(uri: str, data_root: Path) -> str:
    """``auto``: the embedded SQLite store under ``data_root``; a path to a .db file: SQLite there."""
    if uri == "auto":
        db = (data_root / "mlflow" / "mlflow.db").resolve()
        db.parent.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{db}"
    if "://" not in uri:
        return f"sqlite:///{Path(uri).resolve()}"
    return uri


def import_mlflow() -> Any:
    """``mlflow`` and ``mlflow.pytorch``, leaving this process's logging as it was (``import
    mlflow.pytorch`` calls ``logging.basicConfig`` when torch is present; ``import mlflow`` gives
    its loggers their own handlers unless MLFLOW_CONFIGURE_LOGGING is false)."""
    os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")
    # MLflow 3 sends usage telemetry to mlflow-telemetry.io unless told not to: off unless the
    # user has said otherwise (read when mlflow is imported)
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        import mlflow
        import mlflow.pytorch  # noqa: F401
    except ImportError as e:
        raise MissingDependency(f"tracking.loggers names mlflow, which is not installed ({e}): pip install "
                                "'sluice[mlflow]' (mlflow-skinny and pandas), or set tracking.uri: none") from None
    finally:
        root.setLevel(level)
        root.handlers[:] = handlers
    return mlflow


@contextlib.contextmanager
def bounded_requests(timeout_s: float) -> Iterator[None]:
    """MLflow's HTTP client retries 7 times with backoff by default (minutes against a server
    that is down); here one retry, each request at most ``timeout_s``."""
    want = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
            "MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, int(math.ceil(timeout_s)))),
            "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}
    before = {k: os.environ.get(k) for k in want}
    os.environ.update(want)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def flatten(d: Any, prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow params: dotted keys, values as JSON (lists) or text."""
    out: dict[str, str] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    value = d if isinstance(d, str) else json.dumps(d)
    out[BAD_KEY.sub("_", prefix[:-1])] = value[:PARAM_MAX]
    return out


def step_metrics(metrics_jsonl: Path) -> list[tuple[str, float, int]]:
    """(key, value, step) for every number of every logged step (loss, throughput, selection,
    per-source losses) and evaluation in a run's ``metrics.jsonl``."""
    out = []
    if not metrics_jsonl.is_file():
        return out
    for line in metrics_jsonl.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        step = int(row.get("step", 0))
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                out.append((BAD_KEY.sub("_", k), float(v), step))
    return out


def grades(record: Any) -> dict[str, float]:
    """The grades the registry recorded: per split, the kind's value, loss and accuracy."""
    out = {}
    for split, g in record.metrics.items():
        if isinstance(g, dict) and "value" in g and "loss" in g:
            for k in ("value", "loss", "acc", "n"):
                if isinstance(g.get(k), (int, float)):
                    out[f"{split}_{k}"] = float(g[k])
    return out


@TRACKERS.register("mlflow")
class MlflowTracker:
    name = "mlflow"

    def __init__(self, cfg: TrackingConfig, data_root: Path, kind: Any):
        self.cfg, self.kind, self.data_root = cfg, kind, data_root
        self.uri = resolve_uri(cfg.uri, data_root)
        self.artifacts = (data_root / "mlflow" / "artifacts").resolve() if self.uri.startswith("sqlite:") else None

    # ------------------------------------------------------------------ the mirror
    def mirror(self, nights: list[Night], champion: str | None, version: Any,
               log: Callable[[str], None]) -> Mirrored:
        status = Mirrored(tracker=self.name, where=self.uri)
        if (why := self._unreachable()) is not None:
            status.behind = why
            return status
        mlflow = import_mlflow()
        name = self.model_name(version)
        with bounded_requests(self.cfg.timeout_s):
            client = mlflow.MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
            try:
                exp = self._experiment(client)
                runs = self._runs(client, exp)
                versions = self._versions(client, name)
                for night in nights:
                    run = runs.get(night.model_id)
                    if run is None or run.data.tags.get(TAG_DONE) != "complete":
                        if run is not None:  # half-written by an earlier failure: replaced
                            client.delete_run(run.info.run_id)
                        run_id = self._log_run(client, mlflow, exp, night, version, champion, log)
                        status.added.append(night.model_id)
                    else:
                        run_id = run.info.run_id
                    if night.model_id not in versions:
                        versions[night.model_id] = self._register(client, name, run_id, night)
                status.champion = self._alias(client, name, versions, champion, log)
            except Exception as e:  # noqa: BLE001 - a server that goes away mid-mirror: behind, not failed
                status.behind = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        status.where = f"{self.uri}, model {name}@{self.cfg.alias}"
        return status

    def attach(self, night: Night, files: dict[str, Path], log: Callable[[str], None]) -> str | None:
        if (why := self._unreachable()) is not None:
            return why
        mlflow = import_mlflow()
        with bounded_requests(self.cfg.timeout_s):
            client = mlflow.MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
            exp = client.get_experiment_by_name(self.cfg.experiment)
            run = self._runs(client, exp.experiment_id).get(night.model_id) if exp else None
            if run is None:
                return "the night's run is not mirrored yet"
            for path in files.values():
                if Path(path).is_file():
                    client.log_artifact(run.info.run_id, str(path))
        return None

    def model_name(self, version: Any) -> str:
        names = list(getattr(version, "names", []) or [])
        return self.cfg.model_name or f"sluice-{names[0] if names else 'model'}"

    # ------------------------------------------------------------------ parts
    def _unreachable(self) -> str | None:
        """For a server: None if it answers /health within the timeout, else why not."""
        if not self.uri.startswith(("http://", "https://")):
            return None
        try:
            with urllib.request.urlopen(self.uri.rstrip("/") + "/health", timeout=self.cfg.timeout_s) as r:
                r.read()
            return None
        except OSError as e:
            return f"{self.uri} does not answer ({getattr(e, 'reason', e)})"

    def _experiment(self, client: Any) -> str:
        exp = client.get_experiment_by_name(self.cfg.experiment)
        if exp is not None:
            return exp.experiment_id
        where = self.artifacts.as_uri() if self.artifacts else None
        return client.create_experiment(self.cfg.experiment, artifact_location=where,
                                        tags={"sluice.data_root": str(self.data_root.resolve())})

    def _runs(self, client: Any, exp: str) -> dict[str, Any]:
        out, token = {}, None
        while True:
            page = client.search_runs([exp], max_results=1000, page_token=token)
            for r in page:
                if TAG_ID in r.data.tags:
                    out[r.data.tags[TAG_ID]] = r
            token = page.token
            if not token:
                return out

    def _versions(self, client: Any, name: str) -> dict[str, str]:
        from mlflow.exceptions import MlflowException
        try:
            client.get_registered_model(name)
        except MlflowException:
            client.create_registered_model(name, description="Sluice's nightly candidates; the alias "
                                           f"@{self.cfg.alias} is the model the file registry promoted.")
            return {}
        return {v.tags.get(TAG_ID): v.version for v in client.search_model_versions(f"name='{name}'")
                if v.tags.get(TAG_ID)}

    def _log_run(self, client: Any, mlflow: Any, exp: str, night: Night, version: Any, champion: str | None,
                 log: Callable[[str], None]) -> str:
        from mlflow.entities import Metric, Param
        rec = night.record
        t0 = time.time()
        warm = rec.warm_start or {}
        trained = rec.trained_on
        data = rec.metrics.get("data") or {}
        tags = {TAG_ID: rec.model_id, "sluice.kind": str(data.get("kind", self.kind.name)),
                "sluice.dataset.fingerprint": rec.dataset_fingerprint, "sluice.eval_split": rec.eval_split,
                "sluice.dataset.sources": json.dumps(data.get("sources", {})),
                "sluice.lineage.parent_model": warm.get("parent_model") or "none (trained from scratch)",
                "sluice.lineage.trained_on": (f"{trained.dataset_fingerprint[:16]} {'+'.join(trained.splits)}: "
                                              f"{trained.count} keys" if trained else "not recorded"),
                "sluice.registry.model": str(night.checkpoint.parent),
                "prefect.flow_run_id": str(rec.run.get("flow_run_id", "")),
                "prefect.flow_run_name": str(rec.run.get("flow_run_name", ""))}
        created = _millis(rec.created_at)
        run = client.create_run(exp, start_time=created, tags=tags, run_name=rec.model_id)
        rid = run.info.run_id
        params = [Param(k, v) for k, v in flatten(rec.config).items()]
        for i in range(0, len(params), 100):
            client.log_batch(rid, params=params[i:i + 100])
        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, s) for k, v, s in step_metrics(night.run_dir / "metrics.jsonl")] \
            if night.run_dir else []
        metrics += [Metric(k, v, now, 0) for k, v in grades(rec).items()]
        for k in ("samples_per_s", "data_wait_frac", "elapsed_s", "final_loss", "selection_trained_fraction"):
            if isinstance(rec.metrics.get(k), (int, float)):
                metrics.append(Metric(f"run_{k}", float(rec.metrics[k]), now, 0))
        for i in range(0, len(metrics), 1000):
            client.log_batch(rid, metrics=metrics[i:i + 1000])
        client.log_artifact(rid, str(night.checkpoint))
        for path in night.files.values():
            client.log_artifact(rid, path)
        if night.run_dir:
            for f in ("report.md", "metrics.jsonl"):
                if (night.run_dir / f).is_file():
                    client.log_artifact(rid, str(night.run_dir / f))
        self._log_model(client, mlflow, rid, night, version)
        client.set_tag(rid, TAG_DONE, "complete")
        client.set_terminated(rid, "FINISHED")
        log(f"tracking: mlflow run {rid} for {rec.model_id} ({len(params)} params, {len(metrics)} metric points, "
            f"{time.time() - t0:.1f} s)")
        return rid

    def _log_model(self, client: Any, mlflow: Any, rid: str, night: Night, version: Any) -> None:
        """The kind's servable, exported with ``torch.export`` (MLflow's ``pt2`` format: a graph,
        no pickled code), under the run's ``model/``."""
        import numpy as np
        import torch
        from mlflow.models import ModelSignature
        from mlflow.types import Schema, TensorSpec
        served = self.kind.servable(night.checkpoint, version)
        sig = ModelSignature(inputs=Schema([TensorSpec(np.dtype(served.example.dtype), served.shape)]))
        with tempfile.TemporaryDirectory(prefix="sluice-mlflow-") as tmp:
            mlflow.pytorch.save_model(served.module.eval(), os.path.join(tmp, "model"), serialization_format="pt2",
                                      signature=sig, input_example=served.example,
                                      pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"])
            Path(tmp, "model", "READS.txt").write_text(served.reads + "\n")
            client.log_artifacts(rid, os.path.join(tmp, "model"), "model")

    def _register(self, client: Any, name: str, rid: str, night: Night) -> str:
        rec = night.record
        v = client.create_model_version(name, source=f"runs:/{rid}/model", run_id=rid, tags={TAG_ID: rec.model_id},
                                        description=f"{rec.metric} {rec.value:.4f} on {rec.eval_split}")
        return v.version

    def _alias(self, client: Any, name: str, versions: dict[str, str], champion: str | None,
               log: Callable[[str], None]) -> str | None:
        from mlflow.exceptions import MlflowException
        if champion is None or champion not in versions:
            return None
        want = versions[champion]
        try:
            have = client.get_model_version_by_alias(name, self.cfg.alias).version
        except MlflowException:
            have = None
        if str(have) != str(want):
            client.set_registered_model_alias(name, self.cfg.alias, want)
            log(f"tracking: mlflow {name}@{self.cfg.alias} -> version {want} ({champion})"
                + (f", was version {have}" if have else ""))
        return champion


def _millis(iso: str) -> int:
    from datetime import datetime
    return int(datetime.fromisoformat(iso).timestamp() * 1000)
