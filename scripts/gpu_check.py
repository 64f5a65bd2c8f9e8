#!/usr/bin/env python3
"""``make gpu-check``: prove Sluice's GPU path on a CUDA machine in one command, with no network.

    python3 scripts/gpu_check.py [--dry-run] [--wheelhouse DIR] [--out DIR] [--full] [--keep-venv]

On a Linux machine with an NVIDIA GPU and a CUDA build of torch already installed, it:

1. makes a throwaway virtualenv that reuses that torch (``--system-site-packages``; where the
   interpreter with torch is itself a virtualenv, a ``.pth`` file naming its site-packages);
2. installs Sluice and what the image lacks from the wheelhouse (``make wheelhouse``), with
   ``--no-index --no-deps``: torch is never pulled, nor Prefect (see scripts/gpu-wheelhouse.txt);
3. checks what the GPU tests and the benchmark import, and where each module comes from;
4. runs ``pytest -m gpu`` on the GPU test files and ``python -m benchmarks.gpu --quick`` from a
   copy of ``tests/`` and ``benchmarks/`` (so the *installed* Sluice is what runs), and
5. writes every log and result into one folder, ``gpu-check-results/<UTC time>/``, and prints
   what was skipped and why.

Without a GPU it stops at once with a one-line message (exit 3), unless ``--dry-run`` (or
``GPU_CHECK_DRY_RUN=1``): then it does all of the above on the CPU, where every GPU test must skip
cleanly and the benchmark runs its CPU-side arms only. This script needs only the standard
library; the interpreter with torch is found as ``$GPU_PY``, else this one, else ``.venv/bin/python``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_TEST_FILES = ["tests/test_gpu_paths.py", "tests/test_train.py", "tests/test_loader_dali.py"]
DEBIAN_FMNIST = Path("/usr/share/datasets/fashion-mnist")
# what the GPU tests and benchmarks.gpu import: from the image, or from the wheelhouse (*)
IMPORTS = ["torch", "numpy", "cv2", "PIL", "yaml", "fsspec", "tqdm", "pytest", "pytest_timeout",
           "pydantic*", "pydantic_core*", "webdataset*", "sluice*", "sluice.stages.load",
           "sluice.stages.train", "sluice.storage.registry", "sluice.stages.data.shard"]

PROBE = r"""
import json, os, shutil, subprocess, sys, site
import torch
info = {"python": sys.executable, "version": "%d.%d" % sys.version_info[:2], "torch": torch.__version__,
        "cuda_build": torch.version.cuda, "cuda": torch.cuda.is_available(),
        "in_venv": sys.prefix != sys.base_prefix, "site": site.getsitepackages()}
if info["cuda"]:
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(),
                capability="%d.%d" % (p.major, p.minor), memory_gib=round(p.total_memory / 2**30, 1))
smi = shutil.which("nvidia-smi")
info["nvidia_smi"] = smi
if smi:
    try:
        info["driver"] = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["driver"] = None
print(json.dumps(info))
"""

CHECK_IMPORTS = r"""
import importlib, json, sys
prefix = sys.argv[1]
out = {}
for name in json.loads(sys.argv[2]):
    want_local = name.endswith("*")
    name = name.rstrip("*")
    try:
        m = importlib.import_module(name)
        where = getattr(m, "__file__", None) or str(list(getattr(m, "__path__", [])))
        ok = (not want_local) or where.startswith(prefix)
        out[name] = {"ok": ok, "where": where, "version": getattr(m, "__version__", None),
                     "why": None if ok else "expected from the wheelhouse (the throwaway env), found elsewhere"}
    except Exception as e:  # noqa: BLE001 - reported, not raised
        out[name] = {"ok": False, "where": None, "why": f"{type(e).__name__}: {e}"}
out["prefect not imported"] = {"ok": "prefect" not in sys.modules, "where": None,
                               "why": None if "prefect" not in sys.modules else "a stage imported Prefect"}
