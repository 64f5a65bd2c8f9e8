"""One rank: ``run_rank`` (what ``launch`` runs in-process for one rank), and the torchrun worker
around it, ``python -m sluice.stages.train.worker --job job.json``.

A rank sets its device first, joins the process group, builds its loaders and selector from
the typed job's specs on that device and runs the loop; rank 0 writes ``result.json``. A
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
from typing import Callable

import torch
import torch.distributed as dist
from pydantic import ValidationError

from sluice.errors import ConfigError, SluiceError
from sluice.stages.host import threads_per_rank
from sluice.stages.contracts import ResumableLoader
from sluice.stages.train.dist import init_process_group, place_rank
from sluice.stages.train.elastic import job_for_world
from sluice.stages.train.faults import device_failure_line, is_device_failure, out_of_memory
from sluice.stages.train.job import TrainJob
from sluice.stages.train.loop import TrainResult, train
from sluice.storage.atomic import write_json

FATAL = "error.json"
RESULT = "result.json"
JOB = "job.json"


def read_job(path: Path) -> TrainJob:
    try:
        return TrainJob.model_validate_json(path.read_text())
    except ValidationError as e:
        raise ConfigError(f"invalid training job {path}: {e}") from None


def run_rank(job: TrainJob, out: Path, *, rank: int = 0, local_rank: int = 0, local_world: int = 1,
             wrap_loader: Callable[[ResumableLoader], ResumableLoader] | None = None) -> TrainResult:
    """One rank of ``job``: its device set before anything allocates, the process group joined
    (several ranks), its loaders and selector built from the specs on that device, the loop run.
    What a torchrun worker runs, and what ``launch`` runs in-process for one rank.
    ``wrap_loader`` wraps the train loader (the in-process launch's time limit)."""
    cfg = job.config
    device = place_rank(cfg, local_rank)
    if cfg.torch_threads is None:  # the cores split among this machine's ranks
        torch.set_num_threads(threads_per_rank(local_world))
    init_process_group(cfg)
    world = dist.get_world_size() if dist.is_initialized() else 1
    (out / "pids").mkdir(parents=True, exist_ok=True)
    (out / "pids" / f"rank{rank}.pid").write_text(str(os.getpid()))
    # a checkpoint of another world size: per-rank sizes so the global batch is kept
    train_job, scale = job_for_world(job, world)
    kw = dict(rank=rank, world_size=world, batch_size=cfg.batch_size, seed=cfg.seed, device=device)
    try:
        loader = train_job.data.build(train=True, **kw)
        ev = job.eval_data.build(train=False, **kw) if job.eval_data else None
        selector = train_job.selection.build() if train_job.selection else None
        return train(cfg, wrap_loader(loader) if wrap_loader else loader, ev, selector, batch_scale=scale)
    except torch.OutOfMemoryError as e:  # a restart would only repeat it: say what to set instead
        raise out_of_memory(e, cfg, rank, device, getattr(getattr(train_job.data, "loader", None),
                                                           "batch_size", None)) from None
    except Exception as e:
        if is_device_failure(e):  # a crash (restartable), with the rank, host and device named
            print(device_failure_line(e, rank, device), file=sys.stderr, flush=True)
        raise


def worker(job_path: str) -> int:
    """Run one torchrun rank of the job in ``job_path``; its directory receives the results."""
    out = Path(job_path).parent
    if (out / FATAL).exists():  # a restart after a fatal error would only repeat it
        print(f"[sluice] not restarting: {(out / FATAL).read_text()}", file=sys.stderr)
        return 3
    rank = int(os.environ.get("RANK", 0))
    try:
        result = run_rank(read_job(Path(job_path)), out, rank=rank, local_rank=int(os.environ.get("LOCAL_RANK", 0)),
                          local_world=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
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
