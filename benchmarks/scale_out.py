"""The data stages past one machine (#49): image sharding and the text stage on a Ray cluster
against this machine's pool and against LitData's ``optimize()`` and Ray Data's
``write_webdataset``, at the same cores, and a model of what 8, 32 and 128 nodes would take.

On this host a node is one core: a real ``ray.cluster_utils.Cluster`` with a 0-CPU head and two
1-CPU worker nodes, in a network namespace that holds only loopback (Ray advertises the host's
own address otherwise; ``python -m benchmarks.scale_out`` re-runs itself inside one), token
authentication on. The stage's own work on the head (listing and fingerprinting the source, the
``.beton``, the manifest; the scan and the tar shards run on the nodes) runs with one worker in
the Ray arms, as on a cluster's head node.

Arms, interleaved (their order rotates every repeat), each into a fresh folder:

- images (``benchmarks/imagenet_like.py``: variable-size JPEGs, their bytes kept), every format
  Sluice writes (tar + DALI index + ``.beton``): ``pool`` (``engine: local``, 2 workers),
  ``ray-2`` and ``ray-1`` (``engine: ray`` on 2 or 1 worker nodes); the peers write one format:
  ``litdata`` (``optimize()``, 2 workers, the JPEG bytes and label per sample) and ``ray-data``
  (``read_binary_files`` then ``write_webdataset`` on the 2-node cluster);
- text (the Debian corpus, its documents repeated with new ids until the corpus has the wanted
  size, so dedup drops the repeats), the tokenizer learnt once beforehand: ``text-local``,
  ``text-ray-2``, ``text-ray-1``.

Goals (fixed here, before any run): Ray's overhead against the pool at the same cores <= 15%;
1 -> 2 nodes >= 1.8x; Sluice (pool) >= 1.0x LitData and Ray Data (time per image; Sluice writes
three formats, they one); the model's throughput at 32 nodes >= 0.8x linear.

The model: from the 1-node run, the shard map's time per part (``c``) and everything else
(``F``: listing and fingerprinting the source, the scan's parts, the ``.beton``, the manifest);
``T(n) = F + ceil(P / n) * c`` for P shard parts, checked against the measured 2-node run;
efficiency ``T(1) / (n T(n))``. F counts the scan, which also runs on the nodes, as serial: the
model is pessimistic there, and says so.

    python -m benchmarks.scale_out [--quick] [--repeats N]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.common import rerun_in_loopback_namespace, table, write_result
from benchmarks.hostinfo import describe_run
from benchmarks.results_page import provenance

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("SLUICE_CACHE_DIR", ROOT / "benchmarks" / ".cache"))
INSIDE = "SLUICE_SCALE_OUT_NS"
GOALS = {"ray_overhead_max": 0.15, "two_nodes_min": 1.8, "vs_peer_min": 1.0, "efficiency_32_min": 0.8}
MODES = {"quick": {"images": 2000, "text_mb": 10, "repeats": 3},
         "full": {"images": 20000, "text_mb": 200, "repeats": 3}}
SHARD_SAMPLES = 250  # images per tar shard: a part of the shard map
MIB = 2**20


# ------------------------------------------------------------------ data

def text_corpus(mb: int) -> Path:
    """The Debian text sources as one .jsonl of at least ``mb`` MiB: every document once, then
    repeated under new ids (the repeats are exact copies: the stage's dedup drops them)."""
    from sluice.stages.data.text.debian import build_corpus
    from sluice.stages.data.text.sources import open_text_source
    out = CACHE / f"scale_out_text-{mb}mb.jsonl"
    if out.exists():
        return out
    src = build_corpus(CACHE / "debian-text")
    docs = []
    for name, path in src.items():
        for d in open_text_source(path).docs():
            if d.error is None and d.data:
                text = d.data.decode("utf-8", "replace") if isinstance(d.data, bytes) else d.data
                docs.append((f"{name}-{d.key}", text))
    tmp = out.with_suffix(".tmp")
    size, k = 0, 0
    with open(tmp, "w") as f:
        while size < mb * MIB:
            for key, text in docs:
                line = json.dumps({"id": f"{key}-r{k}", "text": text}) + "\n"
                f.write(line)
                size += len(line)
                if size >= mb * MIB:
                    break
            k += 1
    os.replace(tmp, out)
    return out


# ------------------------------------------------------------------ arms

def timed_parts(parts: Any) -> Any:
    """The engine's parts with the shard map (``seconds``, ``count``) and the scan's parts
    (``scan_seconds``, ``scan_count``: from the first part sent to the last result taken) timed:
    what the model splits a run into."""
    from sluice.stages.data.engine import RayParts

    class TimedParts(RayParts):
        seconds, count = 0.0, 0
        scan_seconds, scan_count = 0.0, 0

        def all(self, fn, items, what):
            t = time.perf_counter()
            out = super().all(fn, items, what)
            self.seconds += time.perf_counter() - t
            self.count += len(items)
            return out

        def ordered(self, fn, items, window=None, gpus=0):
            t, before = time.perf_counter(), self.scan_seconds
            for r in super().ordered(fn, items, window, gpus):
                self.scan_count += 1
                # at each result: the scan's consumer (a zip) stops right after its last one
                self.scan_seconds = before + time.perf_counter() - t
                yield r
    timed = TimedParts(parts.ray, parts.cfg, parts.log)
    timed._remote = parts._remote
    return timed


def sluice_images(folder: Path, out: Path, workers: int, parts: Any = None) -> dict[str, Any]:
    from sluice.stages.data.config import IngestConfig, ShardConfig
    from sluice.stages.data.shard import shard_dataset
    ingest = IngestConfig(source=str(folder), kind="folder", holdout_fraction=0.0, val_fraction=0.0,
                          test_fraction=0.0, check_classes=False)
    cfg = ShardConfig(encoding="jpg", shard_samples=SHARD_SAMPLES, workers=workers, progress=False)
    timed = timed_parts(parts) if parts is not None else None
    t = time.perf_counter()
    s = shard_dataset(ingest, out, cfg, map_shards=timed)
    seconds = time.perf_counter() - t
    return {"seconds": seconds, "samples": sum(s.manifest.counts().values()), "parts": s.shards_written,
            "map_s": timed.seconds if timed else None, "scan_s": timed.scan_seconds if timed else None,
            "scan_parts": timed.scan_count if timed else None, "formats": list(s.manifest.formats),
            "bytes": s.manifest.total_bytes()}


def litdata_images(folder: Path, out: Path, workers: int) -> dict[str, Any]:
    from litdata import optimize
    files = sorted(str(p) for p in folder.rglob("*.jpg"))
    t = time.perf_counter()
    optimize(fn=_litdata_sample, inputs=files, output_dir=str(out), num_workers=workers, chunk_bytes="64MB")
    seconds = time.perf_counter() - t
    return {"seconds": seconds, "samples": len(files), "formats": ["litdata chunks"],
            "bytes": sum(p.stat().st_size for p in out.rglob("*") if p.is_file())}


def _litdata_sample(path: str) -> dict[str, Any]:
    return {"image": Path(path).read_bytes(), "label": int(Path(path).parent.name[1:])}


def raydata_images(ray: Any, folder: Path, out: Path) -> dict[str, Any]:
    import ray.data
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    t = time.perf_counter()
    ds = ray.data.read_binary_files(str(folder), include_paths=True, file_extensions=["jpg"])
    ds = ds.map(_raydata_sample)
    ds.write_webdataset(str(out), encoder=_as_is)  # the JPEG bytes as they are (its default re-encodes PIL images)
    seconds = time.perf_counter() - t
    return {"seconds": seconds, "samples": sum(1 for _ in folder.rglob("*.jpg")), "formats": ["webdataset tar"],
            "bytes": sum(p.stat().st_size for p in out.rglob("*") if p.is_file())}


def _raydata_sample(row: dict[str, Any]) -> dict[str, Any]:
    p = Path(row["path"])
    return {"__key__": f"{p.parent.name}_{p.stem}", "jpg": row["bytes"], "cls": p.parent.name[1:].encode()}


def _as_is(sample: dict[str, Any]) -> dict[str, Any]:
    return sample


def sluice_text(corpus: Path, out: Path, tokenizer: Path, parts: Any = None) -> dict[str, Any]:
    from sluice.stages.data.text import TextShardConfig, shard_text
    cfg = TextShardConfig(tokenizer_file=str(tokenizer), progress=False)
    t = time.perf_counter()
    s = shard_text(cfg, corpus, out, parts)
    seconds = time.perf_counter() - t
    m = s.manifest
    return {"seconds": seconds, "documents_kept": sum(m.counts().values()),
            "dropped": m.dropped.exact_duplicates + m.dropped.near_duplicates,
            "tokens": sum(r.tokens for r in m.splits.values()), "bytes": corpus.stat().st_size}


# ------------------------------------------------------------------ the run (inside the namespace)

def run(mode: str, repeats: int, only: set[str] | None, sizes: dict[str, int] | None = None) -> dict[str, Any]:
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ.setdefault("RAY_AUTH_TOKEN", "sluice-bench-" + os.urandom(16).hex())
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray
    from ray.cluster_utils import Cluster

    from benchmarks.imagenet_like import make_imagenet_like, stats
    from sluice.stages.data.engine import EngineConfig, engine_parts
    from sluice.stages.data.text.shared_tokenizer import shared_tokenizer
    from sluice.stages.data.text import TextShardConfig
    m = {**MODES[mode], **(sizes or {})}
    folder = make_imagenet_like(m["images"])
    corpus = text_corpus(m["text_mb"])
    tok_dir = CACHE / f"scale_out_tokenizer-{m['text_mb']}mb"
    tokenizer = shared_tokenizer([("corpus", corpus)], TextShardConfig(progress=False), tok_dir)

    t0 = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={
        "node_ip_address": "127.0.0.1", "num_cpus": 0, "object_store_memory": 300 * MIB, "include_dashboard": False})
    workers = [cluster.add_node(node_ip_address="127.0.0.1", num_cpus=1, object_store_memory=300 * MIB)
               for _ in range(2)]
    cluster.wait_for_nodes()
    started_s = time.perf_counter() - t0
    parts = engine_parts(EngineConfig(name="ray", address=cluster.address), log=lambda line: None)

    def nodes(n: int) -> None:
        """The cluster at ``n`` worker nodes (one removed for the 1-node arms, then added back)."""
        alive = [w for w in workers if w is not None]
        while len(alive) > n:
            cluster.remove_node(alive.pop())
        while len(alive) < n:
            alive.append(cluster.add_node(node_ip_address="127.0.0.1", num_cpus=1, object_store_memory=300 * MIB))
        workers[:] = alive
        cluster.wait_for_nodes()
        deadline = time.time() + 60
        while ray.cluster_resources().get("CPU", 0) != n and time.time() < deadline:
            time.sleep(0.2)

    arms: dict[str, Callable[[Path], dict[str, Any]]] = {
        "pool": lambda out: sluice_images(folder, out, 2),
        "ray-2": lambda out: (nodes(2), sluice_images(folder, out, 1, parts))[1],
        "ray-1": lambda out: (nodes(1), sluice_images(folder, out, 1, parts))[1],
        "litdata": lambda out: litdata_images(folder, out, 2),
        "ray-data": lambda out: (nodes(2), raydata_images(ray, folder, out))[1],
        "text-local": lambda out: sluice_text(corpus, out, tokenizer),
        "text-ray-2": lambda out: (nodes(2), sluice_text(corpus, out, tokenizer, parts))[1],
        "text-ray-1": lambda out: (nodes(1), sluice_text(corpus, out, tokenizer, parts))[1],
    }
    skipped = {}
    import importlib.util
    if importlib.util.find_spec("litdata") is None:
        skipped["litdata"] = ("litdata is not installed: pip install --no-deps litdata==0.2.76 lightning-utilities "
                              "tifffile obstore (its torchvision requirement is not needed to write)")
    names = [a for a in arms if a not in skipped and (not only or a in only)]
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in names}
    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for a in order:
            out = Path(tempfile.mkdtemp(prefix=f"scale-out-{a}-", dir=CACHE))
            try:
                res = arms[a](out)
            finally:
                shutil.rmtree(out, ignore_errors=True)
            res["repeat"] = r
            runs[a].append(res)
            print(f"[scale_out] repeat {r + 1}/{repeats} {a}: {res['seconds']:.1f} s", flush=True)
    ray.shutdown()
    cluster.shutdown()
    return {"mode": mode, "repeats": repeats, "images": stats(folder), "text": {
        "corpus": str(corpus), "bytes": corpus.stat().st_size, "tokenizer": str(tokenizer)},
        "cluster": {"head_cpus": 0, "worker_nodes": 2, "cpus_per_node": 1, "object_store_mib": 300,
                    "started_s": round(started_s, 1), "network": "a namespace holding only loopback",
                    "auth": "RAY_AUTH_MODE=token"},
        "shard_samples": SHARD_SAMPLES, "runs": runs, "skipped": skipped}


