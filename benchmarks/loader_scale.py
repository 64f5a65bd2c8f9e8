"""The loader beyond memory: a dataset larger than the memory limit, read under a storage throttle.

Data: JPEG crops of scikit-learn's two photos (``benchmarks.photo_crops.make_photo_folder``: cut
at 96..256 px, variable sizes), sharded by our own stage at 256×256 (tar shards, FFCV ``.beton``
and DALI indices). Full: 3.3 GB of JPEGs (~216,000 samples); ``--quick``: 0.16 GB (~11,000).

Each run reads one (backend, sampler) arm in a fresh child process (batch 256, two decode workers,
RRC to 128 + flip + normalise, float32 NCHW out) placed in cgroups; the clock starts after
``WARMUP`` batches (worker start, FFCV's JIT) and runs for ``FULL_BATCHES`` batches (25,600 samples
drawn from the whole dataset: a whole 216,000-sample epoch takes ~10 min an arm here, so 3 repeats
of every arm would take hours), under one of:

* ``throttled``: a memory cgroup limit (full: a third of the JPEG bytes; quick: see below) and a
  blkio read throttle (``--throttle-mbps``, 200 MB/s) on the device holding the data; the
  artifact's files are dropped from the page cache first (``posix_fadvise(DONTNEED)``), so every
  byte comes from the device through the throttle;
* ``cold``: the same limit and cold cache, no throttle;
* ``cached``: the files read into the page cache first, no limit, no throttle — this sets the
  **decode-bound limit** (the best arm's median samples/s here: decoding and our own work only).

The **storage-bound limit** of an arm is the throttle ÷ the mean bytes per sample it reads (the
tar shards for webdataset and DALI, the ``.beton`` for FFCV). Goal (fixed before the run): the
best throttled arm's median ≥ 0.8 × min(storage-bound, decode-bound limit), and no run is killed
by the OOM killer or exceeds the limit (the cgroup's peak usage is recorded). ``memory`` runs only
where the decoded split fits the host (``cached``: no limit; not the full dataset, 42 GB decoded);
under the limit ``auto``'s choice and reason are recorded instead. The full run takes the
``throttled`` and ``cached`` conditions (``--conditions`` adds ``cold``).

Quick mode's memory limit (640 MiB) is below a third of the *decoded* split (2.2 GB, what the
``memory`` backend would need) but above its JPEG bytes: a Python process with torch, FFCV and
DALI loaded needs ~400 MB, so no smaller limit is meaningful for a 0.16 GB dataset. Quick mode
runs without ffcv/shard_block and times 12 batches: a check that everything runs, written to
``loader_scale_quick.json``, not the measurement.

Arms run interleaved (round-robin over arms within each repeat), ``--repeats`` (3) times; the
table reports the median and min-max. Needs root and cgroup v1 (memory, blkio); hold the shared
lock: ``flock /tmp/sluice-bench.lock python -m benchmarks.loader_scale [--quick]``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import table, write_result
from benchmarks.photo_crops import CACHE, make_photo_folder
from benchmarks.results_page import provenance

SIDE = 256  # stored size of the large dataset's JPEGs (sources are 96..256 px, variable)
SOURCE_BYTES = {"full": 3.3e9, "quick": 0.16e9}  # JPEG bytes of the photo folder (≈ the tar shards)
LIMIT = {"full": int(3.3e9 / 3), "quick": 640 << 20}
SHARD_BYTES = 32_000_000
ARMS = [("ffcv", "shuffle"), ("ffcv", "shard_block"), ("webdataset", "shuffle"),
        ("webdataset", "shard_block"), ("dali", "shuffle")]
CONDITIONS = ("throttled", "cold", "cached")
RUN_TIMEOUT_S = 150  # a run still going then is cut short; its pace so far is recorded
QUICK_BATCHES = 12
FULL_BATCHES = 100
WARMUP = 2  # batches read before the clock starts
MEMCG = Path("/sys/fs/cgroup/memory")
BLKCG = Path("/sys/fs/cgroup/blkio")


def large_artifact(mode: str, log=print) -> str:
    """The large dataset: a variable-size photo folder, sharded at SIDE×SIDE (all formats)."""
    from sluice.stages.data.config import IngestConfig, ShardConfig
    from sluice.stages.data.shard import shard_dataset
    from sluice.storage.artifact import open_artifact
    out = CACHE / "artifacts" / f"large-{mode}"
    if (out / "LATEST").exists():
        try:
            return open_artifact(out).root
        except Exception:  # noqa: BLE001 - rebuilt below
            pass
    t = time.perf_counter()
    folder = make_photo_folder(SOURCE_BYTES[mode], side=SIDE)
    log(f"photo folder {folder} in {time.perf_counter() - t:.0f} s")
    t = time.perf_counter()
    s = shard_dataset(IngestConfig(source=str(folder), kind="folder", holdout_fraction=0.0, val_fraction=0.0,
                                   test_fraction=0.0),
                      out, ShardConfig(encoding="jpg", jpeg_quality=90, shard_bytes=SHARD_BYTES))
    log(s.format())
    log(f"sharded in {time.perf_counter() - t:.0f} s")
    return s.root


# ---------------------------------------------------------------------------- the child

CHILD = """
import json, sys, time
from sluice.stages.load import AugmentSpec, Loader, SamplerConfig
from sluice.stages.load.augment import Normalize, Flip, RandomResizedCrop
from sluice.stages.load.choice import resolve_backend
root, backend, sampler, seed, most, warmup = sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7])
out = {}
if backend != "memory":
    L0 = Loader(root, workers=2, verify="none")
    out["auto"] = L0.backend_reason
