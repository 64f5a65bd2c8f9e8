"""What a rank says when its GPU fails: out of memory names the per-rank batch, the memory asked
for and what to set instead (a restart would only repeat it, so it ends the run); a device or
NCCL failure names the rank, host and device, and stays a crash that a restart resumes from the
last checkpoint (the flow's task retry, or torchrun's ``--max-restarts``)."""
from __future__ import annotations

import re
import socket

import torch

from sluice.errors import TrainError
from sluice.stages.train.config import TrainConfig

_ASKED = re.compile(r"Tried to allocate ([\d.]+ [KMGT]?i?B)")
# what a CUDA, cuDNN or NCCL failure says (torch raises plain RuntimeErrors for most of them)
_DEVICE_FAILURE = re.compile(r"CUDA error|CUDNN_STATUS|cuDNN error|NCCL|ncclUnhandled|device-side assert|"
                             r"an illegal memory access|ECC error")


def where(rank: int, device: torch.device) -> str:
    """"rank 1 on gpu-node-3 (cuda:1)": the rank, this host and the device."""
    return f"rank {rank} on {socket.gethostname()} ({device})"


def out_of_memory(e: BaseException, cfg: TrainConfig, rank: int, device: torch.device,
                  loader_batch: int | None = None) -> TrainError:
    """The error an out-of-memory becomes: the per-rank batch, what was asked for, what the
    device holds, and settings that keep the global batch while halving the memory a step needs."""
    asked = _ASKED.search(str(e))
    held = ""
    if device.type == "cuda" and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(device)
        held = f"; the device had {free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB"
    b = cfg.batch_size
    candidates = f" (the loader draws {loader_batch} candidates per batch for selection)" \
        if loader_batch and loader_batch != b else ""
    smaller = max(1, b // 2)
    return TrainError(
        f"out of memory on {where(rank, device)} with train.batch_size={b} per rank{candidates}"
        + (f": it tried to allocate {asked.group(1)}" if asked else "") + held
        + f". Set train.batch_size: {smaller} with train.accum_steps: {cfg.accum_steps * 2} (the same "
        "global batch in half the memory per step)"
        + (", or train.amp: bf16" if cfg.amp in ("none", "auto") and device.type == "cuda" else "")
        + ", or a smaller model")


def is_device_failure(e: BaseException) -> bool:
    """Whether ``e`` is the device's or the collective library's failure, not the code's."""
    kinds = tuple(t for t in (getattr(torch.distributed, "DistBackendError", None),
                              getattr(torch, "AcceleratorError", None)) if t is not None)
    return isinstance(e, kinds) or bool(_DEVICE_FAILURE.search(str(e)))


def device_failure_line(e: BaseException, rank: int, device: torch.device) -> str:
    """One line for the log: which rank, host and device failed, and that a restart resumes."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return (f"[sluice] device failure on {where(rank, device)}: {type(e).__name__}: {first[:300]} "
            "(a restart resumes from the last checkpoint)")
