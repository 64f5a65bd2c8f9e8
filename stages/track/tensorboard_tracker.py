"""``tensorboard``: each night's steps and grades as TensorBoard event files in its run folder
(``<run>/tensorboard``), so ``tensorboard --logdir <data_root>/runs`` shows every night side by
side. Local files: up to date once written (a marker file says so), nothing to catch up."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from sluice.errors import MissingDependency
from sluice.stages.track.config import TrackingConfig
from sluice.stages.track.mlflow_tracker import grades, step_metrics
from sluice.stages.track.registry import TRACKERS, Mirrored, Night

FOLDER, DONE = "tensorboard", ".complete"


def summary_writer(log_dir: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise MissingDependency(f"tracking.loggers names tensorboard, which is not installed ({e}): pip install "
                                "'sluice[tensorboard]'") from None
    return SummaryWriter(log_dir=str(log_dir))


@TRACKERS.register("tensorboard")
class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, cfg: TrackingConfig, data_root: Path, kind: Any):
        self.cfg, self.data_root = cfg, data_root

    def mirror(self, nights: list[Night], champion: str | None, version: Any,
               log: Callable[[str], None]) -> Mirrored:
        status = Mirrored(tracker=self.name, where=str(self.data_root / "runs" / "*" / FOLDER), champion=champion)
        for night in nights:
            if night.run_dir is None or (night.run_dir / FOLDER / DONE).is_file():
                continue
            out = night.run_dir / FOLDER
            w = summary_writer(out)
            try:
                for key, value, step in step_metrics(night.run_dir / "metrics.jsonl"):
                    w.add_scalar(key, value, step)
                last = max((s for _, _, s in step_metrics(night.run_dir / "metrics.jsonl")), default=0)
                for key, value in grades(night.record).items():
                    w.add_scalar(f"grade/{key}", value, last)
                w.add_scalar("grade/champion", float(night.model_id == champion), last)
                w.add_text("model", f"{night.model_id}: {night.record.metric} {night.record.value:.4f} on "
                                    f"{night.record.eval_split}", last)
            finally:
                w.close()
            (out / DONE).write_text(night.model_id + "\n")
            status.added.append(night.model_id)
        return status

    def attach(self, night: Night, files: dict[str, Path], log: Callable[[str], None]) -> str | None:
        if night.run_dir is None:
            return "the night's run folder is gone"
        w = summary_writer(night.run_dir / FOLDER)
        try:
            for name, path in files.items():
                if Path(path).is_file():
                    w.add_text(name, Path(path).read_text()[:100_000])
        finally:
            w.close()
        return None