L = Loader(root, split="train", batch_size=256, backend=backend, workers=2, verify="none", seed=seed,
           sampler=SamplerConfig(kind=sampler, seed=seed, window=4),
           augment=AugmentSpec(ops=[RandomResizedCrop(size=128), Flip(),
                                    Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])]))
L.backend()
t, n = time.perf_counter(), 0
for b, (x, y, i) in enumerate(L):
    assert x.shape[1:] == (3, 128, 128), x.shape
    if b + 1 == warmup:
        t = time.perf_counter()
    elif b >= warmup:
        n += len(y)
        print(f"PROGRESS {n} {time.perf_counter() - t}", flush=True)
    if b + 1 == warmup + most:
        break
wall = time.perf_counter() - t
out.update(samples=n, wall_s=wall, samples_per_s=n / wall, profile=L.profile(), verdict=L.bottleneck()["verdict"])
print("RESULT " + json.dumps(out))
"""


def _device_of(path: str) -> str:
    st = os.stat(path)
    return f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def own_memory_cgroup() -> Path | None:
    """This process's cgroup v1 memory directory (children made here nest under its limit)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, ctl, p = line.split(":", 2)
        if "memory" in ctl.split(","):
            d = MEMCG / p.lstrip("/")
            return d if d.is_dir() else None
    return None


def remove_cgroup(cg: Path) -> None:
    """Move any process left in ``cg`` to its parent, then remove it."""
    for pid in (cg / "cgroup.procs").read_text().split():
        try:
            (cg.parent / "cgroup.procs").write_text(pid)
        except OSError:
            pass
    cg.rmdir()


def _files(root: str) -> list[Path]:
    return [p for p in Path(root).rglob("*") if p.is_file()]


def drop_cache(root: str) -> None:
    """Evict the artifact's pages from the page cache (this dataset only, not the host's)."""
    os.sync()
    for p in _files(root):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(root: str) -> None:
    for p in _files(root):
        with open(p, "rb") as f:
            while f.read(16 << 20):
                pass


