"""`make gpu-check` and `make wheelhouse` where no GPU is: the clear refusal, the size budget, the
CPU dry run never written as GPU results, no Prefect behind the GPU tests, Prefect and the rest of
the front door in the wheelhouse, and the front door's pieces: the outcome it reads from `sluice`,
the grown source, the image's view, a step's time limit, and nothing set by hand on a GPU."""
from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _wheel_list() -> dict[str, str]:
    lines = (ROOT / "scripts" / "gpu-wheelhouse.txt").read_text().lower().splitlines()
    return dict(line.split("==") for line in lines if line.strip() and not line.startswith("#"))


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


def _size_check(wheelhouse: Path, max_mib: int, checkout: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "build_wheelhouse.sh"), "--check-size", str(wheelhouse)],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MAX_MIB": str(max_mib), "CHECKOUT": str(checkout)})


def test_wheelhouse_size_check_rejects_oversize(tmp_path):
    (tmp_path / "big.whl").write_bytes(b"\0" * (2 * 1024 * 1024 + 1))
    over = _size_check(tmp_path, 2, "none")
    assert over.returncode == 1 and "over the 2 MiB budget" in over.stderr and "big.whl" in over.stderr
    ok = _size_check(tmp_path, 3, "none")
    assert ok.returncode == 0 and "budget 3 MiB" in ok.stdout and "no git checkout" in ok.stdout


def test_wheelhouse_size_check_counts_the_checkout_carried_with_it(tmp_path):
    """What travels is the wheelhouse and the checkout (tracked, and untracked but not ignored):
    a wheelhouse within the budget alone is refused when the checkout takes it over, and the
    ignored files (the wheelhouse itself, results) are not counted; outside a git checkout, the
    wheelhouse alone."""
    wh = tmp_path / "wh"
    wh.mkdir()
    (wh / "a.whl").write_bytes(b"\0" * (3 * 1024 * 1024 // 2))  # 1.5 MiB
    co = tmp_path / "checkout"
    (co / "src").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(co)], check=True, timeout=60)
    (co / ".gitignore").write_text("ignored/\n")
    (co / "src" / "tracked.bin").write_bytes(b"\1" * (1024 * 1024))  # 1 MiB, tracked
    subprocess.run(["git", "-C", str(co), "add", "src/tracked.bin", ".gitignore"], check=True, timeout=60)
    (co / "untracked.bin").write_bytes(b"\2" * (512 * 1024))  # 0.5 MiB, travels too
    (co / "ignored").mkdir()
    (co / "ignored" / "huge.bin").write_bytes(b"\3" * (8 * 1024 * 1024))  # ignored: stays
    assert _size_check(wh, 2, "none").returncode == 0  # 1.5 MiB alone
    over = _size_check(wh, 2, co)  # 1.5 + 1.5 MiB
    assert over.returncode == 1 and "over the 2 MiB budget" in over.stderr, over.stderr
    assert "3.0 MiB to carry" in over.stderr and "the checkout" in over.stderr and "1.5 MiB, git ls-files: 0.5 MiB of it untracked" in over.stderr
    assert "tracked.bin" in over.stderr and "huge.bin" not in over.stderr
    ok = _size_check(wh, 4, co)
    assert ok.returncode == 0 and "(1.5 MiB) + the checkout" in ok.stdout and "= 3.0 MiB to carry (budget 4 MiB)" in ok.stdout
    plain = tmp_path / "plain"  # not a git checkout: the wheelhouse alone
    (plain / "x").mkdir(parents=True)
    (plain / "x" / "big.bin").write_bytes(b"\0" * (4 * 1024 * 1024))
    assert _size_check(wh, 2, plain).returncode == 0
    # this checkout is counted by default
    here = subprocess.run(["bash", str(ROOT / "scripts" / "build_wheelhouse.sh"), "--check-size", str(wh)],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "MAX_MIB": "1000"})
    assert here.returncode == 0 and f"+ the checkout {ROOT}" in here.stdout, here.stdout + here.stderr


def _fake_fashion_mnist(root: Path) -> dict[str, bytes]:
    """Four tiny IDX files as ``*-ubyte.gz`` (gzip level 9, as Fashion-MNIST ships): their bytes."""
    rng = np.random.default_rng(1)
    raw = {}
    for name, a in (("train-images-idx3", rng.integers(0, 255, (40, 28, 28), dtype=np.uint8)),
                    ("train-labels-idx1", np.arange(40, dtype=np.uint8) % 10),
                    ("t10k-images-idx3", rng.integers(0, 255, (9, 28, 28), dtype=np.uint8)),
                    ("t10k-labels-idx1", np.arange(9, dtype=np.uint8))):
        raw[f"{name}-ubyte"] = struct.pack(">HBB", 0, 8, a.ndim) + struct.pack(f">{a.ndim}I", *a.shape) + a.tobytes()
        _idx(root / f"{name}-ubyte.gz", a)
    return raw


