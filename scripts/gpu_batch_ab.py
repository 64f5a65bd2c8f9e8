#!/usr/bin/env python3
"""A/B on one GPU: time to 93% for the plain baseline, Sluice's default recipe, and Sluice with
train.batch_size=256, seeds interleaved.

    python3 scripts/gpu_batch_ab.py OUT_DIR [SEEDS]      # setup: throwaway env as scripts/gpu_check.py makes it, then runs
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # the repository root


def setup(out: Path, seeds: str) -> int:
    sys.path.insert(0, str(HERE / "scripts"))
    import gpu_check as g
    base = g.probe([os.environ.get("GPU_PY", ""), sys.executable])
    print("base:", json.dumps(base), flush=True)
    work = Path(tempfile.mkdtemp(prefix="ab-"))
    t = time.time()
    vpy, pip = g.make_venv(base, work / "venv", out / "install.log")
    wh = HERE / "wheelhouse" / "cp312"
    print("installed:", g.install(pip, wh, out / "install.log"), f"({time.time() - t:.0f} s)", flush=True)
    src = work / "src"  # benchmarks beside no source tree: the installed wheel runs
    shutil.copytree(HERE / "benchmarks", src / "benchmarks", ignore=shutil.ignore_patterns("__pycache__", "results"))
    (src / "benchmarks" / "results").mkdir()
    shutil.copy(Path(__file__), src / "ab.py")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "SLUICE_CACHE_DIR": str(work / "cache"),
           "SLUICE_FASHION_MNIST": str(g.wheelhouse_fashion_mnist(wh / "data" / "fashion-mnist",
                                                                  work / "fashion-mnist")),
           "PYTHONUNBUFFERED": "1"}
    os.chdir(src)  # exec: the same pid, so `timeout` around this script stops the runs too
    os.execve(str(vpy), [str(vpy), "ab.py", "--run", str(out), seeds], env)


def med_range(vals):
    v = [x for x in vals if x is not None]
    if not v:
        return "none"
    return f"median {statistics.median(v):.2f} (min {min(v):.2f}, max {max(v):.2f}; {len(v)}/{len(vals)} runs)"


def run(out: Path, seeds: list[int]) -> int:
    import torch
    from benchmarks.gpu_tta import TARGET, run_sluice
    from benchmarks.time_to_accuracy import run_baseline, seconds_to
    import sluice
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0),
            "sluice_from": sluice.__file__, "cwd": os.getcwd()}
    print("env:", json.dumps(info), flush=True)
    arms = {"baseline": lambda s: run_baseline(6.0, s, threads=4, channels_last=True, amp="bf16",
                                               extra=("--device", "cuda")),
            "sluice_b256": lambda s: run_sluice(5.5, s, 256),
            "sluice_default": lambda s: run_sluice(5.5, s)}
    res = {"target": TARGET, "info": info, "seeds": seeds, "runs": []}
    for seed in seeds:
        for arm, fn in arms.items():
            t = time.time()
            try:
                r = fn(seed)
                err = None
            except Exception as e:  # noqa: BLE001
                r, err = {"evals": [], "final_acc": None, "wall_s": None}, repr(e)[-2000:]
            r.update(arm=arm, seed=seed, seconds_to_93=seconds_to(r["evals"], TARGET), error=err,
                     outer_s=time.time() - t)
            res["runs"].append(r)
            fa = r.get("final_acc")
            print(f"RUN {arm:15s} seed {seed}: 93% at {r['seconds_to_93']}, final "
                  f"{fa if fa is None else round(fa, 4)}, wall {r.get('wall_s')}, steps {r.get('steps')}, "
                  f"batch {r.get('batch_size')}, s/step {r.get('seconds_per_step') or r.get('step_s')}, "
                  f"err {err}", flush=True)
            print("   evals:", json.dumps([{k: round(v, 4) if isinstance(v, float) else v for k, v in e.items()}
                                           for e in r["evals"]]), flush=True)
            (out / "ab.json").write_text(json.dumps(res, indent=1) + "\n")
    print("\nTABLE arm seed s_to_93 final_acc wall_s steps")
    for r in res["runs"]:
        print(f"{r['arm']:15s} {r['seed']} {r['seconds_to_93']} {r['final_acc']} {r['wall_s']} {r.get('steps')}")
    for arm in arms:
        rs = [r for r in res["runs"] if r["arm"] == arm]
        print(f"{arm:15s} s_to_93: {med_range([r['seconds_to_93'] for r in rs])}; "
              f"final_acc: {med_range([r['final_acc'] for r in rs])}; misses "
              f"{sum(r['seconds_to_93'] is None for r in rs)}")
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--run":
        sys.exit(run(Path(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")]))
    o = Path(sys.argv[1])
    o.mkdir(parents=True, exist_ok=True)
    sys.exit(setup(o, sys.argv[2] if len(sys.argv) > 2 else "0,1,2"))
