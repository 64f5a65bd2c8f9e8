#!/usr/bin/env python3
"""Interleaved A/B of ``sluice demo`` between two checkouts on this host: does a change make the
front door slower on this CPU? Each arm is a checkout with a Python whose ``sluice`` imports
that checkout; runs alternate (A, B, A, B, ...) so the host's drift hits both alike.

    python3 scripts/demo_ab.py --arm old=/tmp/oldvenv/bin/python --arm new=.venv/bin/python \
        --runs 2 --out benchmarks/results/demo_ab-avx2.json

Records per run: wall seconds from the command's start to its end, the champion's test accuracy
and the line the demo prints saying what it resolved to; and the host's load average before each.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESOLVED = "resolved for this host: "


def one_run(python: Path) -> dict:
    root = Path(tempfile.mkdtemp(prefix="sluice-demo-ab-"))
    la = os.getloadavg()[0]
    t0 = time.time()
    out = subprocess.run([str(python.parent / "sluice"), "demo", "--data-root", str(root)], capture_output=True,
                         text=True, timeout=3600)
    wall = time.time() - t0
    try:
        if out.returncode != 0:
            raise RuntimeError(f"{python}: sluice demo failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
        champ = json.loads((root / "registry" / "champion.json").read_text())
        record = json.loads((root / "registry" / "models" / champ["model_id"] / "record.json").read_text())
        resolved = next((x[len(RESOLVED):].split("  (", 1)[0] for x in out.stdout.splitlines()
                         if x.startswith(RESOLVED)), None)
        return {"wall_s": round(wall, 1), "test_acc": (record.get("metrics") or {}).get("test", {}).get("acc"),
                "resolved": resolved, "load_average_before": la}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arm", action="append", required=True, help="NAME=PYTHON (its sluice is the arm's)")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    arms = dict(a.split("=", 1) for a in args.arm)
    runs: dict[str, list] = {name: [] for name in arms}
    for i in range(args.runs):
        for name, py in arms.items():
            r = one_run(Path(py))
            runs[name].append(r)
            print(f"run {i} {name}: {r['wall_s']} s, test {r['test_acc']}, {r['resolved']}", flush=True)
    commits = {name: subprocess.run([str(Path(py).resolve().parent / "python"), "-c",
                                     "import sluice, pathlib; print(pathlib.Path(sluice.__file__).parents[1])"],
                                    capture_output=True, text=True).stdout.strip() for name, py in arms.items()}
    summary = {name: {"median_wall_s": statistics.median(r["wall_s"] for r in rs),
                      "median_test_acc": statistics.median(r["test_acc"] for r in rs)} for name, rs in runs.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": " ".join(sys.argv), "checkouts": commits, "cpu_flags_bf16":
                                    "avx512_bf16" in Path("/proc/cpuinfo").read_text(), "runs": runs,
                                    "summary": summary}, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