print(json.dumps(out))
"""


def say(msg: str) -> None:
    print(f"gpu-check: {msg}", flush=True)


def fail(msg: str, code: int = 2) -> "SystemExit":
    print(f"gpu-check: {msg}", file=sys.stderr, flush=True)
    return SystemExit(code)


def probe(candidates: list[str]) -> dict:
    """The first interpreter among ``candidates`` that imports torch, described."""
    tried = []
    for py in candidates:
        if not py or not (shutil.which(py) or Path(py).exists()):
            continue
        try:
            r = subprocess.run([py, "-c", PROBE], capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            tried.append(f"{py} ({e})")
            continue
        if r.returncode == 0 and r.stdout.strip():
            return json.loads(r.stdout.strip().splitlines()[-1])
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        tried.append(f"{py} ({last})")
    raise fail("no Python with torch found (tried: " + "; ".join(tried or candidates) +
               "); set GPU_PY to the interpreter that has the CUDA build of torch")


def run(cmd: list[str], log: Path, cwd: Path | None = None, env: dict | None = None,
        echo: bool = False, timeout: float | None = None) -> int:
    """Run ``cmd``, its output into ``log`` (and to the console with ``echo``); its exit code."""
    with open(log, "a") as f:
        f.write(f"$ {' '.join(map(str, cmd))}\n")
        f.flush()
        p = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        try:
            for line in p.stdout:
                f.write(line)
                if echo:
                    sys.stdout.write(line)
                    sys.stdout.flush()
            return p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            return 124


def make_venv(base: dict, venv: Path, log: Path) -> tuple[Path, list[str]]:
    """A throwaway venv seeing ``base``'s torch; (its python, the pip command for it)."""
    py = base["python"]
    flags = [] if base["in_venv"] else ["--system-site-packages"]
    if run([py, "-m", "venv", *flags, venv], log) != 0:  # no ensurepip (Debian without python3-venv)
        shutil.rmtree(venv, ignore_errors=True)
        if run([py, "-m", "venv", "--without-pip", *flags, venv], log) != 0:
            raise fail(f"cannot create a virtualenv with {py} (see {log})")
    vpy = venv / "bin" / "python"
    if base["in_venv"]:  # a venv's packages are not "system" ones: name them in a .pth file
        purelib = subprocess.run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        Path(purelib, "_gpu_check_base.pth").write_text("\n".join(base["site"]) + "\n")
    has_pip = subprocess.run([vpy, "-m", "pip", "--version"], capture_output=True).returncode == 0
    pip = [str(vpy), "-m", "pip"] if has_pip else [py, "-m", "pip", "--python", str(vpy)]
    return vpy, pip


def install(pip: list[str], wheelhouse: Path, log: Path) -> list[str]:
    wheels = sorted(str(p) for p in wheelhouse.glob("*.whl"))
    if not any(Path(w).name.startswith("sluice-") for w in wheels):
        raise fail(f"{wheelhouse} has no sluice wheel; rebuild it with make wheelhouse")
    # every wheel, no index, no dependency resolution: the image's torch stays as it is; installed
    # into the env even where the base already has a copy (so the wheelhouse is what is tested)
    cmd = [*pip, "install", "--no-index", "--no-deps", "--ignore-installed", "--disable-pip-version-check",
           "--find-links", str(wheelhouse), *wheels]
    if run(cmd, log) != 0:
        raise fail(f"installing from {wheelhouse} failed (see {log})")
    return [Path(w).name for w in wheels]


