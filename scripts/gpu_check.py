#!/usr/bin/env python3
"""``make gpu-check``: prove Sluice's GPU path on a CUDA machine in one command, with no network.

    python3 scripts/gpu_check.py [--dry-run] [--wheelhouse DIR] [--out DIR] [--full] [--keep-venv] [--loader]

On a Linux machine with an NVIDIA GPU and a CUDA build of torch already installed, it:

1. makes a throwaway virtualenv that reuses that torch (``--system-site-packages``; where the
   interpreter with torch is itself a virtualenv, a ``.pth`` file naming its site-packages);
2. installs Sluice, Prefect and what else the image lacks from the wheelhouse (``make
   wheelhouse``; scripts/gpu-wheelhouse.txt says what and why), with ``--no-index --no-deps``:
   torch is never pulled; where the image has no Fashion-MNIST, the wheelhouse's (its image files
   stored as xz, to fit with the checkout in what can be carried) is expanded into the throwaway
   folder as the ``.gz`` files Sluice reads, and ``SLUICE_FASHION_MNIST`` names it;
3. checks what the GPU tests and the benchmark import (without Prefect), what the front door
   imports (Prefect and its API server), and where each module comes from;
4. runs the front door as a user does, nothing set by hand: ``sluice demo`` (Prefect's temporary
   API server, no server to start; data root ``<results>/sluice-data``), then a second night,
   ``sluice run nightly``, on the same source grown by 10% (the demo's copy of Fashion-MNIST,
   grown in place by mirrored copies of a tenth of its images under new keys), which must start
   warm from the demo's champion. Each run's wall time, accuracy, promotion and the host
   settings the run resolved to (device, ranks, batch) go into the summary;
5. runs ``pytest -m gpu`` on the GPU test files and ``python -m benchmarks.gpu --quick`` from a
   copy of ``tests/`` and ``benchmarks/`` (so the *installed* Sluice is what runs), and
6. writes every log and result into one folder, ``gpu-check-results/<UTC time>/``, and prints
   what was skipped and why.

With ``--loader`` (``GPU_CHECK_ARGS=--loader``) steps 4 and 5 are replaced by the ResNet-50 loader
benchmark alone, ``python -m benchmarks.gpu_loader --quick`` (its ImageNet-like data written and
sharded on this machine's cores), within 8 minutes (``LOADER_LIMIT_S``); ``gpu_loader.json`` and
``loader.log`` go into the results folder.

Every step has its own time limit (``STEP_LIMITS``) and the quick check stops starting steps
after 9 minutes in all (``--budget``): a step that runs out of time is recorded as timed out and
the next one runs. The GPU run passes the front door nothing but its data root and the grown
source; only the CPU dry run shortens the flows' training (``DRY_RUN_SETTINGS``), which the
summary records.

Without a GPU it stops at once with a one-line message (exit 3), unless ``--dry-run`` (or
``GPU_CHECK_DRY_RUN=1``): then it does all of the above on the CPU, where every GPU test must skip
cleanly and the benchmark runs its CPU-side arms only. The dry run's env sees from the interpreter
with torch only what a CUDA image brings (``IMAGE_PACKAGES`` and what they require), so a wheel
missing from the wheelhouse fails here too. This script needs only the standard library and its
two siblings in scripts/ (``gpu_check_env.py``: the throwaway env; ``gpu_check_proc.py``: a step
run under its time limit); the interpreter with torch is found as ``$GPU_PY``, else this one,
else ``.venv/bin/python``.
"""
from __future__ import annotations

import argparse
import gzip
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

# its siblings in scripts/ (on sys.path already when run as a script, not when loaded by path)
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
# IMAGE_PACKAGES and IMAGE_VIEW are read from here too (tests/test_gpu_check.py), as the env's
# pieces are (scripts/gpu_batch_ab.py)
from gpu_check_env import IMAGE_PACKAGES, IMAGE_VIEW, install, make_venv, probe  # noqa: E402, F401
from gpu_check_proc import fail, run, say  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GPU_TEST_FILES = ["tests/test_gpu_paths.py", "tests/test_train.py", "tests/test_loader_dali.py",
                  "tests/test_placement.py", "tests/test_loader_on_gpu.py", "tests/test_step_syncs.py",
                  "tests/test_infobatch_mask.py", "tests/test_decode_device.py"]