@pytest.mark.parametrize("xz", ["xz", "/nonexistent/xz"])  # the xz command; where missing, Python's lzma
def test_the_wheelhouse_stores_the_images_as_xz_and_the_check_expands_them(tmp_path, xz):
    """`make wheelhouse` stores Fashion-MNIST's image files as xz (the labels as .gz); gpu_check
    expands them into its throwaway folder as the .gz files Sluice reads, the same bytes inside,
    and the IDX source reads the folder as it reads the original."""
    import lzma

    from sluice.stages.data.sources.idx import IdxSource
    from sluice.stages.load.arrays import fashion_mnist
    if xz == "xz" and not shutil.which("xz"):
        pytest.skip("no xz command here")
    src, wh = tmp_path / "fashion-mnist", tmp_path / "wh" / "data" / "fashion-mnist"
    src.mkdir()
    raw = _fake_fashion_mnist(src)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "build_wheelhouse.sh"), "--pack-fashion-mnist", str(src), str(wh)],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "XZ": xz})
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in wh.iterdir()) == ["t10k-images-idx3-ubyte.xz", "t10k-labels-idx1-ubyte.gz",
                                                    "train-images-idx3-ubyte.xz", "train-labels-idx1-ubyte.gz"]
    for name in ("train-images-idx3-ubyte", "t10k-images-idx3-ubyte"):
        assert lzma.decompress((wh / f"{name}.xz").read_bytes()) == raw[name]
    gc = _gpu_check()
    work = tmp_path / "work"
    fm = gc.wheelhouse_fashion_mnist(wh, work / "fm")
    assert fm == work / "fm" and sorted(p.name for p in fm.iterdir()) == sorted(f"{n}.gz" for n in raw)
    for name, data in raw.items():
        assert gzip.decompress((fm / f"{name}.gz").read_bytes()) == data, name
    got, want = IdxSource(fm), IdxSource(src)
    assert (got._images["train"] == want._images["train"]).all() and (got._labels["test"] == want._labels["test"]).all()
    for split in ("train", "test"):  # the reader of {prefix}-images-idx3-ubyte.gz, as the GPU tests read it
        (x, y), (x0, y0) = fashion_mnist(split, str(fm)), fashion_mnist(split, str(src))
        assert (x == x0).all() and (y == y0).all() and len(x) == (40 if split == "train" else 9)


def test_a_wheelhouse_of_plain_gz_files_is_read_where_it_is(tmp_path):
    """An older wheelhouse (every file .gz) is used as it is: nothing expanded, nothing copied."""
    gc = _gpu_check()
    (tmp_path / "wh").mkdir()
    _fake_fashion_mnist(tmp_path / "wh")
    assert gc.wheelhouse_fashion_mnist(tmp_path / "wh", tmp_path / "work" / "fm") == tmp_path / "wh"
    assert not (tmp_path / "work").exists()


def test_wheelhouse_holds_the_front_door_at_the_tested_versions_and_no_torch():
    """Prefect and its API server are in the wheelhouse, at the versions pyproject.toml pins (the
    ones the suite runs with); every line is pinned; torch and numpy come from the image."""
    wanted = _wheel_list()
    assert all(re.fullmatch(r"[0-9][0-9a-z.+]*", v) for v in wanted.values()), wanted
    pins = dict(re.findall(r'"(prefect|fastapi)==([^"]+)"', (ROOT / "pyproject.toml").read_text()))
    assert pins and all(wanted.get(name) == v for name, v in pins.items()), pins
    for name in ("pydantic", "pydantic-core", "webdataset", "sqlalchemy", "aiosqlite", "uvicorn", "pydocket",
                 "asyncpg", "cryptography"):
        assert name in wanted, name
    assert not any(p.startswith(("torch", "numpy", "nvidia-", "opencv", "pytest")) for p in wanted)
    gc = _gpu_check()
    image = {p.lower() for p in gc.IMAGE_PACKAGES}
    assert {"torch", "numpy", "pytest", "matplotlib"} <= image and not image & {"prefect", "pydantic", "webdataset"}


