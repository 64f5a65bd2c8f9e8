"""What a run reports: step and evaluation records (kept for the result, appended to
``metrics_path`` by rank 0), each rank's sample log, the progress bar, and the summary the
result carries.

Records are written as they happen, one JSON line each and flushed, so a crashed or killed run
leaves every step it finished on disk for the restarted one to append to.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from sluice.stages.contracts import ResumableLoader
from sluice.stages.host import describe, host_class
from sluice.stages.train.config import TrainConfig
from sluice.stages.train.dist import DistContext
from sluice.stages.train.parts import TrainParts
from sluice.stages.train.state import RunState


class MetricsLogger:
    """Step records (every ``log_every_steps``), evaluations, sample logs and the progress bar."""

    def __init__(self, cfg: TrainConfig, d: DistContext, state: RunState):
        self.cfg, self.d = cfg, d
        self.records: list[dict[str, Any]] = []
        self.file: TextIO | None = None
        self.samples: TextIO | None = None
        self.bar = None
        if d.rank == 0 and cfg.progress:
            from tqdm import tqdm
            self.bar = tqdm(total=state.total_steps, initial=state.step, desc="train", unit="step",
                            dynamic_ncols=True, mininterval=1.0)

    def write(self, rec: dict[str, Any]) -> None:
        """Append ``rec`` to ``metrics_path`` (rank 0 only)."""
        if self.d.rank != 0 or not self.cfg.metrics_path:
            return
        if self.file is None:
            Path(self.cfg.metrics_path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(self.cfg.metrics_path, "a")
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()

    def log_step(self, rec: dict[str, Any]) -> None:
        """Keep and write every ``log_every_steps``-th step's record; move the bar every step."""
        if rec["step"] % self.cfg.log_every_steps == 0:
            self.records.append(rec)
            self.write(rec)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{rec['loss']:.3f}", lr=f"{rec['lr']:.3g}")

    def log_eval(self, e: dict[str, Any]) -> None:
        """Evaluations go into the same file, under ``"eval"``."""
        self.write({"eval": e})

    def log_samples(self, state: RunState, indices: torch.Tensor) -> None:
        """This rank's batch, as split indices, in ``samples-rank<R>.jsonl`` (``log_samples``)."""
        if self.samples is None:
            where = Path(self.cfg.metrics_path or self.cfg.checkpoint_dir or ".")
            where = where.parent if where.suffix else where
            where.mkdir(parents=True, exist_ok=True)
            self.samples = open(where / f"samples-rank{self.d.rank}.jsonl", "a")
        self.samples.write(json.dumps({"step": state.step + 1, "epoch": state.epoch,
                                       "world": self.d.world, "indices": indices.tolist()}) + "\n")
        self.samples.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        for f in (self.file, self.samples):
            if f is not None:
                f.close()


def corrupt_skipped(loader: ResumableLoader, d: DistContext) -> int:
    """Damaged samples the loader dropped (``loader.on_corrupt: skip``), summed over ranks (collective)."""
    n = d.tensor([float(loader.profile().get("corrupt_skipped", 0))])
    if d.on:
        dist.all_reduce(n)
    return int(n.item())


def summarize(parts: TrainParts, state: RunState, records: list[dict[str, Any]],
              loader: ResumableLoader, halted: bool) -> dict[str, Any]:
    """The run's summary: world, comm, host, why it stopped, per-step means (collective: every
    rank's weight digest and the loader's skipped samples are gathered)."""
    cfg, d, ms = parts.cfg, parts.d, records
    summary: dict[str, Any] = {"world_size": d.world, "uncompressed_bytes": parts.full_bytes,
                               "elapsed_s": state.elapsed, "comm": cfg.comm.mode,
                               "amp": cfg.amp,  # as resolved on this device
                               "host": describe(host_class(d.device), cfg.amp, d.world,
                                                torch.get_num_threads(), cfg.batch_size),
                               "stopped_by": state.stopped_by(halted),
                               "skipped_steps": state.scaler_skips,  # fp16's GradScaler, this process
                               "param_digests": parts.digests()}
    if not ms:
        return summary
    n = len(ms)
    summary.update({
        "bytes_per_step": sum(m["bytes_comm"] for m in ms) / n,
        "seconds_per_step": sum(m["step_s"] for m in ms) / n,
        "samples_per_s": sum(m["samples_per_s"] for m in ms) / n,
        "data_wait_frac": sum(m["data_s"] for m in ms) / max(sum(m["step_s"] for m in ms), 1e-9),
        "final_loss": ms[-1]["loss"]})
    cand = sum(m.get("select/n_candidates", 0.0) for m in ms)
    if cand:  # rank 0's share of its candidates trained, and its scoring cost
        summary["selection_trained_fraction"] = sum(m["select/n_selected"] for m in ms) / cand
        summary["selection_seconds_per_step"] = sum(m["select_s"] for m in ms) / n
    bottleneck = getattr(loader, "bottleneck", None)  # sluice's Loader profiles itself
    if callable(bottleneck):
        summary["loader"] = {"backend": getattr(loader, "backend_name", None),
                             "choice": getattr(loader, "backend_reason", None),
                             **{k: v for k, v in bottleneck().items() if k in ("verdict", "summary")},
                             "corrupt_skipped": corrupt_skipped(loader, d)}  # every rank's, summed
    start = getattr(parts.hook, "compresses_from", None)
    if start is not None:  # a hook that starts compressing later: its compressed phase only
        late = [m["bytes_comm"] for m in ms if m["step"] >= start]
        if late:
            summary["bytes_per_step_compressed_phase"] = sum(late) / len(late)
    return summary
