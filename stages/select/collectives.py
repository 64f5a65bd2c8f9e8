"""The collectives selection needs: every rank's losses, so loss tables stay identical."""
from __future__ import annotations

import torch
import torch.distributed as dist


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def all_gather_1d(t: torch.Tensor, ragged: bool = False) -> torch.Tensor:
    """Concatenate the 1-D ``t`` from every rank. Sizes must be equal unless ``ragged`` (one more
    small collective for the sizes; InfoBatch ranks can prune a few samples fewer)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t
    world = dist.get_world_size()
    t = t.contiguous()
    if not ragged:
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t)
        return torch.cat(parts)
    sizes = [torch.zeros(1, dtype=torch.int64, device=t.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([t.numel()], dtype=torch.int64, device=t.device))
    most = max(int(n) for n in sizes)
    padded = torch.cat([t, t.new_zeros(most - t.numel())])
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([part[:int(n)] for part, n in zip(parts, sizes)])
