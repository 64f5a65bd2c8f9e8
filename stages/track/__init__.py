"""Each night's run and candidate mirrored where ML teams look: MLflow (runs, metrics, the model
registry and its ``champion`` alias), TensorBoard (event files beside the run), or a registered
tracker of your own. The file registry stays the record of promotion; trackers mirror it."""
from sluice.stages.track import mlflow_tracker, tensorboard_tracker  # noqa: F401  (each registers itself)
from sluice.stages.track.config import TrackingConfig
from sluice.stages.track.mirror import attach_report, mirror_registry
from sluice.stages.track.registry import TRACKERS, Mirrored, Night, Tracker

__all__ = ["TRACKERS", "Mirrored", "Night", "Tracker", "TrackingConfig", "attach_report", "mirror_registry"]
