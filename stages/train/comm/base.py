"""The compression-hook registry and the base every DDP communication hook builds on.

Why our own hooks: on torch 2.13 with ``gloo`` the built-in ``powerSGD_hook`` fails with a
collective mismatch as soon as DDP has more than one bucket, ``batched_powerSGD_hook`` fails,
and ``bf16_compress_hook`` refuses gloo. Here each bucket's work (compression and its blocking
``all_reduce`` calls) runs on one communication thread per hook, in the order DDP hands the
buckets over (bucket index order, the same on every rank), so every rank runs the same
collectives in the same order whatever the bucket layout, on ``gloo`` (CPU) and ``nccl`` (CUDA)
alike. The hook returns at once with a future the thread completes, so — as DDP's own
all-reduce does — communication overlaps the rest of the backward pass; DDP waits for every
bucket's future before ``backward()`` returns, so nothing else is in flight when the loop
issues its own collectives.

Every hook counts the bytes it all-reduces and the seconds its thread was busy (compressing
or waiting on the network); ``take_bytes()`` and ``take_busy_s()`` are read by the train loop
once per optimizer step. Hook state is exposed as plain tensors for ``weights_only=True`` checkpoints,
keyed by parameter, not by bucket, so it survives DDP's bucket rebuild after the first
iteration and a resume in a new process.

Add a hook: a new file with a ``CommHook`` subclass registered by ``@COMM_HOOKS.register(name)``
and one import line in ``comm/__init__.py`` (outside Sluice: an entry point in group
``sluice.comm_hooks``); then ``train.comm.mode: name``.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from sluice.plugins import EntryParams, PluginRegistry

if TYPE_CHECKING:  # the config module imports this registry; no runtime cycle
    from sluice.stages.train.config import CommConfig

COMM_HOOKS: PluginRegistry[type["CommHook"]] = PluginRegistry("comm_hooks", "gradient compression hook")


def uncompressed_bytes(model: torch.nn.Module) -> int:
    """Bytes a plain fp32 all-reduce of every trainable gradient sends per step."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


class HookParams(EntryParams):
    """A compression hook's own knobs (``train.comm.params``); the base has none."""


class CommHook:
    """One DDP model's communication: a bucket hook, its state, and a byte counter.

    Subclasses implement ``reduce(bucket)``: leave the bucket's buffer holding the mean
    gradient over the group. The base installs nothing when ``installs_hook`` is False (DDP's
    own all-reduce is fastest when nothing is compressed).
    """
    installs_hook = True
    compresses_from: int | None = None  # the first step whose gradients travel compressed (None: never)
    Params: type[HookParams] = HookParams  # this hook's knobs (train.comm.params)

    def __init__(self, config: "CommConfig", seed: int = 0, group: Any = None):
        self.config, self.seed, self.group = config, seed, group
        self.params = self.Params.model_validate(config.params)
        self.iter = 0  # optimizer steps (synchronising backwards) seen
        self.bytes_sent = 0  # all-reduced payload bytes since the last ``take_bytes``
        self.busy_s = 0.0  # seconds the communication thread worked since ``take_busy_s``
        self._pkeys: dict[int, int] = {}
        self._work: queue.SimpleQueue | None = None

    # ---- public API -------------------------------------------------------------------
    def register(self, ddp_model: torch.nn.parallel.DistributedDataParallel) -> None:
        """Attach to a DDP model."""
        self._pkeys = {p.data_ptr(): i for i, p in enumerate(ddp_model.module.parameters())}
        if self.installs_hook:
            ddp_model.register_comm_hook(self, type(self)._hook)

    def take_bytes(self) -> int:
        """Bytes all-reduced since the last call (called once per optimizer step)."""
        b, self.bytes_sent = self.bytes_sent, 0
        return b

    def take_busy_s(self) -> float:
        """Seconds the communication thread spent on buckets since the last call."""
        s, self.busy_s = self.busy_s, 0.0
        return s

    def state_dict(self) -> dict[str, Any]:
        """Plain tensors and ints only, loadable with ``weights_only=True``."""
        return {"mode": self.config.mode, "iter": self.iter}

    def merge_rank_states(self, states: list[dict[str, Any]]) -> dict[str, Any]:
        """One rank's state for a run resumed at another world size, from every old rank's
        (``elastic``). Default: rank 0's (the step counter is the same on all)."""
        return states[0]

    def load_state_dict(self, state: dict[str, Any], device: torch.device | str = "cpu") -> None:
        if state.get("mode") != self.config.mode:
            raise ValueError(f"checkpoint comm hook is {state.get('mode')!r}, config says "
                             f"{self.config.mode!r}")
        self.iter = int(state["iter"])

    # ---- the hook ---------------------------------------------------------------------
    @staticmethod
    def _hook(self, bucket):  # no annotations: DDP rejects string (postponed) annotations
        if self._work is None:
            self._work = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(self._work,), name="sluice-comm",
                             daemon=True).start()
        fut: torch.futures.Future = torch.futures.Future()
        self._work.put((bucket, fut))
        return fut

    def _serve(self, work: queue.SimpleQueue) -> None:
        """The communication thread: buckets one at a time, in the order DDP handed them over."""
        while True:
            bucket, fut = work.get()
            t = time.perf_counter()
            try:
                self.reduce(bucket)
                if bucket.is_last():
                    self.iter += 1
            except BaseException as e:  # noqa: BLE001 - DDP re-raises it in backward()
                fut.set_exception(e)
                continue
            finally:
                self.busy_s += time.perf_counter() - t
            fut.set_result(bucket.buffer())

    def reduce(self, bucket: dist.GradBucket) -> None:
        raise NotImplementedError

    # ---- helpers for subclasses -------------------------------------------------------
    def world(self) -> int:
        return dist.get_world_size(self.group)

    def allreduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the group in place, counting its bytes."""
        self.bytes_sent += t.numel() * t.element_size()
        dist.all_reduce(t, group=self.group)
        return t

    def parameter_keys(self, bucket: dist.GradBucket) -> list[int]:
        """Stable per-parameter keys, so state survives DDP re-bucketing and resumes."""
        if not self._pkeys:
            raise RuntimeError("CommHook.register() must run before training")
        return [self._pkeys.get(p.data_ptr(), -1 - 1000 * bucket.index() - i)
                for i, p in enumerate(bucket.parameters())]
