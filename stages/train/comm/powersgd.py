"""``powersgd``: rank-``r`` PowerSGD (Vogels et al. 2019) with error feedback and warm start.

Each gradient matrix ``M`` (n×m) is sent as ``P = M Q`` and ``Q = Mᵀ P̂`` (``r·(n+m)`` numbers
instead of ``n·m``), with error feedback (the part not sent is added to the next step's
gradient) and warm start (``Q`` is reused across steps). Vectors (biases, norms) and matrices
too small to gain are all-reduced uncompressed, batched into one call. Plain all-reduce runs
until ``start_iter`` (DDP settles its bucket layout after the first iteration).
"""
from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import Field, model_validator

from sluice.stages.train.comm.base import COMM_HOOKS, CommHook, HookParams

WIRE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class PowerSGDParams(HookParams):
    rank: int = Field(2, ge=1, description="the rank r of the factors P and Q")
    start_iter: int = Field(10, ge=0, description="plain all-reduce before this many steps")
    error_feedback: bool = True
    warm_start: bool = Field(True, description="reuse Q across steps")
    dtype: Literal["fp32", "fp16", "bf16"] = Field(
        "fp32", description="what P, Q and the small uncompressed tensors travel as; fp16/bf16 halve the bytes")

    @model_validator(mode="after")
    def _starts_late_enough(self) -> "PowerSGDParams":
        if (self.error_feedback or self.warm_start) and self.start_iter <= 1:
            raise ValueError("start_iter must be > 1 for powersgd with error feedback or warm start "
                             "(DDP rebuilds its buckets after the first iteration)")
        return self


@COMM_HOOKS.register("powersgd")
class PowerSGDHook(CommHook):
    """Params (``train.comm.params``): ``rank``, ``start_iter``, ``error_feedback``,
    ``warm_start`` and ``dtype`` (``PowerSGDParams``)."""
    Params = PowerSGDParams
    min_compression_rate = 2.0

    def __init__(self, config, seed: int = 0, group: Any = None):
        super().__init__(config, seed, group)
        self.rank = self.params.rank
        self.compresses_from = self.params.start_iter + 1
        self.wire_dtype = WIRE_DTYPES[self.params.dtype]
        self.errors: dict[int, torch.Tensor] = {}  # per parameter (index in the model)
        self.qs: dict[int, torch.Tensor] = {}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(),
                "errors": {int(k): v.detach().cpu().clone() for k, v in self.errors.items()},
                "qs": {int(k): v.detach().cpu().clone() for k, v in self.qs.items()}}

    def merge_rank_states(self, states: list[dict[str, Any]]) -> dict[str, Any]:
        """At another world size every rank starts from the old ranks' mean residual: the group
        applies mean(gradient + residual), so the mean is exactly the correction still owed.
        The warm-start factors are the same on every rank already."""
        keys = set.intersection(*(set(s["errors"]) for s in states))
        errors = {k: torch.stack([s["errors"][k] for s in states]).mean(0) for k in sorted(keys)}
        return {**states[0], "errors": errors}

    def load_state_dict(self, state: dict[str, Any], device: torch.device | str = "cpu") -> None:
        super().load_state_dict(state, device)
        self.errors = {int(k): v.to(device) for k, v in state["errors"].items()}
        self.qs = {int(k): v.to(device) for k, v in state["qs"].items()}

    # ---- the hook ---------------------------------------------------------------------
    def reduce(self, bucket: dist.GradBucket) -> None:
        if self.iter < self.params.start_iter:
            self.allreduce(bucket.buffer()).div_(self.world())
        else:
            self._compress(bucket)

    def _allreduce_wire(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce in ``wire_dtype`` (fp16/bf16 halve the bytes again)."""
        if self.wire_dtype == t.dtype:
            return self.allreduce(t)
        return self.allreduce(t.to(self.wire_dtype)).to(t.dtype)

    def _compressible(self, g: torch.Tensor) -> bool:
        if g.ndim < 2:
            return False
        n, m = g.shape[0], g.numel() // g.shape[0]
        r = min(self.rank, n, m)
        return n * m >= self.min_compression_rate * r * (n + m)

    def _compress(self, bucket: dist.GradBucket) -> None:
        buf = bucket.buffer()
        world = self.world()
        # the bucket buffer is its gradients flattened back to back; slice it ourselves
        views, offset = [], 0
        for g in bucket.gradients():
            views.append(buf[offset:offset + g.numel()].view(g.shape))
            offset += g.numel()
        if offset != buf.numel():  # unexpected layout: fall back to an exact all-reduce
            self.allreduce(buf).div_(world)
            return
        keys = self.parameter_keys(bucket)
        mats = [(k, v) for k, v in zip(keys, views) if self._compressible(v)]
        rest = [v for v in views if not self._compressible(v)]
        if rest:
            flat = self._allreduce_wire(torch.cat([v.reshape(-1) for v in rest])).div_(world)
            o = 0
            for v in rest:
                v.copy_(flat[o:o + v.numel()].view_as(v))
                o += v.numel()
        if not mats:
            return
        if self.params.error_feedback:
            for k, v in mats:
                err = self.errors.get(k)
                if err is not None and err.shape == v.shape:
                    v.add_(err)
            wanted = [v.clone() for _, v in mats]
        ms = [v.reshape(v.shape[0], -1) for _, v in mats]
        qs = [self._q_for(k, m) for (k, _), m in zip(mats, ms)]
        ps = [m @ q for m, q in zip(ms, qs)]
        flat_p = self._allreduce_wire(torch.cat([p.reshape(-1) for p in ps]))
        ps = _split(flat_p, [p.shape for p in ps])
        for p in ps:
            _orthogonalize(p)
        qs = [m.t() @ p for m, p in zip(ms, ps)]
        flat_q = self._allreduce_wire(torch.cat([q.reshape(-1) for q in qs]))
        qs = _split(flat_q.div_(world), [q.shape for q in qs])
        for (k, v), p, q in zip(mats, ps, qs):
            v.copy_((p @ q.t()).view_as(v))
            if self.params.warm_start:
                self.qs[k] = q.clone()
        if self.params.error_feedback:
            # what this rank wanted to send minus what the group applied
            for (k, v), w in zip(mats, wanted):
                self.errors[k] = w.sub_(v)

    def _q_for(self, key: int, m: torch.Tensor) -> torch.Tensor:
        shape = (m.shape[1], min(self.rank, *m.shape))
        old = self.qs.get(key)
        if self.params.warm_start and old is not None and tuple(old.shape) == shape:
            return old
        # the same seed on every rank, so all ranks start from the same Q
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + key * 7919 + self.iter)
        q = torch.randn(shape, generator=gen).to(m.device, m.dtype)
        _orthogonalize(q)
        return q


def _split(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    out, o = [], 0
    for s in shapes:
        n = s.numel()
        out.append(flat[o:o + n].view(s))
        o += n
    return out


def _orthogonalize(m: torch.Tensor, eps: float = 1e-8) -> None:
    """Gram-Schmidt on the columns, in place (r is tiny, so this is cheap)."""
    for i in range(m.shape[1]):
        col = m[:, i:i + 1]
        col.div_(col.norm() + eps)
        if i + 1 < m.shape[1]:
            rest = m[:, i + 1:]
            rest.sub_(col @ (col.t() @ rest))
