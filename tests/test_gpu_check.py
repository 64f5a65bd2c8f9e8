"""`make gpu-check` and `make wheelhouse` where no GPU is: the clear refusal, the size budget, the
CPU dry run never written as GPU results, and no Prefect behind the GPU tests (offline, fast)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.slow
def test_gpu_check_without_a_gpu_stops_with_one_clear_line(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    env = {**os.environ, "GPU_PY": sys.executable, "GPU_CHECK_DRY_RUN": "0"}
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(tmp_path / "res")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 3 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0] and "GPU_CHECK_DRY_RUN=1" in lines[0]
    assert "Traceback" not in r.stderr and not (tmp_path / "res").exists()


def test_wheelhouse_size_check_rejects_oversize(tmp_path):
    (tmp_path / "big.whl").write_bytes(b"\0" * (2 * 1024 * 1024 + 1))
    script = ROOT / "scripts" / "build_wheelhouse.sh"
    over = subprocess.run(["bash", str(script), "--check-size", str(tmp_path)], capture_output=True, text=True,
                          env={**os.environ, "MAX_MIB": "2"})
    assert over.returncode == 1 and "over the 2 MiB budget" in over.stderr and "big.whl" in over.stderr
    ok = subprocess.run(["bash", str(script), "--check-size", str(tmp_path)], capture_output=True, text=True,
                        env={**os.environ, "MAX_MIB": "3"})
    assert ok.returncode == 0 and "budget 3 MiB" in ok.stdout


@pytest.mark.slow
def test_wheelhouse_holds_no_prefect_and_the_gpu_tests_import_none():
    """Prefect is left out of the wheelhouse: what the GPU tests and benchmark import must not
    import it (scripts/gpu-wheelhouse.txt says why)."""
    wanted = (ROOT / "scripts" / "gpu-wheelhouse.txt").read_text().lower()
    listed = [line.split("==")[0] for line in wanted.splitlines() if line and not line.startswith("#")]
    assert "pydantic" in listed and not any(p.startswith(("prefect", "fastapi", "torch")) for p in listed)
    code = ("import sys; sys.path[:0] = ['tests', '.'];"
            "import test_gpu_paths, test_train, benchmarks.gpu, benchmarks.gpu_tta, benchmarks.time_to_accuracy;"
            "from sluice.flows.pipeline import PipelineConfig, training_job;"
            "import sluice.stages.train.launch, sluice.storage.registry, sluice.stages.train.evaluate;"
            "assert 'prefect' not in sys.modules, 'prefect imported'")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_cpu_dry_run_is_never_written_as_gpu_results(tmp_path):
    from benchmarks.common import RESULTS
    from benchmarks.gpu import write
    res = {"commit": "x", "host": {"python": "3"}, "skipped": {}}
    with pytest.raises(SystemExit, match="refusing"):
        write(dict(res), str(RESULTS / "gpu.json"), cuda=False, quick=True)
    assert write(dict(res), str(tmp_path / "gpu.json"), cuda=False, quick=True).exists()
