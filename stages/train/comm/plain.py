"""``none``: DDP's own all-reduce, uncompressed (no hook is installed)."""
from __future__ import annotations

import torch

from sluice.stages.train.comm.base import COMM_HOOKS, CommHook, uncompressed_bytes


@COMM_HOOKS.register("none")
class NoCompression(CommHook):
    """Counts what DDP's fp32 all-reduce sends: every trainable gradient, every step."""
    installs_hook = False

    def register(self, ddp_model: torch.nn.parallel.DistributedDataParallel) -> None:
        super().register(ddp_model)
        self._per_step = uncompressed_bytes(ddp_model.module)

    def take_bytes(self) -> int:
        return self._per_step