DEBIAN_FMNIST = Path("/usr/share/datasets/fashion-mnist")
# what the GPU tests and benchmarks.gpu import: from the image, or from the wheelhouse (*); in a
# process of their own, which must not import Prefect
IMPORTS = ["torch", "numpy", "cv2", "PIL", "yaml", "fsspec", "tqdm", "pytest", "pytest_timeout",
           "pydantic*", "pydantic_core*", "webdataset*", "sluice*", "sluice.stages.load",
           "sluice.stages.train", "sluice.storage.registry", "sluice.stages.data.shard"]
# what the front door imports: the flows, Prefect and its API server, all from the wheelhouse
FRONT_DOOR_IMPORTS = ["prefect*", "fastapi*", "sqlalchemy*", "aiosqlite*", "uvicorn*", "docket*",
                      "matplotlib", "sluice.flows.nightly*", "prefect.server.api.server*"]
# --loader (GPU_CHECK_ARGS=--loader): benchmarks.gpu_loader alone, in its quick mode, within 8 minutes
# (LOADER_LIMIT_S) on one GPU and 16 cores: writing the 10,000 ImageNet-like JPEGs (~30 s) and
# sharding them (~1 min), then 24 windows (4 arms x 2 sizes x 3 repeats, ~10 s each); the benchmark
# starts no window after LOADER_BUDGET_S, so it ends inside the step's limit with every file written
LOADER_LIMIT_S = 450
LOADER_BUDGET_S = 390
# Each step's time limit in seconds, on a GPU (quick check) and in the CPU dry run; --full: none
# but --budget's. The quick check on one H100 fits in 9 minutes (BUDGET): the env ~1, the demo
# 2-3, the second night 1-2, the tests and benchmark the rest.
STEP_LIMITS = {"gpu": {"install": 180, "imports": 120, "demo": 240, "night": 180, "pytest": 180, "benchmark": 240,
                       "loader": LOADER_LIMIT_S},
               "dry-run": {"install": 300, "imports": 120, "demo": 900, "night": 900, "pytest": 600,
                           "benchmark": 900, "loader": 900}}
BUDGET = {"gpu": 540, "dry-run": 3600}
# The CPU dry run alone shortens the flows' training (two CPU cores would take the demo's full
# budget many minutes); the GPU run sets nothing by hand: the front door as a user runs it.
DRY_RUN_SETTINGS = {"demo": ["train.epochs=1"], "night": ["warm.epochs=0.5"]}
GROW_FRACTION = 0.1  # the second night's source: Fashion-MNIST and 10% more


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
if sys.argv[3] == "without-prefect":
    out["prefect not imported"] = {"ok": "prefect" not in sys.modules, "where": None,
                                   "why": None if "prefect" not in sys.modules else "a stage imported Prefect"}
print(json.dumps(out))
"""


# The second night's source: the demo's own Fashion-MNIST folder (a copy), grown in place by a
# seeded tenth more training images, mirrored copies of existing ones (the dataset has no more),
# appended after the 60,000 so that every earlier image keeps its key ("train-000123"); the test
# files stay as they are. Written uncompressed beside the .gz (the IDX source reads that first),
# then the .gz goes: the same source, grown, as a user's folder grows between two nights
GROW = r"""
import json, os, struct, sys
from pathlib import Path
import numpy as np
from sluice.stages.data.sources.idx import read_idx
src, frac = Path(sys.argv[1]), float(sys.argv[2])
def load(stem):
    return read_idx(next(p for p in (src / stem, src / (stem + ".gz")) if p.is_file()))
def save(stem, a):
    tmp = src / (stem + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack(">HBB", 0, 8, a.ndim) + struct.pack(f">{a.ndim}I", *a.shape) + a.tobytes())
    os.replace(tmp, src / stem)
    (src / (stem + ".gz")).unlink(missing_ok=True)