@pytest.mark.slow
def test_the_gpu_tests_import_no_prefect():
    """What the GPU tests and benchmark import must not import Prefect: they run (and are checked
    for it) in a process of their own, apart from the front door."""
    code = ("import sys; sys.path[:0] = ['tests', '.'];"
            "import test_gpu_paths, test_train, benchmarks.gpu, benchmarks.gpu_tta, benchmarks.time_to_accuracy;"
            "from sluice.flows.pipeline import PipelineConfig, training_job;"
            "import sluice.stages.run.launch, sluice.storage.registry, sluice.stages.train.evaluate;"
            "assert 'prefect' not in sys.modules, 'prefect imported'")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_gpu_run_sets_nothing_by_hand_and_the_dry_run_says_what_it_shortens():
    gc = _gpu_check()
    assert gc.front_door_settings("gpu") == {"demo": [], "night": []}
    dry = gc.front_door_settings("dry-run")
    assert dry == gc.DRY_RUN_SETTINGS and all(re.fullmatch(r"[a-z_.]+=[0-9.]+", kv) for v in dry.values() for kv in v)
    # the quick check on a GPU fits its 9 minutes: the limits of the steps after the env, in the budget
    assert gc.BUDGET["gpu"] <= 540 and all(v <= gc.BUDGET["gpu"] for v in gc.STEP_LIMITS["gpu"].values())


def test_the_outcome_is_read_from_what_sluice_prints(tmp_path, capsys):
    """gpu_check reads each front-door run's banner and outcome block as flows/cli.py prints them."""
    from types import SimpleNamespace

    from sluice.flows import cli
    gc = _gpu_check()
    cfg = SimpleNamespace(registry_dir=lambda: tmp_path / "registry")
    from sluice.stages.kinds import SourceVersion
    from sluice.stages.kinds.image import ImageVersion
    source = SourceVersion(name="fashion-mnist", location="fashion-mnist", root="d", fingerprint="f" * 64,
                           counts={"train": 1})
    result = {"dataset": ImageVersion(fingerprint="f" * 64, sources=[source], counts=source.counts, channels=1,
                                      num_classes=10),
              "run_dir": "r", "train": {"summary": {"host": "cuda: 1 × H100, bf16"}},
              "promotion": {"model_id": "20261126T1-ab", "metric": "val_acc", "higher_is_better": True,
                            "eval_split": "val", "candidate_value": 0.9123, "report_split": "test",
                            "report": {"value": 0.9051}, "promoted": False, "reason": "0.9123 < champion 0.9200"}}
    cli._print_outcome(cfg, result)
    banner = f"resolved for this host: avx2: fp32, 2 ranks x 1 thread, 64 per rank  ({cli.HOST_NOTE})\n"
    got = gc.outcome(banner + capsys.readouterr().out)
    assert got == {"resolved": "avx2: fp32, 2 ranks x 1 thread, 64 per rank", "model_id": "20261126T1-ab",
                   "eval_split": "val", "accuracy": 0.9123, "report_split": "test", "report_accuracy": 0.9051,
                   "promoted": False, "reason": "0.9123 < champion 0.9200", "trained_on": "cuda: 1 × H100, bf16",
                   "champion": None}
    shown = f"# resolved for this host at run time: cuda: 1 × H100, bf16, 1 rank  ({cli.HOST_NOTE})\n"
    assert gc.outcome(shown)["resolved"] == "cuda: 1 × H100, bf16, 1 rank"


def _idx(path: Path, a: np.ndarray) -> None:
    with gzip.open(path, "wb") as f:
        f.write(struct.pack(">HBB", 0, 8, a.ndim) + struct.pack(f">{a.ndim}I", *a.shape) + a.tobytes())


