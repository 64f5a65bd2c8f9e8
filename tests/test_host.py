"""Defaults that resolve per host class: the class follows what PyTorch will run, each
class resolves its measured settings, an explicit setting wins, and results name their class."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from sluice.flows.pipeline import PipelineConfig
from sluice.stages.precision import resolve_amp
from sluice.stages.host import HOST_DEFAULTS, classify, cpu_class

PROBE = """
import json
from sluice.flows.pipeline import PipelineConfig
from sluice.stages.precision import resolve_amp
from sluice.stages.host import cpu_class
c = PipelineConfig()
print(json.dumps({"class": cpu_class(), "amp": resolve_amp("auto"), "line": c.resolved_for_host(),
                  "batch": c.train.batch_size}))
"""


def _probe(**env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_an_avx2_host_resolves_fp32_and_says_so():
    """ATEN_CPU_CAPABILITY=avx2 makes PyTorch run AVX2 kernels, where bf16 is emulated: this is
    what an AVX2 host resolves, on any x86 CPU."""
    got = _probe(ATEN_CPU_CAPABILITY="avx2")
    cores = os.cpu_count() or 1
    assert got["class"] == "avx2" and got["amp"] == "none"
    assert got["line"] == (f"avx2: fp32, {cores} rank{'s' if cores != 1 else ''} x 1 thread, "
                           f"{HOST_DEFAULTS['avx2'].batch_per_rank} per rank")
    assert got["batch"] == HOST_DEFAULTS["avx2"].batch_per_rank


@pytest.mark.parametrize("avx512,avx512_bf16,amx,want", [
    (False, False, False, "avx2"), (True, False, False, "avx2"),  # AVX2; Intel AVX512 without bf16
    (True, True, False, "avx512_bf16"), (True, True, True, "amx"),
    (False, True, True, "avx2"),  # ATEN_CPU_CAPABILITY=avx2 on an AMX CPU: PyTorch runs AVX2 kernels
])
def test_a_cpu_is_classed_by_what_pytorch_computes_natively_on_it(avx512, avx512_bf16, amx, want):
    assert classify(avx512, avx512_bf16, amx) == want


@pytest.mark.parametrize("host_class,amp", [("avx2", "none"), ("avx512_bf16", "bf16"), ("amx", "bf16")])
def test_auto_precision_is_bf16_only_where_the_cpu_computes_it(monkeypatch, host_class, amp):
    """bf16 is emulated (~10x slower) on AVX2-class CPUs: ``auto`` is fp32 there."""
    monkeypatch.setattr("sluice.stages.precision.cpu_class", lambda: host_class)
    assert resolve_amp("auto", "cpu") == amp
    assert [resolve_amp(m, "cpu") for m in ("none", "bf16", "fp16")] == ["none", "bf16", "fp16"]


def test_an_explicit_setting_wins_over_the_host_class():
    c = PipelineConfig.model_validate({"nproc": 1, "train": {"amp": "none", "torch_threads": 2,
                                                            "batch_size": 128}})
    assert c.resolved_for_host() == f"{cpu_class()}: fp32, 1 rank x 2 threads, 128 per rank"
    assert resolve_amp("bf16", "cpu") == "bf16" and resolve_amp("none", "cpu") == "none"


def test_results_name_their_host_class():
    from benchmarks.hostinfo import class_of
    assert class_of({"host": {"flags": ["avx2", "avx512_bf16", "avx512f", "fma"]}}) == "avx512_bf16"
    assert class_of({"host": {"flags": ["avx2", "fma"]}}) == "avx2"
    assert class_of({"_meta": {"host": {"flags": ["avx2", "amx_tile"]}}}) == "amx"
    assert class_of({"host_class": "avx2", "host_class_simulated": {"ATEN_CPU_CAPABILITY": "avx2"},
                     "host": {"flags": ["avx512_bf16"]}}) == "avx2 (simulated)"
    assert class_of({}) == "not recorded"