def run_one(root: str, backend: str, sampler: str, cond: str, limit: int, throttle: int, seed: int,
            max_batches: int = 0) -> dict:
    """One epoch in a child process placed in fresh memory and blkio cgroups (removed afterwards)."""
    name = f"sluice-scale-{uuid.uuid4().hex[:8]}"
    mem, blk = own_memory_cgroup() / name, BLKCG / name
    mem.mkdir()
    blk.mkdir()
    try:
        if cond != "cached":
            (mem / "memory.limit_in_bytes").write_text(str(limit))
        if cond == "throttled":
            (blk / "blkio.throttle.read_bps_device").write_text(f"{_device_of(root)} {throttle}")
        (drop_cache if cond != "cached" else warm_cache)(root)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = ["sh", "-c", f'echo $$ > {mem}/cgroup.procs && echo $$ > {blk}/cgroup.procs && exec "$0" -c "$1" "$2" "$3" "$4" "$5" "$6" "$7"',
               sys.executable, CHILD, root, backend, sampler, str(seed), str(max_batches), str(WARMUP)]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT_S)
            rc, stdout, stderr = r.returncode, r.stdout, r.stderr
        except subprocess.TimeoutExpired as e:  # the child is killed; keep its pace so far
            rc, stdout, stderr = None, _text(e.stdout), _text(e.stderr)
        oom = dict(line.split() for line in (mem / "memory.oom_control").read_text().splitlines())
        row = {"backend": backend, "sampler": sampler, "condition": cond, "seed": seed, "rc": rc,
               "peak_bytes": int((mem / "memory.max_usage_in_bytes").read_text()),
               "oom_kills": int(oom.get("oom_kill", 0)),
               "read_bytes": _blk_read(blk)}
        if rc == 0 and "RESULT " in stdout:
            row.update(json.loads(stdout.split("RESULT ", 1)[1]))
        elif rc is None:
            done = [line.split() for line in stdout.splitlines() if line.startswith("PROGRESS ")]
            n, secs = (int(done[-1][1]), float(done[-1][2])) if done else (0, float(RUN_TIMEOUT_S))
            row.update(timed_out=True, samples=n, samples_per_s_partial=n / secs if secs else 0.0,
                       error=f"cut short after {RUN_TIMEOUT_S} s with {n} of {max_batches * 256} samples timed")
        else:
            row["error"] = stderr[-1500:]
        return row
    finally:
        remove_cgroup(mem)
        remove_cgroup(blk)


def _text(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def _blk_read(blk: Path) -> int:
    total = 0
    for line in (blk / "blkio.throttle.io_service_bytes").read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] == "Read":
            total += int(parts[2])
    return total


def bytes_per_sample(root: str) -> dict[str, float]:
    from sluice.storage.artifact import open_artifact
    rec = open_artifact(root).manifest.splits["train"]
    tar = sum(sh.tar.bytes for sh in rec.shards) / rec.count
    beton = rec.ffcv.bytes / rec.count if rec.ffcv else None
    return {"webdataset": tar, "dali": tar, "ffcv": beton, "memory": tar}


def _med(v: list[float]) -> dict:
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)} if v else {}


def summarise(rows: list[dict], bps: dict, throttle: int, limit: int) -> dict:
    arms: dict[str, dict] = {}
    for r in rows:
        key = f"{r['backend']}/{r['sampler']}/{r['condition']}"
        a = arms.setdefault(key, {"backend": r["backend"], "sampler": r["sampler"], "condition": r["condition"],
                                  "sps": [], "peak": [], "oom": 0, "failed": 0, "timed_out": 0})
        if "samples_per_s" in r:
            a["sps"].append(r["samples_per_s"])
            a["verdict"] = r.get("verdict")
        elif r.get("timed_out"):  # its pace until cut short (an upper bound on a run that stalls)
            a["sps"].append(r["samples_per_s_partial"])
            a["timed_out"] += 1
        else:
            a["failed"] += 1
        a["peak"].append(r["peak_bytes"])
        a["oom"] += r["oom_kills"]
    out = {}
    for k, a in arms.items():
        storage = throttle / bps[a["backend"]] if a["condition"] == "throttled" and bps.get(a["backend"]) else None
        out[k] = {**{x: a[x] for x in ("backend", "sampler", "condition", "oom", "failed", "timed_out")},
                  "samples_per_s": _med(a["sps"]), "peak_bytes_max": max(a["peak"]),
                  "within_limit": a["condition"] == "cached" or max(a["peak"]) <= limit,
                  "storage_bound_limit": storage, "verdict": a.get("verdict")}
    # the memory backend decodes the split before its epoch: its pace is no decode limit
    cached = [v["samples_per_s"]["median"] for v in out.values()
              if v["condition"] == "cached" and v["samples_per_s"] and v["backend"] != "memory" and not v["timed_out"]]
    decode_limit = max(cached) if cached else None
    thr = {k: v for k, v in out.items()
           if v["condition"] == "throttled" and v["samples_per_s"] and not v["timed_out"]}
    best = max(thr, key=lambda k: thr[k]["samples_per_s"]["median"]) if thr else None
    goal = None
    if best and decode_limit:
        bound = min(thr[best]["storage_bound_limit"] or float("inf"), decode_limit)
        ratio = thr[best]["samples_per_s"]["median"] / bound
        goal = {"best_throttled_arm": best, "samples_per_s": thr[best]["samples_per_s"]["median"],
                "storage_bound_limit": thr[best]["storage_bound_limit"], "decode_bound_limit": decode_limit,
                "lower_limit": bound, "ratio": ratio, "target": 0.8, "met": ratio >= 0.8}
    ok_mem = all(v["oom"] == 0 and v["within_limit"] and not v["failed"] for v in out.values())
    # (a run cut short is slow, not over the limit: its peak is checked like any other)
    return {"arms": out, "decode_bound_limit": decode_limit, "goal": goal, "memory_goal_met": ok_mem}


