"""Sharding throughput: our whole stage (all formats at once) against the raw writers.

Shards all 70,000 Fashion-MNIST images (raw .npy) and reports samples/s and MB/s for:
our stage writing every format; our stage per format (WebDataset + DALI index, FFCV);
``webdataset.ShardWriter`` alone; FFCV's ``DatasetWriter`` alone. The raw writers get the
pixels already in memory; our stage reads and checks the source itself.
Goal: our stage (all formats) takes no longer than the raw writers' sum.

    python -m benchmarks.shard [--quick]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import table, timer, write_result
from benchmarks.hostinfo import describe_run, load_average
from benchmarks.results_page import _s, _x, provenance


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def load_fmnist(limit: int | None):
    from sluice.stages.data.config import IngestConfig
    from sluice.stages.data.ingest import open_source
    from sluice.stages.data.split import plan_splits
    src = open_source("fashion-mnist")
    plan = plan_splits(src, IngestConfig(limit=limit))
    items = [(split, sp, i) for split, lst in plan.items() for sp, i in lst]
    imgs = np.stack([src._images[sp][i] for _, sp, i in items])[:, :, :, None]
    labels = np.array([int(src._labels[sp][i]) for _, sp, i in items])
    return imgs, labels


def raw_webdataset(imgs, labels, out: Path) -> None:
    import webdataset as wds
    out.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(out / "shard-%06d.tar"), maxcount=5000, verbose=0) as w:
        for n in range(len(labels)):
            w.write({"__key__": f"s{n:07d}", "npy": imgs[n], "cls": int(labels[n])})


class _Arrays:
    def __init__(self, imgs, labels):
        self.imgs, self.labels = imgs, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, n):
        return self.imgs[n], int(self.labels[n])


def raw_ffcv(imgs, labels, out: Path, workers: int) -> None:
    import contextlib
    import io
    from ffcv.fields import IntField, NDArrayField
    from ffcv.writer import DatasetWriter
    out.mkdir(parents=True, exist_ok=True)
    w = DatasetWriter(str(out / "data.beton"), {"image": NDArrayField(np.dtype("uint8"), imgs.shape[1:]),
                                                "label": IntField()}, num_workers=workers)
    with contextlib.redirect_stderr(io.StringIO()):
        w.from_indexed_dataset(_Arrays(imgs, labels), chunksize=256)


def sluice(out: Path, formats: list[str], workers: int, limit: int | None) -> None:
    from sluice.stages.data.config import IngestConfig
    from sluice.stages.data.shard import ShardConfig, shard_dataset
    s = shard_dataset(IngestConfig(limit=limit), out, ShardConfig(formats=formats, workers=workers, progress=False))
    assert not s.reused


# ------------------------------------------------------------------ its section of docs/results.md

def results_section(d: dict[str, Any]) -> list[str]:
    rows = {r["name"]: r for r in d["rows"]}
    ours, raw = rows.get("sluice all formats"), [r for n, r in rows.items() if n.startswith("raw")]
    lines = ["#### Sharding", ""]
    if ours and raw:
        lines.append(f"All three formats of {ours['samples']:,} images: {_s(ours['seconds'], ' s', 1)}, against "
                     f"{_s(sum(r['seconds'] for r in raw), ' s', 1)} for "
                     + " + ".join(r["name"].removeprefix("raw ") for r in raw)
                     + f" alone ({_x(d.get('ratio_to_raw_sum'))}; goal ≤ 1.0×: "
                     f"**{'met' if d.get('goal_met') else 'missed'}**).")
    return lines + ["", provenance(d, "shard.json")]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one repetition (about a minute or two)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--limit", type=int, default=None, help="samples per source split (default: all 70,000)")
    args = ap.parse_args(argv)
    provenance = describe_run("benchmarks.shard", argv)
    repeats = args.repeats or (1 if args.quick else 3)
    workers = os.cpu_count() or 1
    imgs, labels = load_fmnist(args.limit)
    import ffcv.writer  # noqa: F401  (imports cost seconds once per process; keep them out of every row)
    import webdataset  # noqa: F401
    n = len(labels)
    runs = {
        "sluice all formats": lambda o: sluice(o, ["webdataset", "dali", "ffcv"], workers, args.limit),
        "sluice webdataset+dali": lambda o: sluice(o, ["webdataset", "dali"], workers, args.limit),
        "sluice ffcv": lambda o: sluice(o, ["ffcv"], workers, args.limit),
        "raw webdataset.ShardWriter": lambda o: raw_webdataset(imgs, labels, o),
        "raw ffcv DatasetWriter": lambda o: raw_ffcv(imgs, labels, o, workers),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    sizes: dict[str, int] = {}
    tmp = Path(tempfile.mkdtemp(prefix="sluice-bench-shard-"))
    try:
        for r in range(repeats):  # interleaved, so drift on a shared machine hits every row alike
            for name, fn in runs.items():
                out = tmp / f"{name.replace(' ', '_')}-{r}"
                with timer() as t:
                    fn(out)
                times[name].append(t["seconds"])
                sizes[name] = _dir_bytes(out)
                shutil.rmtree(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    for name in runs:
        sec = statistics.median(times[name])
        rows.append({"name": name, "samples": n, "seconds": sec, "samples_per_s": n / sec,
                     "MB": sizes[name] / 1e6, "MB_per_s": sizes[name] / 1e6 / sec})
    raw_sum = statistics.median(times["raw webdataset.ShardWriter"]) + statistics.median(times["raw ffcv DatasetWriter"])
    ours = statistics.median(times["sluice all formats"])
    print(table(rows, ["name", "samples", "seconds", "samples_per_s", "MB", "MB_per_s"]))
    print(f"\nsluice (all formats) {ours:.1f} s vs raw writers' sum {raw_sum:.1f} s: "
          f"ratio {ours / raw_sum:.2f} (goal <= 1.0) -> {'MET' if ours <= raw_sum else 'NOT MET'}")
    result = {**provenance, "mode": "quick" if args.quick else "full", "repeats": repeats, "workers": workers,
              "rows": rows,
              "raw_sum_seconds": raw_sum, "sluice_all_seconds": ours, "ratio_to_raw_sum": ours / raw_sum,
              "goal_met": ours <= raw_sum, "load_average_end": load_average()}
    print(f"wrote {write_result('shard', result)}")
    return result


if __name__ == "__main__":
    main()
