"""What a run reports: step and evaluation records (kept for the result, appended to
``metrics_path`` by rank 0), each rank's sample log, the progress bar, and the summary the
result carries.

Records are written as they happen, one JSON line each and flushed, so a crashed or killed run
leaves every step it finished on disk for the restarted one to append to.

A step leaves its record unread (``StepRecord``: device tensors beside host numbers); the loop
reads the waiting ones together, with one transfer, every ``log_every_steps`` steps and before a
checkpoint, an evaluation and the end of the run. The read is where a NaN/inf loss is found:
``NonFiniteLoss`` names the first step that had one, before anything is saved.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from sluice.errors import NonFiniteLoss
from sluice.stages.contracts import ResumableLoader
from sluice.stages.host import describe, gpu_name, host_class
from sluice.stages.train.config import TrainConfig
from sluice.stages.train.dist import DistContext
from sluice.stages.train.components import Components
from sluice.stages.train.state import RunState
from sluice.storage.checkpoint import checkpoint_exists


@dataclasses.dataclass
class StepRecord:
    """One step's metrics as the step leaves them: ``host`` (clocks, lr, counters; ``loss`` and
    ``samples_per_s`` still None) and, unread on the device, ``stats`` (the agreed [mean loss,
    non-finite count, samples]) and the selection statistics (floats or 0-dim tensors)."""
    host: dict[str, Any]
    stats: torch.Tensor
    select: dict[str, float | torch.Tensor]
    checked: bool = False  # fp16: the step itself decided on a non-finite loss (GradScaler)


def non_finite_error(step: int, lr: float, checkpoint: Path | str | None, what: str = "loss") -> NonFiniteLoss:
    """The error for a ``what`` (loss, weights) that became NaN/inf at ``step``, naming the last
    good checkpoint."""
    where = f"; the last good checkpoint is {checkpoint}" if checkpoint_exists(checkpoint) \
        else "; no checkpoint was written"
    return NonFiniteLoss(f"{what} became NaN/inf at step {step} (lr {lr:.3g}){where}. "
                         "Lower the lr, enable clip_grad_norm, or check the data")


def read_records(pending: list[StepRecord]) -> list[dict[str, Any]]:
    """The host records of ``pending`` steps, read with one transfer (``.tolist()`` of every
    step's device numbers, concatenated); ``nonfinite`` is the step's agreed count."""
    dev = pending[0].stats.device
    flat = [r.stats.reshape(-1).to(dev) for r in pending]
    flat += [v.detach().reshape(1).to(dev, torch.float64) for r in pending
             for v in r.select.values() if isinstance(v, torch.Tensor)]
    values = iter(torch.cat(flat).tolist())
    out = [dict(r.host) for r in pending]
    for rec, r in zip(out, pending):
        rec["loss"], rec["nonfinite"], rec["samples"] = next(values), next(values), next(values)
        rec["checked"] = r.checked
    for rec, r in zip(out, pending):
        rec["select"] = {k: next(values) if isinstance(v, torch.Tensor) else v for k, v in r.select.items()}
    return out


def window_record(window: list[dict[str, Any]], elapsed: float) -> dict[str, Any]:
    """The record written for the last step of ``window`` (the steps since the last written
    one): its own loss, lr and selection statistics; clocks, throughput and bytes averaged over
    the window. One step (``log_every_steps: 1``) gives that step's numbers unchanged."""
    last, k = window[-1], len(window)

    def mean(key: str) -> Any:
        return last[key] if k == 1 else sum(w[key] for w in window) / k
    step_s = last["step_s"] if k == 1 else sum(w["step_s"] for w in window)
    data_s = last["data_s"] if k == 1 else sum(w["data_s"] for w in window)
    samples = last["samples"] if k == 1 else sum(w["samples"] for w in window)
    rec = {"step": last["step"], "epoch": last["epoch"], "loss": last["loss"], "lr": last["lr"],
           "samples_per_s": samples / step_s, "step_s": step_s / k, "data_s": data_s / k,
           "data_wait_frac": data_s / step_s, "select_s": mean("select_s"),
           "bytes_comm": mean("bytes_comm"), "bytes_uncompressed": last["bytes_uncompressed"],
           "comm_busy_s": mean("comm_busy_s"), "elapsed_s": elapsed}
    if "grad_scale" in last:
        rec["grad_scale"], rec["skipped_steps"] = last["grad_scale"], last["skipped_steps"]
    rec.update({f"select/{k}": v for k, v in last["select"].items()})
    return rec


class MetricsLogger:
    """Step records (every ``log_every_steps``), evaluations, sample logs and the progress bar."""

    def __init__(self, cfg: TrainConfig, d: DistContext, state: RunState):
        self.cfg, self.d = cfg, d
        self.records: list[dict[str, Any]] = []
        self.pending: list[StepRecord] = []  # steps not read yet
        self.window: list[dict[str, Any]] = []  # steps read since the last written record
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

    def add(self, rec: StepRecord) -> None:
        """A step's record, unread; the bar moves every step."""
        self.pending.append(rec)
        if self.bar is not None:
            self.bar.update(1)

    def due(self, step: int) -> bool:
        """Whether ``step``'s record is written (every ``log_every_steps``-th)."""
        return step % self.cfg.log_every_steps == 0

    def read(self, state: RunState, checkpoint: Path | str | None = None, count_wait: bool = False) -> None:
        """Read the waiting steps (one transfer; nothing when none wait). Raises
        ``NonFiniteLoss`` for the first of them whose loss was NaN/inf. The time spent waiting
        for the device is the last step's (and, ``count_wait``, the run clock's: only before
        the ranks agree on it)."""
        if not self.pending:
            return
        t = time.perf_counter()
        recs = read_records(self.pending)
        self.pending = []
        wait = time.perf_counter() - t
        recs[-1]["step_s"] += wait
        if count_wait:
            state.elapsed += wait
        for rec in recs:
            if rec["nonfinite"] > 0 and not rec["checked"]:
                raise non_finite_error(rec["step"], rec["lr"], checkpoint)
        self.window += recs

    def write_due(self, state: RunState) -> None:
        """Keep and write the record of this step when it is a log step (read already)."""
        if not (self.window and self.window[-1]["step"] == state.step and self.due(state.step)):
            return
        rec = window_record(self.window, state.elapsed)
        self.window = []
        self.records.append(rec)
        self.write(rec)
        if self.bar is not None:
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


def summed(d: DistContext, values: list[float]) -> list[float]:
    """``values`` summed over ranks (collective)."""
    n = d.tensor([float(v) for v in values])
    if d.on:
        dist.all_reduce(n)
    return n.tolist()


def loader_summary(loader: ResumableLoader, d: DistContext) -> dict[str, Any]:
    """What the summary says of the loader (``loader.report()``): its backend, choice and verdict,
    the damaged samples every rank skipped, and what every rank served each source with the
    mixture's recorded changes (collective: the counts are summed over ranks)."""
    r = loader.report()
    names = list(r.served) if r.served is not None else []
    counts = summed(d, [r.corrupt_skipped, *(r.served[k] for k in names)]) if r.served is not None else \
        summed(d, [r.corrupt_skipped])
    out: dict[str, Any] = {"loader": {"backend": r.backend, "choice": r.choice, "verdict": r.verdict,
                                      "summary": r.summary, "corrupt_skipped": int(counts[0])}}
    if r.served is not None:
        out["served_by_source"] = {"unit": r.served_unit, "served": {k: int(v) for k, v in zip(names, counts[1:])},
                                   "changes": list(r.changes)}
    return out


def run_line(parts: Components, loader: ResumableLoader) -> str:
    """What the run resolved, in the one line the banner prints ("cuda: 1 × H100, bf16, 1 rank x 16
    threads, 64 per rank, loader on cuda:0"; on CPUs "avx2: fp32, 2 ranks x 1 thread, 64 per rank")."""
    cfg, d = parts.cfg, parts.d
    if d.device.type != "cuda":
        return describe(host_class(d.device), cfg.amp, d.world, torch.get_num_threads(), cfg.batch_size)
    return describe("cuda", cfg.amp, d.world, torch.get_num_threads(), cfg.batch_size,
                    gpus=f"{d.world} × {gpu_name(d.device.index or 0)}", loader_device=str(loader.device))


def summarize(parts: Components, state: RunState, records: list[dict[str, Any]],
              loader: ResumableLoader, halted: bool) -> dict[str, Any]:
    """The run's summary: world, comm, host, why it stopped, per-step means (collective: every
    rank's weight digest and the loader's skipped samples are gathered)."""
    cfg, d, ms = parts.cfg, parts.d, records
    summary: dict[str, Any] = {"world_size": d.world, "uncompressed_bytes": parts.full_bytes,
                               "elapsed_s": state.elapsed, "comm": cfg.comm.mode,
                               "amp": cfg.amp,  # as resolved on this device
                               "host": run_line(parts, loader),
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
    summary.update(loader_summary(loader, d))
    start = parts.hook.compresses_from
    if start is not None:  # a hook that starts compressing later: its compressed phase only
        late = [m["bytes_comm"] for m in ms if m["step"] >= start]
        if late:
            summary["bytes_per_step_compressed_phase"] = sum(late) / len(late)
    return summary
