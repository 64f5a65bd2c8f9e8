#!/usr/bin/env python3
"""Does a refactor change what training computes? Runs a fixed set of small CPU trainings and
prints, per configuration, every logged loss, every evaluation and the final weights' digest, as
JSON. Run it with two checkouts' Pythons and compare:

    python scripts/same_results.py > /tmp/new.json
    /tmp/oldvenv/bin/python scripts/same_results.py > /tmp/old.json   # or PYTHONPATH=<old tree>
    python scripts/same_results.py --compare /tmp/old.json /tmp/new.json

Configurations: in-memory arrays (plain; EMA + channels-last + accumulation + clipping); the
Loader over a Fashion-MNIST artifact with random-resized-crop + flip (memory and webdataset
backends); InfoBatch and selective backprop; two ranks under torchrun with PowerSGD; an image
mixture of two artifacts (per-source evaluation); a GPT on a two-source token mixture, plain and
with InfoBatch keyed by document. Each logs every step, so a changed step anywhere shows.
"""
from __future__ import annotations

import argparse
import inspect
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


EVAL_KEYS = ("acc", "loss", "n", "loss_by_source", "acc_by_source")


def _summary(r: Any) -> dict[str, Any]:
    return {"losses": [m["loss"] for m in r.metrics],
            "evals": [{k: e[k] for k in EVAL_KEYS if k in e} for e in r.evals],
            "final_acc": r.final_acc, "digests": r.summary.get("param_digests"), "steps": r.steps}


def _image_mixture_loader(mixture: dict[str, Any], config: Any) -> Any:
    """A loader over several image artifacts: ``Loader(mixture=...)``, or (before one loader read
    every number of sources) ``image_mixture.MixtureLoader``."""
    try:
        from sluice.stages.load.image_mixture import MixtureLoader
    except ImportError:
        from sluice.stages.load import Loader
        return Loader(mixture=mixture, config=config)
    return MixtureLoader(mixture, config)


def _text_corpus(root: Path, name: str, n: int, seed: int) -> Path:
    """A folder of small, learnable documents (word sequences with structure), one per file."""
    import numpy as np
    rng = np.random.default_rng(seed)
    words = ["the", "cat", "sat", "on", "mat", "dog", "ran", "to", "a", "red", "ball", "and", "then",
             "slept", "under", "tree", "big", "small", "house", "near", "river", "bird", "sang", "song"]
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        w, seq = int(rng.integers(0, len(words))), []
        for _ in range(int(rng.integers(8, 60))):  # each word picks among three successors
            w = (3 * w + int(rng.integers(0, 3))) % len(words)
            seq.append(words[w])
        (out / f"doc{i:04d}.txt").write_text(" ".join(seq) + ".\n")
    return out