# ------------------------------------------------------------------ summary, goals and the model

def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def summarise(d: dict[str, Any]) -> dict[str, Any]:
    runs = d["runs"]
    per = {a: {"median_s": _med([x["seconds"] for x in rs]), "range_s": [min(x["seconds"] for x in rs),
                                                                          max(x["seconds"] for x in rs)],
               "n": len(rs)} for a, rs in runs.items() if rs}
    for a, s in per.items():
        n = runs[a][0].get("samples")
        if n:
            s["images_per_s"] = n / s["median_s"]
        if "bytes" in runs[a][0] and a.startswith("text"):
            s["mb_per_s"] = runs[a][0]["bytes"] / MIB / s["median_s"]

    def ratio(num: str, den: str) -> dict[str, Any] | None:
        """median over repeats of num/den (each repeat ran both), and its min-max."""
        if num not in runs or den not in runs:
            return None
        rs = [a["seconds"] / b["seconds"] for a, b in zip(runs[num], runs[den])]
        return {"median": _med(rs), "range": [min(rs), max(rs)]}
    goals = {}
    if (o := ratio("ray-2", "pool")):
        goals["ray_overhead"] = {**o, "value": o["median"] - 1, "goal": f"<= {GOALS['ray_overhead_max']:.0%}",
                                 "met": o["median"] - 1 <= GOALS["ray_overhead_max"]}
    if (s := ratio("ray-1", "ray-2")):
        goals["two_nodes"] = {**s, "value": s["median"], "goal": f">= {GOALS['two_nodes_min']}x",
                              "met": s["median"] >= GOALS["two_nodes_min"]}
    for peer in ("litdata", "ray-data"):
        if (p := ratio(peer, "pool")):
            goals[f"vs_{peer}"] = {**p, "value": p["median"], "goal": f">= {GOALS['vs_peer_min']}x",
                                   "met": p["median"] >= GOALS["vs_peer_min"]}
    if (t := ratio("text-ray-2", "text-local")):
        goals["text_ray_overhead"] = {**t, "value": t["median"] - 1, "goal": "reported (no goal set)", "met": None}
    if (t := ratio("text-ray-1", "text-ray-2")):
        goals["text_two_nodes"] = {**t, "value": t["median"], "goal": "reported (no goal set)", "met": None}
    model = _model(runs)
    if model:
        e32 = model["nodes"]["32"]["efficiency"]
        goals["efficiency_32"] = {"value": e32, "goal": f">= {GOALS['efficiency_32_min']}x linear",
                                  "met": e32 >= GOALS["efficiency_32_min"]}
    return {"arms": per, "goals": goals, "model": model}


