"""A warm start planned and a job assembled over artifacts written by a test, as the train task
does it: the version of the artifact (``ImageKind.version_of``), ``plan_start`` and
``assemble_job`` (what the tests of warm starts, replay and carried tables call)."""
from __future__ import annotations

from pathlib import Path

from sluice.stages.kinds.image import ImageData, ImageKind
from sluice.stages.run.assemble import assemble_job
from sluice.stages.run.warm import Start, WarmStartConfig, plan_start
from sluice.stages.select.config import SelectionConfig
from sluice.stages.train.config import TrainConfig
from sluice.stages.train.job import TrainJob
from sluice.storage.registry import Registry

KIND = ImageKind()
NONE = SelectionConfig(method="none")


def plan(warm: WarmStartConfig, reg: Registry, root: str, out: Path, selection: SelectionConfig = NONE,
         train: TrainConfig | None = None, il_path: str | None = None) -> Start:
    """Where a run on the artifact at ``root`` starts, by ``warm``, against ``reg``'s champion."""
    return plan_start(warm, KIND, KIND.version_of([root]), train or TrainConfig(model="small_cnn"), selection.method,
                      reg.root, il_path, out)


def job(root: str, selection: SelectionConfig = NONE, start: Start | None = None,
        train: TrainConfig | None = None) -> TrainJob:
    """The job the pipeline assembles on the artifact at ``root`` from ``start`` (default: scratch)."""
    return assemble_job(KIND, train or TrainConfig(model="small_cnn"), ImageData(source=str(root)), selection, "val",
                        KIND.version_of([root]), None, start or Start(why="scratch"))