# ------------------------------------------------------------------ its section of docs/results.md

def results_section(d: dict[str, Any], name: str = "loader_scale.json") -> list[str]:
    ds, g = d["dataset"], d.get("goal") or {}
    lines = [f"#### The loader beyond memory ({ds['tar_bytes'] / 1e9:.1f} GB of JPEG shards, "
             f"{ds['samples']:,} samples, under a {d['memory_limit_bytes'] / 2**20:,.0f} MiB memory cgroup)", "",
             f"Each run: {d.get('batches_per_run')} batches of 256 after {d.get('warmup_batches', 0)} of warm-up, "
             "RRC to 128 + flip + normalise, 2 decode workers, in a fresh child process. `throttled`: the memory "
             f"limit, a {d['throttle_bytes_per_s'] / 1e6:,.0f} MB/s blkio read throttle and a cold page cache; "
             "`cached`: the files in the page cache, no limit (this sets the decode-bound limit). "
             "Median of the repeats, min–max beside it.", "",
             "| arm | samples/s: median (min–max) | storage-bound limit | peak memory | OOM kills | verdict |",
             "|---|---|---|---|---|---|"]
    for arm, a in d["arms"].items():
        sp = a["samples_per_s"]
        cut = (f", cut short after {a['timed_out']} run(s) of {d.get('run_timeout_s', '?')} s: pace so far"
               if a.get("timed_out") else "")
        rng = f" ({sp['min']:,.0f}–{sp['max']:,.0f})" if sp.get("n", 0) > 1 else ""
        val = f"{sp['median']:,.0f}{rng}{cut}" if sp else f"no run finished ({a['failed']} failed)"
        lim = "—" if a["storage_bound_limit"] is None else f"{a['storage_bound_limit']:,.0f}"
        over = "" if a["within_limit"] else " (over the limit)"
        lines.append(f"| {arm} | {val} | {lim} | {a['peak_bytes_max'] / 2**20:,.0f} MiB{over} | {a['oom']} | "
                     f"{a.get('verdict') or '—'} |")
    if g:
        lines += ["", f"Goal: the best throttled arm ({g['best_throttled_arm']}, {g['samples_per_s']:,.0f} samples/s) "
                      f"at ≥ 0.8× the lower of its storage-bound ({g['storage_bound_limit']:,.0f}) and the "
                      f"decode-bound ({g['decode_bound_limit']:,.0f}, the best cached arm) limits: "
                      f"{g['ratio']:.3f}×, **{'met' if g['met'] else 'missed'}**. No run OOM-killed or over the "
                      f"memory limit: **{'met' if d['memory_goal_met'] else 'missed'}**."]
    if d.get("auto_under_limit"):
        lines += ["", f"`auto` under the limit: {d['auto_under_limit']}"]
    if d.get("mode") == "quick":
        lines += ["", "Quick mode: a smaller dataset and 12 batches a run: a check that everything runs, "
                      "not the measurement the goals ask for."]
    lines += ["", provenance(d, name)]
    return lines


