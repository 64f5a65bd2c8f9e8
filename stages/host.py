"""The host class, and the training settings that depend on it.

Two CPU classes run Sluice today with different best settings: CPUs that compute bf16 natively
(AVX512-bf16 or AMX), where bf16 autocast is faster than fp32 (the time-to-accuracy baseline probe:
0.102 s a step against 0.181 s), and the rest (AVX2), where
PyTorch emulates bf16 and it is several times slower. CUDA is a third. ``host_class()`` names the
class of this process's device; ``HOST_DEFAULTS`` holds, per class, the settings measured best
there, and ``describe()`` prints what a run resolved ("avx2: fp32, 2 ranks x 1 thread, 64 per
rank").

The class follows what PyTorch will actually use: ATen's CPU capability (which honours
``ATEN_CPU_CAPABILITY``) and the CPU's bf16 support. So ``ATEN_CPU_CAPABILITY=avx2`` (with
``ONEDNN_MAX_CPU_ISA=AVX2`` for oneDNN's kernels) reproduces an AVX2 host's defaults and kernels on
a newer CPU.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Literal

import torch

from sluice.errors import ConfigError

HostClass = Literal["cuda", "amx", "avx512_bf16", "avx2"]


@dataclasses.dataclass(frozen=True)
class HostDefaults:
    """The settings measured best on one host class."""
    amp: Literal["none", "bf16", "fp16"]
    threads_per_rank: int  # ranks = cores / threads_per_rank (``nproc: auto``)
    batch_per_rank: int
    log_every_steps: int = 1  # a step's metrics are read on the host every N steps (a device sync)


# One rank per core, each single-threaded, 64 samples per rank on both CPU classes. The trainer's
# throughput (benchmarks/results/host_layout-*.json): 2 ranks x 1 thread beat 1 x 2 on both; 128
# per rank was 17% faster per sample than 64 on AVX512-bf16 and 4% (within noise) on simulated
# AVX2, but doubles the global batch, and on AVX512-bf16 it missed 93% on 2 of 3 seeds
# (time_to_accuracy.json at commit 27f31f1, where 1 rank x 2 threads was also slower). Only the
# precision differs between the classes; no real AVX2 host has measured these.
HOST_DEFAULTS: dict[str, HostDefaults] = {
    "avx2": HostDefaults("none", 1, 64),  # bf16 is emulated; host_layout-avx2-simulated.json
    "avx512_bf16": HostDefaults("bf16", 1, 64),  # host_layout-avx512_bf16.json
    "amx": HostDefaults("bf16", 1, 64),  # not measured: taken from avx512_bf16
    # cuda: fp16 where the GPU has no bf16. 256 per rank cut an H100 epoch to a third but reached 93% in
    # the recipe's 5.5 epochs on 1 seed of 3 (gpu_batch_ab.json); 64 reached it on all 3, at ~3x the
    # plain baseline's time (gpu.json)
    # the metrics are read every 50 steps, so a step never waits on the host in between
    "cuda": HostDefaults("bf16", 1, 64, log_every_steps=50),
}


def classify(avx512: bool, avx512_bf16: bool, amx: bool) -> HostClass:
    """A CPU's class from what it can run: AMX or AVX512-bf16 compute bf16 natively; every other
    CPU (AVX2, AVX512 without bf16, older) is in the AVX2 class."""
    if avx512 and amx:
        return "amx"
    return "avx512_bf16" if avx512 and avx512_bf16 else "avx2"


@functools.cache  # asked on every forward pass by some callers; the CPU does not change
def cpu_class() -> HostClass:
    """This CPU's class as PyTorch will use it (ATen's capability, so ``ATEN_CPU_CAPABILITY`` counts)."""
    def supported(check: str) -> bool:
        return bool(getattr(torch.cpu, check, lambda: False)())
    return classify(torch.backends.cpu.get_cpu_capability().startswith("AVX512"),
                    supported("_is_avx512_bf16_supported"), supported("_is_amx_tile_supported"))


def usable_cores() -> int:
    """The cores this process may run on (a node pinned by taskset has fewer than the host): the
    one core count every default that scales with the machine reads."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, cores or 1)