def configurations(tmp: Path) -> dict[str, Callable[[], dict[str, Any]]]:
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

    def array_loader(images: Any, labels: Any, bs: int, **kw: Any) -> Any:
        """Batches normalised as the train config's defaults say: by the loader where it takes
        ``normalize`` (batches reach the trainer model-ready), else by the trainer (before)."""
        if "normalize" in inspect.signature(ArrayLoader).parameters:
            kw["normalize"] = {"mean": [0.5], "std": [0.5]}
        return ArrayLoader(images, labels, bs, **kw)

    def arrays(bs: int = 32) -> tuple[Any, Any]:
        return array_loader(x, y, bs, seed=0), array_loader(tx, ty, 64, shuffle=False, drop_last=False, even=False)

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
        if method == "infobatch":  # 6 batches an epoch: 12 steps reach the epochs that prune
            tr = array_loader(x[:192], y[:192], 32, seed=0)
        sel = build_selector(SelectionConfig(method=method, params=params, seed=3),
                             candidate_size=len(tr) and tr.batch_size, split_size=len(x))
        return _summary(train(cfg(), tr, ev, sel))

    def image_artifact(name: str, limit: int, seed: int) -> str:
        if name not in images:
            s = shard_dataset(IngestConfig(source="fashion-mnist", limit=limit, seed=seed), tmp / name,
                              ShardConfig(shard_samples=128, progress=False, workers=1))
            images[name] = s.root
        return str(images[name])

    images: dict[str, Any] = {}

    def image_mixture() -> dict[str, Any]:
        a, b = image_artifact("mix-a", 400, 5), image_artifact("mix-b", 300, 6)
        aug = AugmentSpec.standard(size=28, mean=(0.286,), std=(0.353,))
        train_mix = {"sources": [{"path": a, "name": "a", "weight": 0.7}, {"path": b, "name": "b", "weight": 0.3}],
                     "epoch_size": 320, "seed": 2}
        eval_mix = {"sources": [{"path": a, "name": "a", "repeat": 1.0}, {"path": b, "name": "b", "repeat": 1.0}]}
        tr = _image_mixture_loader(train_mix, LoaderConfig(backend="memory", batch_size=32, drop_last=True,
                                                           augment=aug, workers=1, prefetch=0, seed=1))
        ev = _image_mixture_loader(eval_mix, LoaderConfig(
            split="val", backend="memory", batch_size=64, workers=1, prefetch=0, sampler={"kind": "sequential"},
            augment=AugmentSpec(ops=[{"op": "normalize", "mean": [0.286], "std": [0.353]}])))
        return _summary(train(cfg(), tr, ev))

    tokens: dict[str, Any] = {}

    def token_sources() -> tuple[str, str]:
        if not tokens:
            from sluice.stages.data.text import TextShardConfig, shard_text
            first = None
            for name, n, seed in (("prose", 40, 11), ("verse", 32, 12)):
                c = TextShardConfig(tokenizer="bpe", vocab_size=300, val_fraction=0.2, progress=False,
                                    tokenizer_file=first)
                s = shard_text(c, _text_corpus(tmp / "text", name, n, seed), tmp / "tok" / name)
                tokens[name] = s.root
                first = first or str(tmp / "tok" / name)
        return str(tokens["prose"]), str(tokens["verse"])

    def gpt(method: str | None) -> dict[str, Any]:
        from sluice.stages.load.tokens import TokenLoader, TokenLoaderConfig
        from sluice.storage.tokens import open_token_split
        prose, verse = token_sources()
        vocab = open_token_split(prose, "train").vocab_size
        mix = {"sources": [{"path": prose, "name": "prose", "weight": 0.6},
                           {"path": verse, "name": "verse", "weight": 0.4}], "weight_unit": "tokens", "seed": 3}
        once = {"sources": [{"path": prose, "name": "prose", "repeat": 1.0},
                            {"path": verse, "name": "verse", "repeat": 1.0}]}
        tr = TokenLoader(config=TokenLoaderConfig(split="train", seq_len=32, batch_size=4, mixture=mix, seed=3,
                                                  prefetch=0, doc_keys=method is not None))
        ev = TokenLoader(config=TokenLoaderConfig(split="val", seq_len=32, batch_size=8, mixture=once, prefetch=0))
        c = cfg(model="gpt", num_classes=vocab, optimizer="adamw", lr=3e-3, betas=(0.9, 0.95), clip_grad_norm=1.0,
                model_kwargs={"n_layer": 2, "n_head": 2, "d_model": 32, "max_len": 32}, max_steps=48,
                eval_every_steps=24)  # about 30 steps an epoch: InfoBatch prunes in the second
        sel = None
        if method is not None:
            sel = build_selector(SelectionConfig(method=method, seed=3), candidate_size=4,
                                 split_size=tr.n_doc_keys)
        return _summary(train(c, tr, ev, sel))

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
        "image-mixture": image_mixture,
        "gpt-two-sources": lambda: gpt(None),
        "gpt-two-sources-infobatch": lambda: gpt("infobatch"),
    }


def compare(a: Path, b: Path, record: Path | None = None, before_commit: str | None = None) -> int:
    """Each configuration same or DIFFERENT; ``record``: also write both runs and the verdicts
    there, with the commits and the host (a results file, as the benchmarks write them)."""
    old, new = json.loads(a.read_text()), json.loads(b.read_text())
    same = {name: old.get(name) == new.get(name) for name in sorted(set(old) | set(new))}
    for name, ok in same.items():
        print(f"{'same' if ok else 'DIFFERENT':10s} {name}")
    if record is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from benchmarks.hostinfo import cpu, git_commit, host_class_record, load_average
        record.write_text(json.dumps({
            "command": f"python scripts/same_results.py (before: at {before_commit or 'the old commit'}; after: at "
                       f"this commit), then --compare BEFORE AFTER --record {record.name}",
            "commit": git_commit(), "before_commit": before_commit, "host": cpu(), **host_class_record(),
            "load_average_start": load_average(), "same": same, "before": old, "after": new}, indent=1) + "\n")
    return 0 if all(same.values()) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("OLD", "NEW"))
    ap.add_argument("--record", type=Path, help="with --compare: write both runs and the verdicts to this file")
    ap.add_argument("--before-commit", help="with --record: the commit OLD was run at")
    ap.add_argument("--only", nargs="*", help="run only these configurations")
    a = ap.parse_args(argv)
    if a.compare:
        return compare(*a.compare, record=a.record, before_commit=a.before_commit)
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