def _model(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any] | None:
    """``T(n) = F + ceil(S / n) * s + ceil(P / n) * c`` from the 1-node runs (median), checked
    against 2 nodes: F the head's own work (listing and fingerprinting the source, planning,
    waiting for the .beton, the merge and the manifest), S scan parts of s seconds and P shard
    parts of c seconds, both spread over the nodes."""
    one, two = runs.get("ray-1"), runs.get("ray-2")
    if not one or not two:
        return None
    parts, scans = one[0]["parts"], one[0].get("scan_parts") or 0
    scan_s = [r.get("scan_s") or 0.0 for r in one]
    f = _med([r["seconds"] - r["map_s"] - sc for r, sc in zip(one, scan_s)])
    c = _med([r["map_s"] / r["parts"] for r in one])
    s = _med([sc / scans for sc in scan_s]) if scans else 0.0

    def t(n: int) -> float:
        return f + math.ceil(scans / n) * s + math.ceil(parts / n) * c
    t1 = t(1)
    measured2 = _med([r["seconds"] for r in two])
    out = {"parts": parts, "scan_parts": scans, "fixed_s": f, "per_part_s": c, "per_scan_part_s": s, "t1_s": t1,
           "check_2_nodes": {"predicted_s": t(2), "measured_s": measured2, "error": t(2) / measured2 - 1},
           "fixed_share_1": f / t1, "nodes": {}}
    for n in (1, 2, 8, 32, 128):
        out["nodes"][str(n)] = {"seconds": t(n), "efficiency": t1 / (n * t(n)),
                                "fixed_share": f / t(n), "parts_per_node": math.ceil(parts / n)}
    spread32 = math.ceil(scans / 32) * s + math.ceil(parts / 32) * c
    if f > spread32:
        first = ("the head's own work (F: listing and fingerprinting the source, planning, waiting for the .beton, "
                 "the merge and the manifest)")
    else:
        first = f"too few parts ({scans} scan, {parts} shard) for 32 nodes"
    out["breaks_first"] = first
    return out