def test_the_source_grows_in_place_keeping_every_key_and_adding_a_tenth(tmp_path):
    """The second night's source is the demo's own folder, grown: same kind and path (so the new
    dataset version is written on top of the demo's and the champion can start warm), the 50
    images first under their old keys, then 5 mirrored copies with their labels."""
    from sluice.stages.data.sources.idx import IdxSource
    gc = _gpu_check()
    rng = np.random.default_rng(0)
    x, tx = rng.integers(0, 255, (50, 28, 28), dtype=np.uint8), rng.integers(0, 255, (7, 28, 28), dtype=np.uint8)
    for name, a in (("train-images-idx3", x), ("train-labels-idx1", np.arange(50, dtype=np.uint8) % 10),
                    ("t10k-images-idx3", tx), ("t10k-labels-idx1", np.arange(7, dtype=np.uint8))):
        _idx(tmp_path / f"{name}-ubyte.gz", a)
    before = IdxSource(tmp_path)
    fingerprint = before.fingerprint()
    r = subprocess.run([sys.executable, "-c", gc.GROW, str(tmp_path), "0.1"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"source": str(tmp_path), "images": 55, "added": 5, "first_new_key": "train-000050"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz", "train-images-idx3-ubyte", "train-labels-idx1-ubyte"]
    after = IdxSource(tmp_path)
    assert after.uri == before.uri and after.fingerprint() != fingerprint
    imgs, labs = after._images["train"], after._labels["train"]
    assert len(imgs) == 55 and (imgs[:50] == x).all() and (after._images["test"] == tx).all()
    assert after.key("train", 0) == "train-000000" and after.key("train", 54) == "train-000054"
    for img, lab in zip(imgs[50:], labs[50:]):  # mirrored copies of five of the originals, with their labels
        i = next(i for i in range(50) if (x[i][:, ::-1] == img).all())
        assert lab == i % 10


def test_the_dry_runs_view_of_the_image_holds_torch_and_not_prefect(tmp_path):
    gc = _gpu_check()
    r = subprocess.run([sys.executable, "-c", gc.IMAGE_VIEW, str(tmp_path), json.dumps(gc.IMAGE_PACKAGES)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    seen = set(json.loads(r.stdout))
    assert {"torch", "numpy", "pytest", "pluggy"} <= seen and not seen & {"prefect", "pydantic", "sluice"}
    names = {p.name for p in tmp_path.iterdir()}
    assert {"torch", "numpy", "_pytest"} <= names and not names & {"prefect", "pydantic", "sluice"}
    code = "import torch, numpy; import importlib.util as u; print(u.find_spec('prefect') is None)"
    r = subprocess.run([sys.executable, "-I", "-S", "-c", f"import sys; sys.path.insert(0, {str(tmp_path)!r}); {code}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr[-2000:]


def test_a_step_past_its_limit_is_killed_with_what_it_started(tmp_path):
    gc = _gpu_check()
    log = tmp_path / "step.log"
    pid_file = tmp_path / "child.pid"
    rc = gc.run(["sh", "-c", f"echo started; sleep 600 & echo $! > {pid_file}; sleep 600"], log, timeout=1)
    assert rc == 124
    child = int(pid_file.read_text())  # what the step started in the background is stopped with it
    for _ in range(100):  # reaped by whoever adopted it; a zombie counts as stopped
        stat = Path(f"/proc/{child}/stat")
        if not stat.exists() or stat.read_text().split(")")[-1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the step's background child {child} outlived the step's time limit")
    text = log.read_text()
    assert "started" in text and "timed out after 1 s" in text
    assert gc.run([sys.executable, "-c", "print('fine')"], log, timeout=60) == 0 and "fine" in log.read_text()


def test_a_cpu_dry_run_is_never_written_as_gpu_results(tmp_path):
    from benchmarks.common import RESULTS
    from benchmarks.gpu import write
    res = {"commit": "x", "host": {"python": "3"}, "skipped": {}}
    with pytest.raises(SystemExit, match="refusing"):
        write(dict(res), str(RESULTS / "gpu.json"), cuda=False, quick=True)
    assert write(dict(res), str(tmp_path / "gpu.json"), cuda=False, quick=True).exists()


def test_the_loader_check_runs_the_loader_benchmark_alone_within_its_limit(tmp_path, monkeypatch):
    """GPU_CHECK_ARGS=--loader: benchmarks.gpu_loader --quick from the copy of benchmarks/, with a
    time budget that ends it inside the step's limit (8 minutes, data included); its skipped arms
    go into the summary."""
    gc = _gpu_check()
    assert gc.LOADER_LIMIT_S <= 480 and gc.LOADER_BUDGET_S <= gc.LOADER_LIMIT_S - 60
    assert gc.STEP_LIMITS["gpu"]["loader"] == gc.LOADER_LIMIT_S <= gc.BUDGET["gpu"]
    src = tmp_path / "src"
    (src / "benchmarks").mkdir(parents=True)
    (src / "benchmarks" / "__init__.py").write_text("")
    (src / "benchmarks" / "gpu_loader.py").write_text(
        "import json, sys\n"
        "a = sys.argv[1:]\n"
        "out = a[a.index('--out') + 1]\n"
        "json.dump({'argv': a, 'skipped': {'sluice-ffcv-cpu': 'ffcv is not installed'},\n"
        "           'sizes': {'224': {'arms': {'synthetic': {'runs': [{'images_per_s': 1.0}]}}}}}, open(out, 'w'))\n")
    out = tmp_path / "out"
    out.mkdir()
    summary = {"skipped": []}
    monkeypatch.setattr(gc, "say", lambda msg: None)
    step = gc.loader_step(Path(sys.executable), out, src, dict(os.environ), 400, False, summary)
    assert step["ok"] and step["rc"] == 0 and step["arms_measured"] == 1
    argv = json.loads((out / "gpu_loader.json").read_text())["argv"]
    assert "--quick" in argv and float(argv[argv.index("--time-budget") + 1]) <= 340
    assert summary["skipped"] == [{"what": "loader benchmark: sluice-ffcv-cpu", "why": "ffcv is not installed"}]
    assert "benchmarks.gpu_loader" in (out / "loader.log").read_text()
    full = gc.loader_step(Path(sys.executable), out, src, dict(os.environ), None, True, {"skipped": []})
    argv = json.loads((out / "gpu_loader.json").read_text())["argv"]
    assert full["ok"] and "--quick" not in argv and "--time-budget" not in argv