x, y = load("train-images-idx3-ubyte"), load("train-labels-idx1-ubyte")
n = int(round(len(x) * frac))
pick = np.sort(np.random.default_rng(7).choice(len(x), n, replace=False))
save("train-images-idx3-ubyte", np.concatenate([x, x[pick][:, :, ::-1]]).astype(np.uint8))
save("train-labels-idx1-ubyte", np.concatenate([y, y[pick]]).astype(np.uint8))
print(json.dumps({"source": str(src), "images": len(x) + n, "added": n, "first_new_key": f"train-{len(x):06d}"}))
"""

# The registry after a run: every model, its metrics and warm start, and the champion
REGISTRY = r"""
import json, sys
from sluice.storage.registry import Registry
reg = Registry(sys.argv[1])
champ = reg.champion()
print(json.dumps({"champion": champ.model_id if champ else None, "models": [
    {"model_id": r.model_id, "metric": r.metric, "value": r.value, "test": (r.metrics or {}).get("test"),
     "dataset": r.dataset_fingerprint[:16],
     "warm_start": {k: v for k, v in (r.warm_start or {}).items() if k in
                    ("init", "parent_model", "new", "replayed", "epochs", "lr_scale")} or None}
    for r in reg.list()]}, default=str))
"""


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


CANDIDATE = re.compile(r"^candidate\s*: (?P<model>\S+) (?P<split>[a-z]+)_(?P<metric>\w+) (?P<acc>[0-9.]+) "
                       r"\((?P<report_split>\S+) (?P<report_acc>[0-9.]+)\), (?:higher|lower) is better -> "
                       r"(?P<outcome>promoted|not promoted) \((?P<reason>.*)\)\s*$", re.M)
RESOLVED = re.compile(r"^#? ?resolved for this host(?: at run time)?: (.+?)  \(", re.M)  # "  (HOST_NOTE)"


def outcome(text: str) -> dict:
    """What a front-door run printed: the host settings it resolved to, its candidate's accuracy
    and promotion, and where it trained (flows/cli.py's banner and outcome block)."""
    res: dict = {}
    m = RESOLVED.search(text)
    res["resolved"] = m.group(1) if m else None
    m = CANDIDATE.search(text)
    if m:
        res.update(model_id=m["model"], eval_split=m["split"], accuracy=float(m["acc"]),
                   report_split=m["report_split"], report_accuracy=float(m["report_acc"]),
                   promoted=m["outcome"] == "promoted", reason=m["reason"])
    for key, label in (("trained_on", "trained on"), ("champion", "champion")):
        m = re.search(rf"^{label}\s*: (.+?)\s*$", text, re.M)
        res[key] = m.group(1) if m else None
    return res


def front_door(name: str, cmd: list, out: Path, cwd: Path, env: dict, timeout: float | None,
               vpy: Path, data_root: Path) -> dict:
    """One run of the ``sluice`` command, as a user runs it: its outcome and the registry after it."""
    log = out / f"{name}.log"
    say(" ".join(map(str, cmd[1:] if cmd[0] == vpy else [Path(cmd[0]).name, *cmd[1:]])))
    t = time.time()
    rc = run(cmd, log, cwd=cwd, env=env, echo=True, timeout=timeout)
    res = {"rc": rc, "timed_out": rc == 124, "seconds": round(time.time() - t, 1),
           **outcome(log.read_text(errors="replace"))}
    r = subprocess.run([vpy, "-c", REGISTRY, str(data_root / "registry")], capture_output=True, text=True,
                       cwd=cwd, env=env, timeout=300)
    res["registry"] = json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else {"error": r.stderr[-1000:]}
    return res


def brief(name: str, r: dict) -> str:
    if r.get("timed_out"):
        return f"{name}: timed out after {r['seconds']:.0f} s"
    if "accuracy" not in r:
        return f"{name}: no outcome (exit {r.get('rc')}, {r.get('seconds', 0):.0f} s)"
    warm = (r.get("warm_start") or {})
    return (f"{name}: {r['seconds']:.0f} s, {r['eval_split']} accuracy {r['accuracy']:.4f} "
            f"({r['report_split']} {r['report_accuracy']:.4f}), "
            f"{'promoted' if r['promoted'] else 'not promoted'} ({r['reason']}); resolved: {r['resolved']}"
            + (f"; warm from {warm['parent_model']} ({warm.get('new')} new + {warm.get('replayed')} replayed)"
               if warm.get("parent_model") else ""))


def front_door_settings(mode: str) -> dict[str, list[str]]:
    """The ``--set`` each front-door run gets beyond its data root and source: none on a GPU (the
    demo and the night as a user runs them); the CPU dry run's shorter training (recorded)."""
    return {k: list(v) for k, v in DRY_RUN_SETTINGS.items()} if mode == "dry-run" else {"demo": [], "night": []}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", default=os.environ.get("GPU_CHECK_DRY_RUN") == "1",
                    help="run without a GPU: GPU tests must skip, the benchmark runs its CPU-side arms")
    ap.add_argument("--wheelhouse", default=os.environ.get("WHEELHOUSE"),
                    help="default: wheelhouse/cp<python> (make wheelhouse WHEEL_PY=<python>)")
    ap.add_argument("--out", default=os.environ.get("GPU_CHECK_OUT"), help="default: gpu-check-results/<UTC time>")
    ap.add_argument("--full", action="store_true", help="the full benchmark instead of --quick")
    ap.add_argument("--keep-venv", action="store_true", help="keep the throwaway env (in the results folder)")
    ap.add_argument("--loader", action="store_true",
                    help="run only benchmarks.gpu_loader (quick, within 8 minutes; with --full: the full benchmark)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds after which no step starts (default: 540 on a GPU, 3600 in the dry run; "
                         "--full: none)")
    args = ap.parse_args(argv)

    started = time.time()
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
    mode = "gpu" if base["cuda"] else "dry-run"
    limits = {k: (None if args.full else v) for k, v in STEP_LIMITS[mode].items()}
    budget = args.budget if args.budget is not None else (None if args.full else BUDGET[mode])
    deadline = started + budget if budget else None
    sets = front_door_settings(mode)
    say(f"{'dry run (CPU)' if mode == 'dry-run' else 'GPU ' + str(base.get('gpu'))}; torch {base['torch']} "
        f"(CUDA {base['cuda_build']}) from {base['python']}; wheelhouse {wh}; results in {out}")
    summary: dict = {"mode": mode, "base": base, "wheelhouse": str(wh), "budget_s": budget,
                     "front_door_settings": sets, "steps": {}, "skipped": []}
    steps = summary["steps"]

    def limit(step: str) -> float | None:
        """The step's time limit: its own, cut to what is left of the budget (None: no limit)."""
        left = None if deadline is None else deadline - time.time()
        own = limits.get(step)
        return left if own is None else own if left is None else min(own, left)

    def out_of_time(step: str) -> bool:
        t = limit(step)
        if t is not None and t < 15:
            steps[step] = {"ok": False, "timed_out": True, "seconds": 0,
                           "why": f"not started: the check's {budget:.0f} s were spent"}
            say(f"{step}: not started, the check's {budget:.0f} s were spent")
            return True
        return False

    work = Path(tempfile.mkdtemp(prefix="sluice-gpu-check-"))
    venv = (out / "venv") if args.keep_venv else work / "venv"
    try:
        t = time.time()
        vpy, pip = make_venv(base, venv, out / "install.log", image_only=mode == "dry-run")
        summary["installed"] = install(pip, wh, out / "install.log", timeout=limit("install"))
        steps["install"] = {"ok": True, "seconds": round(time.time() - t, 1)}
        say(f"installed {len(summary['installed'])} wheels into a throwaway env ({time.time() - t:.0f} s)")

        t = time.time()
        prefix = subprocess.run([vpy, "-c", "import sys; print(sys.prefix)"], capture_output=True,
                                text=True).stdout.strip()
        imports = {}
        for names, what in ((IMPORTS, "without-prefect"), (FRONT_DOOR_IMPORTS, "front-door")):
            try:
                r = subprocess.run([vpy, "-c", CHECK_IMPORTS, prefix, json.dumps(names), what], capture_output=True,
                                   text=True, cwd=work, timeout=limit("imports"))
                imports.update(json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip()
                               else {f"probe ({what})": {"ok": False, "why": r.stderr[-2000:]}})
            except subprocess.TimeoutExpired:
                imports[f"probe ({what})"] = {"ok": False, "why": "timed out"}
        (out / "imports.json").write_text(json.dumps(imports, indent=2) + "\n")
        bad = {k: v["why"] for k, v in imports.items() if not v["ok"]}
        steps["imports"] = {"ok": not bad, "problems": bad, "seconds": round(time.time() - t, 1)}
        for k, why in bad.items():
            say(f"import check: {k}: {why}")

        src = work / "src"  # tests and benchmarks beside no source tree: the installed wheel runs
        for d in ("tests", "benchmarks"):
            shutil.copytree(ROOT / d, src / d,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "results", ".cache"))
        (src / "benchmarks" / "results").mkdir()
        shutil.copy(ROOT / "pyproject.toml", src / "pyproject.toml")  # pytest's markers and timeout
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "SLUICE_CACHE_DIR": str(work / "cache"),
               "GPU_CHECK_COMMIT": _commit()}
        if not DEBIAN_FMNIST.is_dir() and not os.environ.get("SLUICE_FASHION_MNIST") \
                and (wh / "data" / "fashion-mnist").is_dir():
            t = time.time()
            fm_wh = wheelhouse_fashion_mnist(wh / "data" / "fashion-mnist", work / "fashion-mnist-wheelhouse")
            env["SLUICE_FASHION_MNIST"] = str(fm_wh)
            summary["fashion_mnist"] = {"from": str(wh / "data" / "fashion-mnist"), "at": str(fm_wh),
                                        "seconds": round(time.time() - t, 1)}

        if args.loader:  # the GPU loader benchmark alone (GPU_CHECK_ARGS=--loader)
            steps["loader"] = loader_step(vpy, out, src, env, limit("loader"), args.full, summary)
            summary["skipped"].append({"what": "the front door, pytest -m gpu, benchmarks.gpu",
                                       "why": "--loader runs benchmarks.gpu_loader alone"})
        else:
            # The front door: `sluice demo`, then a night on a grown source, as a user runs them. Prefect
            # keeps its database and settings in the throwaway folder (no ~/.prefect read or left behind).
            # Its Fashion-MNIST is a copy of the one the tests read (the wheelhouse's, where the image
            # has none), named by SLUICE_FASHION_MNIST as there: the second night grows it in place.
            fm_from = Path(env.get("SLUICE_FASHION_MNIST") or DEBIAN_FMNIST)
            fm = work / "fashion-mnist"
            fm.mkdir()
            for f in fm_from.glob("*-ubyte*"):
                shutil.copy(f, fm / f.name)
            fenv = {**env, "PREFECT_HOME": str(work / "prefect"), "SLUICE_FASHION_MNIST": str(fm)}
            sluice = venv / "bin" / "sluice"
            cli = [sluice] if sluice.exists() else [vpy, "-m", "sluice.flows.cli"]
            data_root = out / "sluice-data"
            if not out_of_time("demo"):
                cmd = [*cli, "demo", "--data-root", data_root, *[a for kv in sets["demo"] for a in ("--set", kv)]]
                demo = front_door("demo", cmd, out, work, fenv, limit("demo"), vpy, data_root)
                reg = demo.get("registry") or {}
                demo["ok"] = (demo["rc"] == 0 and "accuracy" in demo and bool(reg.get("champion")))
                steps["demo"] = demo
                say(brief("demo", demo))
            champion = ((steps.get("demo") or {}).get("registry") or {}).get("champion")
            if champion and not out_of_time("night"):
                t = time.time()
                r = subprocess.run([vpy, "-c", GROW, str(fm), str(GROW_FRACTION)], capture_output=True, text=True,
                                   cwd=work, env=fenv, timeout=limit("night"))
                grow = json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else {"error": r.stderr[-2000:]}
                with open(out / "night.log", "a") as f:
                    f.write(f"grow: {json.dumps(grow)} ({time.time() - t:.1f} s)\n")
                if "error" in grow:
                    steps["night"] = {"ok": False, "grow": grow, "seconds": round(time.time() - t, 1)}
                    say(f"night: could not grow the source: {grow['error'][-300:]}")
                else:
                    over = [a for kv in sets["night"] for a in ("--set", kv)]
                    # what a run with these settings resolves to on this host (`sluice run` prints no banner)
                    run([*cli, "config", "show", "--data-root", data_root, *over], out / "night.log", cwd=work,
                        env=fenv, timeout=120)
                    night = front_door("night", [*cli, "run", "nightly", "--data-root", data_root, *over], out, work,
                                       fenv, limit("night"), vpy, data_root)
                    night["run_seconds"] = night["seconds"]  # `sluice run nightly` alone
                    night["seconds"] = round(time.time() - t, 1)  # the source's growing and the config included
                    night["grow"] = grow
                    models = {m["model_id"]: m for m in (night.get("registry") or {}).get("models", [])}
                    night["warm_start"] = (models.get(night.get("model_id")) or {}).get("warm_start")
                    night["ok"] = (night["rc"] == 0 and "accuracy" in night
                                   and (night["warm_start"] or {}).get("parent_model") == champion)
                    if night["rc"] == 0 and not night["ok"]:
                        night["why"] = f"expected a warm start from the demo's champion {champion}"
                    steps["night"] = night
                    say(brief("night", night))
            elif not champion and "night" not in steps:
                steps["night"] = {"ok": False, "why": "not run: the demo left no champion to start from"}
            # the two dataset versions (~350 MB in three formats) would not come back from the GPU
            # machine; the registry, runs and logs stay
            shutil.rmtree(out / "sluice-data" / "datasets", ignore_errors=True)

            if not out_of_time("pytest"):
                t = time.time()
                files = [f for f in GPU_TEST_FILES if (src / f).exists()]
                say(f"pytest -m gpu {' '.join(files)}")
                rc = run([vpy, "-m", "pytest", "-m", "gpu", "-v", "-rs", "-p", "no:cacheprovider",
                          f"--junitxml={out / 'pytest.xml'}", *files], out / "pytest.log", cwd=src, env=env, echo=True,
                         timeout=limit("pytest"))
                counts, skipped = skipped_tests(out / "pytest.xml")
                ran = counts.get("tests", 0) - counts.get("skipped", 0)
                ok = rc == 0 and (ran > 0 if base["cuda"] else counts.get("failures", 0) + counts.get("errors", 0) == 0)
                steps["pytest"] = {"ok": ok, "rc": rc, "timed_out": rc == 124, **counts,
                                   "seconds": round(time.time() - t, 1)}
                summary["skipped"] += [{"what": s["test"], "why": s["reason"]} for s in skipped]

            if not out_of_time("benchmark"):
                t = time.time()
                bench = [vpy, "-m", "benchmarks.gpu", "--out", str(out / "gpu.json"),
                         *([] if args.full else ["--quick"])]
                say("python -m " + " ".join(map(str, bench[2:])))
                rc = run(bench, out / "bench.log", cwd=src, env=env, echo=True, timeout=limit("benchmark") or 3600)
                res = json.loads((out / "gpu.json").read_text()) if (out / "gpu.json").exists() else {}
                steps["benchmark"] = {"ok": rc == 0 and bool(res), "rc": rc, "timed_out": rc == 124,
                                      "seconds": round(time.time() - t, 1)}
                summary["skipped"] += [{"what": f"benchmark: {k}", "why": v} for k, v in res.get("skipped", {}).items()]

            if args.full and not out_of_time("front_door"):  # the front door against the plain loop, 3 seeds
                t = time.time()
                bench = [vpy, "-m", "benchmarks.gpu_front_door", "--out", str(out / "gpu_front_door.json")]
                say("python -m " + " ".join(map(str, bench[2:])))
                rc = run(bench, out / "front_door.log", cwd=src,
                         env={**env, "PREFECT_HOME": str(work / "prefect-bench")},
                         echo=True, timeout=7200)  # the untouched Fashion-MNIST, not the grown copy
                steps["front_door"] = {"ok": rc == 0 and (out / "gpu_front_door.json").exists(), "rc": rc,
                                       "timed_out": rc == 124, "seconds": round(time.time() - t, 1)}
    finally:
        if not args.keep_venv:
            shutil.rmtree(work, ignore_errors=True)
    summary["seconds"] = round(time.time() - started, 1)
    summary["ok"] = all(s["ok"] for s in steps.values())
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print()
    say(f"skipped ({len(summary['skipped'])}):")
    for s in summary["skipped"]:
        print(f"  - {s['what']}: {s['why']}")
    for name in ("demo", "night"):
        if name in steps and "rc" in steps[name]:
            say(brief(name, steps[name]))
    if any(sets.values()):
        say("the dry run shortened the front door's training: " +
            "; ".join(f"{k}: --set {' --set '.join(v)}" for k, v in sets.items() if v))
    for name, s in steps.items():
        state = "ok" if s["ok"] else "TIMED OUT" if s.get("timed_out") else "FAILED"
        say(f"{name}: {state}" + (f" ({s['seconds']:.0f} s)" if s.get("seconds") else "")
            + (f": {s['why']}" if s.get("why") and not s["ok"] else ""))
    if summary["ok"] and base["cuda"]:
        name = "gpu_loader.json" if args.loader else "gpu.json"
        say(f"passed; to publish the benchmark: cp {out / name} benchmarks/results/{name}")
    say(f"{'passed' if summary['ok'] else 'FAILED'} in {summary['seconds']:.0f} s: everything is in {out}")
    return 0 if summary["ok"] else 1