def results_section(d: dict[str, Any], name: str = "scale_out.json") -> list[str]:
    s = d["summary"]
    lines = [f"The data stages past one machine ({d['mode']} run, `benchmarks/scale_out.py`): a real Ray cluster "
             "on this host (a 0-CPU head and two 1-CPU worker nodes in a loopback-only namespace, token "
             f"authentication), {d['images']['n']:,} ImageNet-like JPEGs (mean {d['images']['mean_bytes'] / 1e3:.0f} KB) "
             f"and a {d['text']['bytes'] / MIB:.0f} MiB text corpus; median (min–max) of {d['repeats']} interleaved "
             "repeats; Sluice writes tar + DALI index + `.beton`, LitData its chunks, Ray Data tar only.", "",
             "| arm | median s (min–max) | images/s or MiB/s |", "|---|---|---|"]
    for a, x in s["arms"].items():
        speed = f"{x['images_per_s']:,.0f} images/s" if "images_per_s" in x else \
            (f"{x['mb_per_s']:.1f} MiB/s" if "mb_per_s" in x else "")
        lines.append(f"| {a} | {x['median_s']:.1f} ({x['range_s'][0]:.1f}–{x['range_s'][1]:.1f}) | {speed} |")
    lines += ["", "| goal | measured: median (min–max) | goal | met |", "|---|---|---|---|"]
    labels = {"ray_overhead": "Ray (2 nodes) over the pool, same cores", "two_nodes": "1 → 2 worker nodes",
              "vs_litdata": "LitData's time / Sluice's", "vs_ray-data": "Ray Data's time / Sluice's",
              "text_ray_overhead": "text: Ray (2 nodes) over this machine", "text_two_nodes": "text: 1 → 2 nodes",
              "efficiency_32": "model: throughput at 32 nodes / linear"}
    for k, g in s["goals"].items():
        over = k.endswith("overhead")
        rng = (f" ({g['range'][0] - over:+.0%}–{g['range'][1] - over:+.0%})" if over else
               f" ({g['range'][0]:.2f}–{g['range'][1]:.2f}x)") if g.get("range") else ""
        v = f"{g['value']:+.1%}" if over else f"{g['value']:.2f}x"
        met = "—" if g["met"] is None else ("met" if g["met"] else "**missed**")
        lines.append(f"| {labels.get(k, k)} | {v}{rng} | {g['goal']} | {met} |")
    mdl = s.get("model")
    if mdl:
        chk = mdl["check_2_nodes"]
        scan = f"s = {mdl['per_scan_part_s']:.2f} s a scan part, S = {mdl['scan_parts']} scan parts, " \
            if mdl.get("scan_parts") else ""
        lines += ["", f"The model, from the 1-node runs: F = {mdl['fixed_s']:.1f} s on the head, {scan}"
                  f"c = {mdl['per_part_s']:.2f} s a shard part, P = {mdl['parts']} shard parts; it predicts "
                  f"{chk['predicted_s']:.1f} s at 2 nodes, measured {chk['measured_s']:.1f} s "
                  f"({chk['error']:+.0%}).", "", "| nodes | predicted s | efficiency | head's share |",
                  "|---|---|---|---|"]
        for n, x in sorted(mdl["nodes"].items(), key=lambda kv: int(kv[0])):
            lines.append(f"| {n} | {x['seconds']:.1f} | {x['efficiency']:.2f} | {x['fixed_share']:.0%} |")
        lines += ["", f"What breaks it first: {mdl['breaks_first']}."]
    if d.get("skipped"):
        lines += ["", "Not run: " + "; ".join(f"{k} ({v})" for k, v in d["skipped"].items()) + "."]
    return lines + ["", provenance(d, name)]


