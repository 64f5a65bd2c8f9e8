#!/usr/bin/env python3
"""Does a refactor change what training computes? Runs a fixed set of small CPU trainings and
prints, per configuration, every logged loss, every evaluation and the final weights' digest, as
JSON. Run it with two checkouts' Pythons and compare:

    python scripts/same_results.py > /tmp/new.json
    /tmp/oldvenv/bin/python scripts/same_results.py > /tmp/old.json   # or PYTHONPATH=<old tree>
    python scripts/same_results.py --compare /tmp/old.json /tmp/new.json

Configurations: in-memory arrays (plain; EMA + channels-last + accumulation + clipping); the
Loader over a Fashion-MNIST artifact with random-resized-crop + flip (memory and webdataset
backends); InfoBatch and selective backprop; two ranks under torchrun with PowerSGD. Each logs
every step, so a changed step anywhere shows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _launch():
    try:
        from sluice.stages.run.launch import launch, make_job
    except ImportError:  # a checkout from before stages/run
        from sluice.stages.train.launch import launch, make_job
    return launch, make_job


def _summary(r: Any) -> dict[str, Any]:
    return {"losses": [m["loss"] for m in r.metrics], "evals": [e.get("acc") for e in r.evals],
            "final_acc": r.final_acc, "digests": r.summary.get("param_digests"), "steps": r.steps}


def configurations(tmp: Path) -> dict[str, Callable[[], dict[str, Any]]]:
    import numpy as np
    from sluice.stages.data.config import IngestConfig
    from sluice.stages.data.shard import ShardConfig, shard_dataset
    from sluice.stages.load import AugmentSpec, Loader, LoaderConfig
    from sluice.stages.load.arrays import ArrayLoader, fashion_mnist
    from sluice.stages.select import SelectionConfig, build_selector
    from sluice.stages.train import TrainConfig, train

    x, y = fashion_mnist("train")
    tx, ty = fashion_mnist("test")
    x, y, tx, ty = x[:512], y[:512], tx[:256], ty[:256]

    def cfg(**kw: Any) -> TrainConfig:
        base = dict(model_kwargs={"width": 8}, max_steps=12, batch_size=32, lr=0.05, progress=False,
                    torch_threads=1, log_every_steps=1, eval_every_steps=6)
        return TrainConfig(**{**base, **kw})

    def arrays(bs: int = 32) -> tuple[Any, Any]:
        return ArrayLoader(x, y, bs, seed=0), ArrayLoader(tx, ty, 64, shuffle=False, drop_last=False, even=False)

    art: list[Any] = []

    def artifact() -> str:
        if not art:
            s = shard_dataset(IngestConfig(source="fashion-mnist", limit=600, seed=4), tmp / "fmnist",
                              ShardConfig(shard_samples=128, progress=False, workers=1))
            art.append(s.root)
        return str(art[0])

    def on_artifact(backend: str) -> dict[str, Any]:
        aug = AugmentSpec.standard(size=28, mean=(0.286,), std=(0.353,))
        tr = Loader(artifact(), LoaderConfig(backend=backend, batch_size=32, drop_last=True, augment=aug,
                                             workers=1, prefetch=0, seed=1))
        ev = Loader(artifact(), LoaderConfig(split="val", backend=backend, batch_size=64, workers=1, prefetch=0,
                                             sampler={"kind": "sequential"}))
        return _summary(train(cfg(), tr, ev))

    def selected(method: str, **params: Any) -> dict[str, Any]:
        tr, ev = arrays(64 if method == "selective_backprop" else 32)
        sel = build_selector(SelectionConfig(method=method, params=params, seed=3),
                             candidate_size=len(tr) and tr.batch_size, split_size=len(x))
        return _summary(train(cfg(), tr, ev, sel))

    def two_ranks() -> dict[str, Any]:
        launch, make_job = _launch()
        data = {"kind": "arrays", "path": "fashion-mnist:train", "limit": 512}
        ev = {"kind": "arrays", "path": "fashion-mnist:test", "limit": 256}
        job = make_job(cfg(max_steps=8, comm={"mode": "powersgd", "params": {"rank": 2}}).model_dump(), data, ev)
        return _summary(launch(job, nproc=2, out_dir=tmp / "two-ranks", on_line=lambda s: None))

    return {
        "arrays": lambda: _summary(train(cfg(), *arrays())),
        "arrays+ema+channels_last+accum+clip": lambda: _summary(train(
            cfg(ema_decay=0.9, channels_last=True, accum_steps=2, clip_grad_norm=1.0), *arrays(16))),
        "artifact-memory": lambda: on_artifact("memory"),
        "artifact-webdataset": lambda: on_artifact("webdataset"),
        "infobatch": lambda: selected("infobatch"),
        "selective_backprop": lambda: selected("selective_backprop"),
        "two-ranks-powersgd": two_ranks,
    }


def compare(a: Path, b: Path) -> int:
    old, new = json.loads(a.read_text()), json.loads(b.read_text())
    bad = 0
    for name in sorted(set(old) | set(new)):
        same = old.get(name) == new.get(name)
        bad += not same
        print(f"{'same' if same else 'DIFFERENT':10s} {name}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("OLD", "NEW"))
    ap.add_argument("--only", nargs="*", help="run only these configurations")
    a = ap.parse_args(argv)
    if a.compare:
        return compare(*a.compare)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, run in configurations(Path(tmp)).items():
            if a.only and name not in a.only:
                continue
            try:
                out[name] = run()
            except Exception as e:  # noqa: BLE001 - recorded: a configuration that stopped working differs
                out[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name}: done", file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
