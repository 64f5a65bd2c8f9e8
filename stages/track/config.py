"""``tracking``: where each night's run and its candidate model are mirrored (MLflow, TensorBoard)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

OFF = "none"


class TrackingConfig(BaseModel):
    """The trackers a night is mirrored to. The file registry under ``data_root`` stays the record
    of every promotion decision; a tracker only mirrors it, and a tracker that fails never fails
    the night (the report says it is behind; the next night catches up)."""
    model_config = ConfigDict(extra="forbid")
    uri: str = Field("auto", description="MLflow's tracking and registry URI: auto = a SQLite store under data_root "
                     "(sqlite:///<data_root>/mlflow/mlflow.db, artifacts beside it), an http(s):// server, a "
                     "sqlite:/// path, or none (no tracking at all)")
    loggers: list[str] = Field(default_factory=lambda: ["mlflow"],
                               description="the registered trackers to mirror each night to (stages/track): "
                                           "mlflow, tensorboard (event files under the run's folder), or your own")
    experiment: str = Field("sluice-nightly", min_length=1, description="the MLflow experiment of the nightly runs")
    model_name: str | None = Field(None, description="the registered model every candidate becomes a version of; "
                                   "default: sluice-<the first source's name>")
    alias: str = Field("champion", pattern=r"^[A-Za-z0-9_-]+$",
                       description="the alias that follows promotion (models:/<model_name>@<alias>)")
    timeout_s: float = Field(15.0, gt=0, description="how long one request to a tracking server may take "
                             "(retried once) before the mirror is left behind for the next night")

    @field_validator("loggers")
    @classmethod
    def _registered(cls, v: list[str]) -> list[str]:
        from sluice.stages.track.registry import TRACKERS
        for name in v:
            TRACKERS.validate(name)
        if len(set(v)) != len(v):
            raise ValueError(f"a tracker is named twice: {v}")
        return v

    @property
    def on(self) -> bool:
        return self.uri.strip().lower() != OFF and bool(self.loggers)
