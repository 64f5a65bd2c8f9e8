"""DDP communication hooks that compress gradients, built on ``torch.distributed`` primitives.

Why our own hooks: on torch 2.13 with ``gloo`` the built-in ``powerSGD_hook`` fails with a
collective mismatch as soon as DDP has more than one bucket, ``batched_powerSGD_hook`` fails,
and ``bf16_compress_hook`` refuses gloo. Each hook here issues *blocking* ``all_reduce`` calls
inside the bucket callback, so every rank runs the same collectives in the same order whatever
the bucket layout, on ``gloo`` (CPU) and ``nccl`` (CUDA) alike. A bucket's future is returned
already completed. Modes:

* ``none``     — DDP's own all-reduce (no hook); counted as the uncompressed size.
* ``fp16`` / ``bf16`` — cast the bucket to 16 bits, all-reduce, divide, cast back (2× fewer bytes).
* ``powersgd`` — rank-``r`` PowerSGD (Vogels et al. 2019): each gradient matrix ``M`` (n×m) is
  sent as ``P = M Q`` and ``Q = Mᵀ P̂`` (``r·(n+m)`` numbers instead of ``n·m``), with error
  feedback (the part not sent is added to the next step's gradient) and warm start (``Q`` is
  reused across steps). Vectors (biases, norms) and matrices too small to gain are all-reduced
  uncompressed, batched into one call. Plain all-reduce runs until ``start_iter``.

Every hook counts the bytes it all-reduces; ``CommHook.take_bytes()`` is read by the train
loop once per optimizer step. Hook state (error and Q per parameter, iteration) is exposed as plain
tensors for ``weights_only=True`` checkpoints. It is keyed by parameter, not by bucket, so it
survives DDP's bucket rebuild after the first iteration and a resume in a new process.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

MODES = ("none", "fp16", "bf16", "powersgd")
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _done(t: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(t)
    return fut


class CommHook:
    """A compression hook plus its state and byte counters (one per DDP model)."""

    def __init__(self, mode: str, group: Any = None, powersgd_rank: int = 2,
                 start_iter: int = 10, error_feedback: bool = True, warm_start: bool = True,
                 min_compression_rate: float = 2.0, seed: int = 0,
                 wire_dtype: str = "fp32"):
        if mode not in MODES:
            raise ValueError(f"unknown comm hook {mode!r}: use one of {MODES}")
        if mode == "powersgd":
            if powersgd_rank < 1:
                raise ValueError(f"powersgd rank must be >= 1, got {powersgd_rank}")
            if (error_feedback or warm_start) and start_iter <= 1:
                raise ValueError("powersgd start_iter must be > 1 with error feedback or warm "
                                 "start: DDP rebuilds its buckets after the first iteration")
        if wire_dtype not in _DTYPES:
            raise ValueError(f"wire_dtype must be one of {sorted(_DTYPES)}, got {wire_dtype!r}")
        self.wire_dtype = _DTYPES[wire_dtype]  # what PowerSGD sends: P, Q and the small tensors
        self.mode = mode
        self.group = group
        self.rank = powersgd_rank
        self.start_iter = start_iter
        self.error_feedback = error_feedback
        self.warm_start = warm_start
        self.min_compression_rate = min_compression_rate
        self.seed = seed
        self.iter = 0  # optimizer steps (synchronising backwards) seen
        self.errors: dict[int, torch.Tensor] = {}  # per parameter (index in the model)
        self.qs: dict[int, torch.Tensor] = {}
        self._pkeys: dict[int, int] = {}
        self.bytes_sent = 0  # all-reduced payload bytes since the last ``take_bytes``

    # ---- public API -------------------------------------------------------------------
    def register(self, ddp_model: torch.nn.parallel.DistributedDataParallel) -> None:
        """Attach to a DDP model (no-op for ``none``: DDP's default all-reduce is fastest)."""
        self._pkeys = {p.data_ptr(): i for i, p in enumerate(ddp_model.module.parameters())}
        if self.mode != "none":
            ddp_model.register_comm_hook(self, CommHook._hook)

    def take_bytes(self) -> int:
        """Bytes all-reduced since the last call (called once per optimizer step)."""
        b, self.bytes_sent = self.bytes_sent, 0
        return b

    def state_dict(self) -> dict[str, Any]:
        """Plain tensors and ints only, loadable with ``weights_only=True``."""
        return {"mode": self.mode, "iter": self.iter,
                "errors": {int(k): v.detach().cpu().clone() for k, v in self.errors.items()},
                "qs": {int(k): v.detach().cpu().clone() for k, v in self.qs.items()}}

    def load_state_dict(self, state: dict[str, Any], device: torch.device | str = "cpu") -> None:
        if state.get("mode") != self.mode:
            raise ValueError(f"checkpoint comm hook is {state.get('mode')!r}, config says "
                             f"{self.mode!r}")
        self.iter = int(state["iter"])
        self.errors = {int(k): v.to(device) for k, v in state["errors"].items()}
        self.qs = {int(k): v.to(device) for k, v in state["qs"].items()}

    # ---- the hook ---------------------------------------------------------------------
    def _world(self) -> int:
        return dist.get_world_size(self.group)

    def _allreduce(self, t: torch.Tensor) -> torch.Tensor:
        self.bytes_sent += t.numel() * t.element_size()
        dist.all_reduce(t, group=self.group)
        return t

    def _allreduce_as(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce in PowerSGD's ``wire_dtype`` (fp16/bf16 halve the bytes again)."""
        if self.wire_dtype == t.dtype:
            return self._allreduce(t)
        return self._allreduce(t.to(self.wire_dtype)).to(t.dtype)

    @staticmethod
    def _hook(self, bucket):  # no annotations: DDP rejects string (postponed) annotations
        buf = bucket.buffer()
        if self.mode in ("fp16", "bf16"):
            dtype = torch.float16 if self.mode == "fp16" else torch.bfloat16
            small = buf.to(dtype).div_(self._world())
            buf.copy_(self._allreduce(small))
        elif self.iter < self.start_iter:
            # plain all-reduce first: DDP settles its bucket layout after iteration 1
            self._allreduce(buf).div_(self._world())
        else:
            self._powersgd(bucket)
        if bucket.is_last():
            self.iter += 1
        return _done(buf)

    def _compressible(self, g: torch.Tensor) -> bool:
        if g.ndim < 2:
            return False
        n, m = g.shape[0], g.numel() // g.shape[0]
        r = min(self.rank, n, m)
        return n * m >= self.min_compression_rate * r * (n + m)

    def _keys(self, bucket: dist.GradBucket) -> list[int]:
        """Stable per-parameter keys, so state survives DDP re-bucketing and resumes."""
        if not self._pkeys:
            raise RuntimeError("CommHook.register() must run before training")
        return [self._pkeys.get(p.data_ptr(), -1 - 1000 * bucket.index() - i)
                for i, p in enumerate(bucket.parameters())]

    def _powersgd(self, bucket: dist.GradBucket) -> None:
        buf = bucket.buffer()
        world = self._world()
        # the bucket buffer is its gradients flattened back to back; slice it ourselves
        views, offset = [], 0
        for g in bucket.gradients():
            views.append(buf[offset:offset + g.numel()].view(g.shape))
            offset += g.numel()
        if offset != buf.numel():  # unexpected layout: fall back to an exact all-reduce
            self._allreduce(buf).div_(world)
            return
        keys = self._keys(bucket)
        mats = [(k, v) for k, v in zip(keys, views) if self._compressible(v)]
        rest = [v for v in views if not self._compressible(v)]
        if rest:
            flat = self._allreduce_as(torch.cat([v.reshape(-1) for v in rest])).div_(world)
            o = 0
            for v in rest:
                v.copy_(flat[o:o + v.numel()].view_as(v))
                o += v.numel()
        if not mats:
            return
        if self.error_feedback:
            for k, v in mats:
                err = self.errors.get(k)
                if err is not None and err.shape == v.shape:
                    v.add_(err)
            wanted = [v.clone() for _, v in mats]
        ms = [v.reshape(v.shape[0], -1) for _, v in mats]
        qs = [self._q_for(k, m) for (k, _), m in zip(mats, ms)]
        ps = [m @ q for m, q in zip(ms, qs)]
        flat_p = self._allreduce_as(torch.cat([p.reshape(-1) for p in ps]))
        ps = _split(flat_p, [p.shape for p in ps])
        for p in ps:
            _orthogonalize(p)
        qs = [m.t() @ p for m, p in zip(ms, ps)]
        flat_q = self._allreduce_as(torch.cat([q.reshape(-1) for q in qs]))
        qs = _split(flat_q.div_(world), [q.shape for q in qs])
        for (k, v), p, q in zip(mats, ps, qs):
            v.copy_((p @ q.t()).view_as(v))
            if self.warm_start:
                self.qs[k] = q.clone()
        if self.error_feedback:
            # what this rank wanted to send minus what the group applied
            for (k, v), w in zip(mats, wanted):
                self.errors[k] = w.sub_(v)

    def _q_for(self, key: int, m: torch.Tensor) -> torch.Tensor:
        shape = (m.shape[1], min(self.rank, *m.shape))
        old = self.qs.get(key)
        if self.warm_start and old is not None and tuple(old.shape) == shape:
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


def uncompressed_bytes(model: torch.nn.Module) -> int:
    """Bytes a plain fp32 all-reduce of every trainable gradient sends per step."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
