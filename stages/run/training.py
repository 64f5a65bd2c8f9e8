"""The training stage as the pipeline runs it: launch the assembled job here (one rank
in-process, several under torchrun), across ``launch.nodes``, or on a Ray cluster's nodes
(``launch.engine: ray``), and log progress from rank 0's
metrics while it runs. The flow's task is one call to ``run_training``; a retry of that task
resumes from the run's last checkpoint (the run directory is the same)."""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from sluice.stages.train.job import TrainJob
from sluice.stages.data.engine import EngineConfig
from sluice.stages.run.launch import launch
from sluice.stages.run.nodes import LaunchConfig, launch_nodes
from sluice.stages.run.warm import Start

Log = Callable[[str], None]


@contextlib.contextmanager
def watch_progress(metrics: Path, log: Log, every_s: float = 15.0) -> Iterator[None]:
    """Log the training progress from rank 0's metrics file every ``every_s`` while the ranks
    run, and once more when they are done (so a short run says where it ended too). ``log`` is
    called from the watcher's thread: pass a logger bound where it runs, not one that looks up
    a context."""
    stop = threading.Event()

    def watch() -> None:
        pos = 0  # bytes of whole lines read so far: each tick reads only what was appended
        done = False
        while not done:
            done = stop.wait(every_s)
            if not metrics.exists():
                continue
            with metrics.open("rb") as f:
                f.seek(pos)
                chunk = f.read()
            complete = chunk[:chunk.rfind(b"\n") + 1]  # a line still being written waits
            pos += len(complete)
            lines = complete.decode().splitlines()
            steps = [json.loads(x) for x in lines if x.startswith('{"step"')]
            evals = [json.loads(x)["eval"] for x in lines if x.startswith('{"eval"')]
            if steps:
                m = steps[-1]
                log(f"training: step {m['step']} epoch {m['epoch']} loss {m['loss']:.4f} "
                    f"{m['samples_per_s']:.0f} samples/s, data wait {100 * m['data_wait_frac']:.0f}%"
                    + (f", eval acc {evals[-1]['acc']:.4f}" if evals else "")
                    + (f" loss {evals[-1]['loss']:.4f}" if evals and "loss" in evals[-1] else ""))
    th = threading.Thread(target=watch, daemon=True)
    th.start()
    try:
        yield
    finally:
        stop.set()
        th.join()


def run_training(job: TrainJob, start: Start, run_dir: str | os.PathLike, launch_config: LaunchConfig,
                 nproc: int | None, timeout_s: float, log: Log, engine: EngineConfig | None = None) -> dict[str, Any]:
    """Train ``job`` (assembled from where its weights ``start``) on ``nproc`` ranks here, on
    each of ``launch_config.nodes``, or on each node of the Ray cluster ``engine`` names
    (``launch.engine: ray``; ``nproc`` None: as the nodes' GPUs or CPUs give); what the
    promotion step and the report read back."""
    t0 = time.perf_counter()
    log(f"weights: {'champion' if start.plan else 'scratch'} ({start.why})")
    if start.plan is not None and start.plan.selector_why:
        log(f"selection: {start.plan.selector_why}")
    on_line = lambda line: log(line.rstrip()) if line.strip() else None  # noqa: E731
    metrics = Path(run_dir) / "metrics.jsonl"
    with watch_progress(metrics, log):
        if launch_config.engine == "ray":
            from sluice.stages.run.ray_nodes import launch_ray
            result = launch_ray(job, launch_config, engine, nproc=nproc, out_dir=run_dir, timeout_s=timeout_s,
                                on_line=on_line)
        elif launch_config.nodes:
            result = launch_nodes(job, launch_config, nproc=nproc, out_dir=run_dir, timeout_s=timeout_s,
                                  on_line=on_line)
        else:
            result = launch(job, nproc=nproc, out_dir=run_dir, timeout_s=timeout_s,
                            max_restarts=launch_config.max_restarts, on_line=on_line)
    return {"checkpoint": result.checkpoint, "final_acc": result.final_acc, "steps": result.steps,
            "wall_s": time.perf_counter() - t0, "summary": result.summary, "evals": result.evals,
            "metrics_path": str(metrics), "warm": start.summary(),
            **({"launch": result.summary["launch"]} if "launch" in result.summary else {})}
