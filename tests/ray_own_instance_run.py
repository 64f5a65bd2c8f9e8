"""Run inside a network namespace that also has a non-loopback address (tests/test_ray_engine.py
starts it): ``engine: ray`` without an address starts a Ray instance of Sluice's own. Prints one
JSON line: where it listens, what it advertises, whether a client without its token joins, and
the sha256 list of a small artifact sharded on it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.pop("RAY_AUTH_TOKEN", None)
os.environ.pop("RAY_AUTH_MODE", None)

from sluice.stages.data.config import IngestConfig, ShardConfig  # noqa: E402
from sluice.stages.data.engine import EngineConfig, connect, engine_parts  # noqa: E402
from sluice.stages.data.shard import shard_dataset  # noqa: E402

out = Path(sys.argv[1])
engine = EngineConfig(name="ray")
ray = connect(engine, log=lambda line: None)
report = {"auth_mode": os.environ.get("RAY_AUTH_MODE"), "has_token": bool(os.environ.get("RAY_AUTH_TOKEN")),
          "advertised": sorted({n["NodeManagerAddress"] for n in ray.nodes()}),
          "listening": sorted({line.split()[3].rsplit(":", 1)[0] for line in
                               subprocess.run(["ss", "-Hltn"], capture_output=True, text=True).stdout.splitlines()
                               if line.strip()})}
address = ray.get_runtime_context().gcs_address
probe = "import ray, sys; ray.init(address=sys.argv[1]); print('JOINED')"
env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"}
try:
    r = subprocess.run([sys.executable, "-c", probe, address], env=env, capture_output=True, text=True, timeout=90)
    report["stranger_joined"] = "JOINED" in r.stdout
except subprocess.TimeoutExpired:
    report["stranger_joined"] = False
cfg = ShardConfig(shard_samples=100, formats=["webdataset"], progress=False)
ing = IngestConfig(source="fashion-mnist", limit=400)
report["ray"] = [f.sha256 for f in shard_dataset(ing, out / "ray", cfg, map_shards=engine_parts(engine, log=lambda x: None)).manifest.files()]
report["local"] = [f.sha256 for f in shard_dataset(ing, out / "local", cfg).manifest.files()]
ray.shutdown()
print("REPORT " + json.dumps(report), flush=True)
