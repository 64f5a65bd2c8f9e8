"""One torchrun worker: ``python -m sluice.stages.train.worker --job job.json``.

It validates the typed job (``sluice.stages.train.job``), joins the process group, builds its
loaders and selector from the specs and runs the loop; rank 0 writes ``result.json``. A
``SluiceError`` (bad config, bad data, a diverged loss) is written to ``error.json`` and ends
the job for good: a restart would only repeat it. Any other exception is a crash, which
torchrun's ``--max-restarts`` restarts from the last checkpoint.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from pydantic import ValidationError

from sluice.errors import ConfigError, SluiceError
from sluice.stages.host import threads_per_rank
from sluice.stages.train.dist import init_process_group
from sluice.stages.train.elastic import job_for_world
from sluice.stages.train.job import TrainJob
from sluice.stages.train.loop import train
from sluice.storage.atomic import write_json

FATAL = "error.json"
RESULT = "result.json"
JOB = "job.json"


def read_job(path: Path) -> TrainJob:
    try:
        return TrainJob.model_validate_json(path.read_text())
    except ValidationError as e:
        raise ConfigError(f"invalid training job {path}: {e}") from None


def worker(job_path: str) -> int:
    """Run one rank of the job in ``job_path``; its directory receives the results."""
    out = Path(job_path).parent
    if (out / FATAL).exists():  # a restart after a fatal error would only repeat it
        print(f"[sluice] not restarting: {(out / FATAL).read_text()}", file=sys.stderr)
        return 3
    rank = int(os.environ.get("RANK", 0))
    try:
        job = read_job(Path(job_path))
        cfg = job.config
        if cfg.torch_threads is None:
            torch.set_num_threads(threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
        init_process_group(cfg)
        world = dist.get_world_size() if dist.is_initialized() else 1
        (out / "pids").mkdir(parents=True, exist_ok=True)
        (out / "pids" / f"rank{rank}.pid").write_text(str(os.getpid()))
        # a checkpoint of another world size: per-rank sizes so the global batch is kept
        train_job, scale = job_for_world(job, world)
        kw = dict(rank=rank, world_size=world, batch_size=cfg.batch_size, seed=cfg.seed)
        loader = train_job.data.build(train=True, **kw)
        ev = job.eval_data.build(train=False, **kw) if job.eval_data else None
        selector = train_job.selection.build() if train_job.selection else None
        result = train(cfg, loader, ev, selector, batch_scale=scale)
        if rank == 0:
            write_json(out / RESULT, result.to_dict())
        if dist.is_initialized():
            # Every rank leaves together: a rank that tears gloo down while a peer still has
            # traffic in flight aborts ("terminate called without an active exception").
            dist.barrier()
        return 0
    except SluiceError as e:
        write_json(out / FATAL, {"type": type(e).__name__, "message": str(e), "rank": rank})
        print(f"[sluice] rank {rank}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Sluice training worker (run under torchrun)")
    ap.add_argument("--job", required=True, help="job.json written by sluice.stages.train.launch")
    return worker(ap.parse_args(argv).job)


if __name__ == "__main__":  # sluice.procs, rule 7: run the imported copy, leave by os._exit
    from sluice.procs import run_as_imported
    run_as_imported("sluice.stages.train.worker")