def skipped_tests(junit: Path) -> tuple[dict, list[dict]]:
    """(counts, skipped tests with their reasons) from pytest's junit XML."""
    if not junit.exists():
        return {}, []
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    skipped = []
    for suite in ET.parse(junit).getroot().iter("testsuite"):
        for k in counts:
            counts[k] += int(suite.get(k, 0))
        for case in suite.iter("testcase"):
            s = case.find("skipped")
            if s is not None:
                skipped.append({"test": f"{case.get('classname')}::{case.get('name')}",
                                "reason": s.get("message", "")})
    return counts, skipped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", default=os.environ.get("GPU_CHECK_DRY_RUN") == "1",
                    help="run without a GPU: GPU tests must skip, the benchmark runs its CPU-side arms")
    ap.add_argument("--wheelhouse", default=os.environ.get("WHEELHOUSE"),
                    help="default: wheelhouse/cp<python> (make wheelhouse WHEEL_PY=<python>)")
    ap.add_argument("--out", default=os.environ.get("GPU_CHECK_OUT"), help="default: gpu-check-results/<UTC time>")
    ap.add_argument("--full", action="store_true", help="the full benchmark instead of --quick")
    ap.add_argument("--keep-venv", action="store_true", help="keep the throwaway env (in the results folder)")
    args = ap.parse_args(argv)

    base = probe([os.environ.get("GPU_PY", ""), sys.executable, str(ROOT / ".venv/bin/python")])
    if not base["cuda"] and not args.dry_run:
        why = ("torch is a CPU build" if not base["cuda_build"] else
               "nvidia-smi not found" if not base["nvidia_smi"] else "CUDA initialisation failed")
        raise fail(f"no CUDA GPU visible to torch {base['torch']} in {base['python']} ({why}); run this on "
                   "a machine with an NVIDIA GPU, or GPU_CHECK_DRY_RUN=1 make gpu-check for the CPU dry run", 3)
    wh = Path(args.wheelhouse or ROOT / "wheelhouse" / f"cp{base['version'].replace('.', '')}").resolve()
    if not wh.is_dir():
        raise fail(f"no wheelhouse for Python {base['version']} at {wh}: build it where PyPI is reachable "
                   f"(make wheelhouse WHEEL_PY={base['version']}) and copy it here")
    out = Path(args.out or ROOT / "gpu-check-results" / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())).resolve()
    out.mkdir(parents=True, exist_ok=True)
    mode = "dry run (CPU)" if not base["cuda"] else f"GPU {base.get('gpu')}"
    say(f"{mode}; torch {base['torch']} (CUDA {base['cuda_build']}) from {base['python']}; "
        f"wheelhouse {wh}; results in {out}")
    summary: dict = {"mode": "dry-run" if not base["cuda"] else "gpu", "base": base, "wheelhouse": str(wh),
                     "steps": {}, "skipped": []}
    work = Path(tempfile.mkdtemp(prefix="sluice-gpu-check-"))
    venv = (out / "venv") if args.keep_venv else work / "venv"
    try:
        t = time.time()
        vpy, pip = make_venv(base, venv, out / "install.log")
        summary["installed"] = install(pip, wh, out / "install.log")
        summary["steps"]["install"] = {"ok": True, "seconds": round(time.time() - t, 1)}
        say(f"installed {len(summary['installed'])} wheels into a throwaway env ({time.time() - t:.0f} s)")

        prefix = subprocess.run([vpy, "-c", "import sys; print(sys.prefix)"], capture_output=True,
                                text=True).stdout.strip()
        r = subprocess.run([vpy, "-c", CHECK_IMPORTS, prefix, json.dumps(IMPORTS)], capture_output=True,
                           text=True, cwd=work)
        imports = json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else {"probe": {"ok": False, "why": r.stderr[-2000:]}}
        (out / "imports.json").write_text(json.dumps(imports, indent=2) + "\n")
        bad = {k: v["why"] for k, v in imports.items() if not v["ok"]}
        summary["steps"]["imports"] = {"ok": not bad, "problems": bad}
        for k, why in bad.items():
            say(f"import check: {k}: {why}")

        src = work / "src"  # tests and benchmarks beside no source tree: the installed wheel runs
        for d in ("tests", "benchmarks"):
            shutil.copytree(ROOT / d, src / d, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "results"))
        (src / "benchmarks" / "results").mkdir()
        shutil.copy(ROOT / "pyproject.toml", src / "pyproject.toml")  # pytest's markers and timeout
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "SLUICE_CACHE_DIR": str(work / "cache"),
               "GPU_CHECK_COMMIT": _commit()}
        if not DEBIAN_FMNIST.is_dir() and not os.environ.get("SLUICE_FASHION_MNIST") \
                and (wh / "data" / "fashion-mnist").is_dir():
            env["SLUICE_FASHION_MNIST"] = str(wh / "data" / "fashion-mnist")

        t = time.time()
        files = [f for f in GPU_TEST_FILES if (src / f).exists()]
        say(f"pytest -m gpu {' '.join(files)}")
        rc = run([vpy, "-m", "pytest", "-m", "gpu", "-v", "-rs", "-p", "no:cacheprovider",
                  f"--junitxml={out / 'pytest.xml'}", *files], out / "pytest.log", cwd=src, env=env, echo=True)
        counts, skipped = skipped_tests(out / "pytest.xml")
        ran = counts.get("tests", 0) - counts.get("skipped", 0)
        ok = rc == 0 and (ran > 0 if base["cuda"] else counts.get("failures", 0) + counts.get("errors", 0) == 0)
        summary["steps"]["pytest"] = {"ok": ok, "rc": rc, **counts, "seconds": round(time.time() - t, 1)}
        summary["skipped"] += [{"what": s["test"], "why": s["reason"]} for s in skipped]

        t = time.time()
        bench = [vpy, "-m", "benchmarks.gpu", "--out", str(out / "gpu.json"), *([] if args.full else ["--quick"])]
        say("python -m " + " ".join(map(str, bench[2:])))
        rc = run(bench, out / "bench.log", cwd=src, env=env, echo=True, timeout=3600)
        res = json.loads((out / "gpu.json").read_text()) if (out / "gpu.json").exists() else {}
        summary["steps"]["benchmark"] = {"ok": rc == 0 and bool(res), "rc": rc, "seconds": round(time.time() - t, 1)}
        summary["skipped"] += [{"what": f"benchmark: {k}", "why": v} for k, v in res.get("skipped", {}).items()]
    finally:
        if not args.keep_venv:
            shutil.rmtree(work, ignore_errors=True)
    summary["ok"] = all(s["ok"] for s in summary["steps"].values())
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print()
    say(f"skipped ({len(summary['skipped'])}):")
    for s in summary["skipped"]:
        print(f"  - {s['what']}: {s['why']}")
    for name, s in summary["steps"].items():
        say(f"{name}: {'ok' if s['ok'] else 'FAILED'}")
    if summary["ok"] and base["cuda"]:
        say(f"passed; to publish the benchmark: cp {out / 'gpu.json'} benchmarks/results/gpu.json")
    say(f"{'passed' if summary['ok'] else 'FAILED'}: everything is in {out}")
    return 0 if summary["ok"] else 1


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