def main(argv: list[str] | None = None) -> dict:
    from benchmarks.hostinfo import describe_run
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--throttle-mbps", type=float, default=200)
    ap.add_argument("--conditions", nargs="+", choices=CONDITIONS, default=["throttled", "cached"])
    ap.add_argument("--prepare-only", action="store_true", help="make the dataset, then stop")
    ap.add_argument("--smoke", action="store_true", help="a few batches per arm, one repeat, no results file")
    a = ap.parse_args(argv)
    mode = "quick" if a.quick else "full"
    prov = describe_run("benchmarks.loader_scale", argv)
    if os.geteuid() != 0 or own_memory_cgroup() is None or not (BLKCG / "blkio.throttle.read_bps_device").exists():
        raise SystemExit("needs root and cgroup v1 memory and blkio hierarchies")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` removes the run's cgroups
    for stale in [*own_memory_cgroup().glob("sluice-scale-*"), *BLKCG.glob("sluice-scale-*")]:
        remove_cgroup(stale)  # left by a run killed with SIGKILL
    root = large_artifact(mode)
    if a.prepare_only:
        return {}
    from sluice.stages.load.budget import memory_budget
    from sluice.storage.artifact import open_artifact
    m = open_artifact(root).manifest
    n = m.splits["train"].count
    jpeg_bytes = sum(sh.tar.bytes for sh in m.splits["train"].shards)
    limit, throttle = LIMIT[mode], int(a.throttle_mbps * 1e6)
    bps = bytes_per_sample(root)
    print(f"dataset {root}: {n} samples, {jpeg_bytes / 1e9:.2f} GB of tar shards, decoded "
          f"{n * SIDE * SIDE * 3 / 1e9:.2f} GB; memory limit {limit / 2**20:.0f} MiB, throttle {a.throttle_mbps:g} MB/s")
    arms = [(b, s, c) for c in a.conditions for b, s in ARMS if not a.quick or (b, s) != ("ffcv", "shard_block")]
    if n * SIDE * SIDE * 3 < memory_budget().host_available / 2:  # the decoded split fits the host
        arms.append(("memory", "shuffle", "cached"))
    most = 3 if a.smoke else QUICK_BATCHES if a.quick else FULL_BATCHES
    rows, stalled = [], set()
    for rep in range(1 if a.smoke else a.repeats):
        for b, s, c in arms:
            if (b, s, c) in stalled:  # cut short once: not again (each costs RUN_TIMEOUT_S)
                continue
            t = time.perf_counter()
            r = run_one(root, b, s, c, limit, throttle, seed=rep, max_batches=most)
            rows.append(r)
            if r.get("timed_out"):
                stalled.add((b, s, c))
            print(f"  [{rep}] {b:<10} {s:<11} {c:<9} {r.get('samples_per_s', r.get('samples_per_s_partial', float('nan'))):8.0f} samples/s  "
                  f"peak {r['peak_bytes'] / 2**20:6.0f} MiB  oom {r['oom_kills']}  "
                  f"read {r['read_bytes'] / 1e6:7.0f} MB  ({time.perf_counter() - t:.0f} s)"
                  + (f"  ERROR {r['error'][-300:]}" if "error" in r else ""), flush=True)
    s = summarise(rows, bps, throttle, limit)
    trows = [{"arm": k, "samples/s": v["samples_per_s"].get("median"),
              "min": v["samples_per_s"].get("min"), "max": v["samples_per_s"].get("max"),
              "storage limit": v["storage_bound_limit"], "peak MiB": v["peak_bytes_max"] / 2**20,
              "oom": v["oom"], "verdict": v["verdict"]} for k, v in s["arms"].items()]
    print(table(trows, ["arm", "samples/s", "min", "max", "storage limit", "peak MiB", "oom", "verdict"]))
    print(f"decode-bound limit (best cached arm): {s['decode_bound_limit']}")
    print(f"goal: {s['goal']}\nmemory goal met: {s['memory_goal_met']}")
    payload = {**prov, "mode": mode, "batches_per_run": most, "warmup_batches": WARMUP,
               "run_timeout_s": RUN_TIMEOUT_S, "seeds": list(range(a.repeats)), "dataset": {
        "root": root, "samples": n, "tar_bytes": jpeg_bytes, "decoded_bytes": n * SIDE * SIDE * 3,
        "bytes_per_sample": bps}, "memory_limit_bytes": limit, "throttle_bytes_per_s": throttle,
        "auto_under_limit": next((r.get("auto") for r in rows if r.get("auto") and r["condition"] != "cached"), None),
        **s, "runs": rows}
    if a.smoke:
        return payload
    path = write_result("loader_scale" if mode == "full" else "loader_scale_quick", payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
