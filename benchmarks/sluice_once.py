"""One Sluice run of the time-to-accuracy benchmark, in a fresh process, as a user's run starts:
``python -m benchmarks.sluice_once CONFIG_JSON`` prints one JSON line with its evaluations.

Wall times count from this process's start, before any import: Python, torch, Prefect and
Sluice start-up and every cold cost (FFCV's JIT-compiled writer, the shard pool's first fork)
are charged to the run, as the plain baseline pays its own start-up. Only starting Prefect's
embedded API is taken out (timed here and reported as ``api_s``): a deployment's runs use a
server that is already up.
"""
from __future__ import annotations

import time

START = time.time()  # before any import: the run pays its own start-up

import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    config = json.loads((argv or sys.argv[1:])[0])
    from benchmarks.pipeline import start_embedded_api
    api_s = start_embedded_api()
    import sluice.flows.nightly as fl
    flow_start = time.time()
    res = fl.nightly(config)
    end = time.time()
    metrics = Path(res["run_dir"]) / "metrics.jsonl"
    evals = [json.loads(x)["eval"] for x in metrics.read_text().splitlines() if x.startswith('{"eval"')]
    since_start = lambda t: t - START - api_s  # noqa: E731
    print(json.dumps({
        "evals": [{"step": e["step"], "acc": e["acc"], "wall_s": since_start(e["wall_time"])} for e in evals],
        "wall_s": since_start(end), "final_acc": evals[-1]["acc"], "api_s": api_s,
        "startup_s": flow_start - START - api_s,  # imports before the flow began
        "shard_s": sum(v.seconds for v in res["dataset"].sources), "train_wall_s": res["train"]["wall_s"],
        "amp": res["train"]["summary"].get("amp"),
        # trained samples a second, every rank together (each rank's own rate, times the ranks)
        "samples_per_s": (res["train"]["summary"].get("samples_per_s") or 0) * res["train"]["summary"].get("world_size", 1),
        "promotion": {k: res["promotion"].get(k) for k in ("eval_split", "candidate_value")}}), flush=True)


if __name__ == "__main__":
    main()
