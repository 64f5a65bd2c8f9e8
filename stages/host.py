"""The host class, and the training settings that depend on it.

Two CPU classes run Sluice today with different best settings: CPUs that compute bf16 natively
(AVX512-bf16 or AMX), where bf16 autocast is ~1.8x faster than fp32, and the rest (AVX2), where
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
from typing import Literal

import torch

HostClass = Literal["cuda", "amx", "avx512_bf16", "avx2"]


@dataclasses.dataclass(frozen=True)
class HostDefaults:
    """The settings measured best on one host class, and where they were measured."""
    amp: Literal["none", "bf16", "fp16"]
    threads_per_rank: int  # ranks = cores / threads_per_rank (``nproc: auto``)
    batch_per_rank: int
    evidence: str


# One rank per core, each single-threaded, 64 samples per rank on both CPU classes. The trainer's
# throughput (benchmarks/results/host_layout-*.json): 2 ranks x 1 thread beat 1 x 2 on both; 128
# per rank was 17% faster per sample than 64 on AVX512-bf16 and 4% (within noise) on simulated
# AVX2, but doubles the global batch, and on AVX512-bf16 it was no faster to 93%
# (time_to_accuracy at commit 27f31f1). Only the precision differs between the classes.
HOST_DEFAULTS: dict[str, HostDefaults] = {
    "avx2": HostDefaults("none", 1, 64, "bf16 emulated; host_layout-avx2-simulated.json"),
    "avx512_bf16": HostDefaults("bf16", 1, 64, "host_layout-avx512_bf16.json; time_to_accuracy at 27f31f1"),
    "amx": HostDefaults("bf16", 1, 64, "not measured: taken from avx512_bf16"),
    "cuda": HostDefaults("bf16", 1, 64, "not measured: one rank per GPU; fp16 where no bf16"),
}


@functools.cache  # asked on every forward pass by some callers; the CPU does not change
def cpu_class() -> HostClass:
    """This CPU's class as PyTorch will use it."""
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT", ...
    if capability.startswith("AVX512"):
        if bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()):
            return "amx"
        if bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()):
            return "avx512_bf16"
    return "avx2"  # AVX2, AVX512 without bf16, and older: no native bf16


def host_class(device: torch.device | str = "cpu") -> HostClass:
    """The class of ``device`` on this host."""
    return "cuda" if torch.device(device).type == "cuda" else cpu_class()


def defaults_for(device: torch.device | str = "cpu") -> HostDefaults:
    """The measured defaults for ``device``'s class."""
    return HOST_DEFAULTS[host_class(device)]


def describe(cls: str, amp: str, ranks: int, threads: int, batch_per_rank: int) -> str:
    """One line saying what a run resolved on its host class."""
    precision = {"none": "fp32", "bf16": "bf16", "fp16": "fp16"}.get(amp, amp)
    return (f"{cls}: {precision}, {ranks} rank{'s' if ranks != 1 else ''} x {threads} "
            f"thread{'s' if threads != 1 else ''}, {batch_per_rank} per rank")
