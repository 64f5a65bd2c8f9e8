"""``fp16`` / ``bf16``: cast each bucket to 16 bits, all-reduce, cast back (half the bytes)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from sluice.stages.train.comm.base import COMM_HOOKS, CommHook


class CastHook(CommHook):
    """All-reduce the bucket in ``dtype``, pre-divided by the world size (no overflow)."""
    dtype = torch.float16

    def reduce(self, bucket: dist.GradBucket) -> None:
        buf = bucket.buffer()
        small = buf.to(self.dtype).div_(self.world())
        buf.copy_(self.allreduce(small))


@COMM_HOOKS.register("fp16")
class Fp16Hook(CastHook):
    dtype = torch.float16


@COMM_HOOKS.register("bf16")
class Bf16Hook(CastHook):
    dtype = torch.bfloat16
