"""The collectives selection needs: every rank's losses, so loss tables stay identical.

Tables live on the training device; the process group's backend says where its tensors must be
(NCCL: the rank's CUDA device, gloo: the CPU), so a gather moves them there and back.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def comm_device(t: torch.Tensor) -> torch.device:
    """Where the default group's backend takes tensors: CUDA for NCCL, the CPU for gloo."""
    backend = str(dist.get_backend()).lower()
    if backend == "nccl":
        return t.device if t.is_cuda else torch.device("cuda", torch.cuda.current_device())
    if backend == "gloo":
        return torch.device("cpu")
    return t.device


def all_gather_1d(t: torch.Tensor, ragged: bool = False) -> torch.Tensor:
    """Concatenate the 1-D ``t`` from every rank, on ``t``'s device. Sizes must be equal unless
    ``ragged`` (one more small collective for the sizes, read on the host; InfoBatch ranks can
    prune a few samples fewer)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t
    world, home = dist.get_world_size(), t.device
    t = t.contiguous().to(comm_device(t))
    if not ragged:
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t)
        return torch.cat(parts).to(home)
    sizes = [torch.zeros(1, dtype=torch.int64, device=t.device) for _ in range(world)]
    dist.all_gather(sizes, torch.full((1,), t.numel(), dtype=torch.int64, device=t.device))
    counts = torch.cat(sizes).tolist()
    padded = torch.cat([t, t.new_zeros(max(counts) - t.numel())])
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([part[:n] for part, n in zip(parts, counts)]).to(home)