# ------------------------------------------------------------------ entry

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"{MODES['quick']['images']:,} images, "
                   f"{MODES['quick']['text_mb']} MiB of text (~5 min)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--arms", default=None, help="comma-separated arms to run (default: all)")
    p.add_argument("--out", default=None, help="results name (default: scale_out or scale_out_quick)")
    p.add_argument("--images", type=int, default=None, help="images instead of the mode's (a smoke run)")
    p.add_argument("--text-mb", type=int, default=None, help="MiB of text instead of the mode's (a smoke run)")
    args = p.parse_args(argv)
    mode = "quick" if args.quick else "full"
    if os.environ.get(INSIDE) != "1":
        return rerun_in_loopback_namespace("benchmarks.scale_out", argv if argv is not None else sys.argv[1:],
                                           INSIDE, "to keep Ray on loopback")
    provenance_ = describe_run("benchmarks.scale_out", argv)
    sizes = {k: v for k, v in (("images", args.images), ("text_mb", args.text_mb)) if v is not None}
    d = run(mode, args.repeats or MODES[mode]["repeats"], set(args.arms.split(",")) if args.arms else None, sizes)
    if sizes:
        d["mode"] = f"{mode} (resized: {sizes})"
    d = {**provenance_, **d, "goals_wanted": GOALS}
    d["summary"] = summarise(d)
    name = args.out or ("scale_out" if mode == "full" else "scale_out_quick")
    path = write_result(name, d)
    rows = [{"arm": a, "median_s": x["median_s"], "min_s": x["range_s"][0], "max_s": x["range_s"][1]}
            for a, x in d["summary"]["arms"].items()]
    print(table(rows, ["arm", "median_s", "min_s", "max_s"]))
    print("\n".join(results_section(d, path.name)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