def loader_step(vpy: Path, out: Path, src: Path, env: dict, timeout: float | None, full: bool,
                summary: dict) -> dict:
    """``benchmarks.gpu_loader`` from the copy of ``benchmarks/`` (the installed Sluice runs), its
    dataset written by every core into the throwaway folder; quick unless ``full``, with a time
    budget inside the step's limit. Its results file is ``<out>/gpu_loader.json``."""
    t = time.time()
    res_file = out / "gpu_loader.json"
    cmd = [vpy, "-m", "benchmarks.gpu_loader", "--out", str(res_file)]
    if not full:
        cmd += ["--quick", "--time-budget", str(LOADER_BUDGET_S if timeout is None else
                                                 max(30, min(LOADER_BUDGET_S, timeout - 60)))]
    say("python -m " + " ".join(map(str, cmd[2:])))
    rc = run(cmd, out / "loader.log", cwd=src, env=env, echo=True, timeout=timeout or 7200)
    res = json.loads(res_file.read_text()) if res_file.exists() else {}
    ran = [a for s in res.get("sizes", {}).values() for a, v in s.get("arms", {}).items()
           if any("images_per_s" in r for r in v.get("runs", []))]
    summary["skipped"] += [{"what": f"loader benchmark: {k}", "why": v} for k, v in res.get("skipped", {}).items()]
    return {"ok": rc == 0 and bool(ran), "rc": rc, "timed_out": rc == 124, "arms_measured": len(ran),
            "seconds": round(time.time() - t, 1)}


def wheelhouse_fashion_mnist(src: Path, dest: Path) -> Path:
    """The wheelhouse's Fashion-MNIST as Sluice reads it: each ``<name>.xz`` (the image files,
    stored as xz by ``make wheelhouse`` so that it fits in what can be carried with the checkout)
    expanded into ``dest`` as ``<name>.gz`` (gzip level 1: written in seconds), the ``.gz`` files
    copied beside them; ``src`` itself where it holds no ``.xz`` (a wheelhouse built before)."""
    packed = sorted(src.glob("*-ubyte.xz"))
    if not packed:
        return src
    dest.mkdir(parents=True, exist_ok=True)
    for f in packed:
        tmp = dest / (f.stem + ".gz.tmp")
        with lzma.open(f) as i, gzip.open(tmp, "wb", compresslevel=1) as o:
            shutil.copyfileobj(i, o, 1 << 20)
        os.replace(tmp, dest / (f.stem + ".gz"))
    for f in sorted(src.glob("*-ubyte*")):
        if f.suffix != ".xz" and not (dest / f.name).exists():
            shutil.copy(f, dest / f.name)
    return dest


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