def workers_or_cores(given: int | None) -> int:
    """A pool's worker count: ``given`` when the config sets one, else one per usable core."""
    return given if given is not None else usable_cores()


def threads_per_rank(ranks: int) -> int:
    """Torch threads for each of ``ranks`` processes sharing this process's cores."""
    return max(1, usable_cores() // max(1, ranks))


def visible_gpus() -> int:
    """CUDA devices this process can see (``CUDA_VISIBLE_DEVICES`` counts); 0 without CUDA."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def ranks_for(nproc: int | str, *, cuda: bool, gpus: int, cores: int, pinned: list[int | None] = ()) -> int:
    """How many training ranks ``nproc`` means on one machine: an explicit number as given; auto
    = one per visible GPU when training on CUDA, else one single-threaded rank per core (per
    node with pinned cores: the fewest any node is pinned to). The counts are arguments, so the
    rule is testable on any machine. A CUDA run with more ranks than GPUs is refused: each rank
    owns one device."""
    if nproc == "auto":
        if cuda:
            if gpus < 1:
                raise ConfigError("train.device resolves to CUDA but no GPU is visible "
                                  "(set train.device: cpu, or check CUDA_VISIBLE_DEVICES)")
            return gpus
        per_rank = HOST_DEFAULTS[cpu_class()].threads_per_rank
        if pinned and None not in pinned:
            return max(1, min(pinned) // per_rank)  # type: ignore[type-var]
        return max(1, cores // per_rank)
    if not isinstance(nproc, int) or nproc < 1:
        raise ConfigError(f"nproc must be >= 1 or 'auto', got {nproc!r}")
    if cuda and not pinned and 0 < gpus < nproc:
        raise ConfigError(f"nproc={nproc} ranks but {gpus} GPU{'s' if gpus != 1 else ''} visible: each CUDA "
                          f"rank needs its own device (nproc: auto runs one per GPU)")
    return nproc


def rank_device(cuda: bool, local_rank: int) -> torch.device:
    """The device rank ``local_rank`` of this machine computes on: its own GPU, or the CPU."""
    return torch.device("cuda", local_rank) if cuda else torch.device("cpu")


def gpu_name(index: int = 0) -> str:
    """A GPU's short name ("H100" of "NVIDIA H100 80GB HBM3"), for the one-line description."""
    name = torch.cuda.get_device_name(index)
    words = [w for w in name.replace("NVIDIA", "").split() if w]
    return words[0] if words else name


def host_class(device: torch.device | str = "cpu") -> HostClass:
    """The class of ``device`` on this host."""
    return "cuda" if torch.device(device).type == "cuda" else cpu_class()


def defaults_for(device: torch.device | str = "cpu") -> HostDefaults:
    """The measured defaults for ``device``'s class."""
    return HOST_DEFAULTS[host_class(device)]


def describe(cls: str, amp: str, ranks: int, threads: int, batch_per_rank: int, *,
             gpus: str | None = None, loader_device: str | None = None) -> str:
    """One line saying what a run resolved on its host class: "avx2: fp32, 2 ranks x 1 thread, 64
    per rank" on CPUs; on CUDA "cuda: 1 × H100, bf16, 1 rank x 16 threads, 64 per rank, loader on
    cuda:0" (``gpus``: "1 × H100"; ``loader_device``: rank 0's loader)."""
    prec = "fp32" if amp == "none" else amp
    line = (f"{cls}: {gpus + ', ' if gpus else ''}{prec}, {ranks} rank{'s' if ranks != 1 else ''} x {threads} "
            f"thread{'s' if threads != 1 else ''}, {batch_per_rank} per rank")
    return line + (f", loader on {loader_device}" if loader_device else "")
