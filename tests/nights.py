"""One nightly run of the pipeline in a fresh process, as the deployment runs it, on a
Fashion-MNIST slice of ``limit`` training images (a source that grows as ``limit`` does)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

NIGHT = """
import json, sys
import sluice.flows.nightly as fl
from sluice.flows.pipeline import PipelineConfig
r = fl.nightly(PipelineConfig.model_validate(json.loads(sys.argv[1])))
print("RESULT " + json.dumps({**{k: r["promotion"][k] for k in ("model_id", "promoted", "unseen", "champion_before",
                                                                 "warm")}, "run_dir": r["run_dir"]}))
"""


def night(data_root: Path, limit: int, seed: int = 4, **sections: dict) -> tuple[int, str]:
    cfg = {"data_root": str(data_root), "nproc": 1,
           "data": {"source": "fashion-mnist", "ingest": {"limit": limit, "seed": seed},
                    "shard": {"shard_samples": 500, "workers": 1, "progress": False}},
           "selection": {"method": "none"}, "train": {"max_steps": 8, "batch_size": 32}, **sections}
    out = subprocess.run([sys.executable, "-c", NIGHT, json.dumps(cfg)], capture_output=True, text=True,
                         timeout=600)
    return out.returncode, out.stdout + out.stderr


def result(text: str) -> dict:
    return json.loads(next(x for x in text.splitlines() if x.startswith("RESULT "))[len("RESULT "):])


def cli_night(data_root: Path, *sets: str) -> list[str]:
    """``sluice run nightly`` as a user types it, on a 600-image Fashion-MNIST slice, plus ``sets``."""
    base = ["data.source=fashion-mnist", "data.ingest.limit=600", "data.ingest.seed=4",
            "data.shard.shard_samples=500", "data.shard.workers=1", "data.shard.progress=false", "nproc=1",
            "selection.method=none", "train.batch_size=32"]
    cmd = [sys.executable, "-m", "sluice.flows.cli", "run", "nightly", "--data-root", str(data_root)]
    for kv in (*base, *sets):
        cmd += ["--set", kv]
    return cmd


def run_dir_of(text: str) -> Path:
    """The run folder a night's summary names."""
    return Path(next(line.split("run directory    : ")[1].split()[0] for line in text.splitlines()
                     if line.startswith("run directory")))
