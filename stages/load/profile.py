"""Where the loading time goes, beside the loader's pipeline: its per-stage seconds gathered
into one profile, the verdict on which resource bounds it, and the report a person reads.

Kept apart from the pipeline so that code holding only a profile (the training summary, the
nightly report, the benchmarks) can judge it without a loader.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only
    from sluice.stages.load.backends import Backend, Timings
    from sluice.storage.cache import ArtifactCache

# Each profiled stage is work of one kind: storage reads, decoding, or our own compute.
STAGE_KINDS = {"read": "storage", "decode": "decode", "decode+augment": "decode",
               "read+decode": "storage+decode", "augment": "compute", "transfer": "compute",
               "gather": "compute", "check": "compute",
               "upload": "compute"}  # upload: a split copied to the GPU once, to stay there


def gather_profile(backend: Backend | None, timings: Timings, samples: int, wall: float) -> dict[str, float]:
    """One profile: the backend's stage seconds, then the loader's own (``transfer``,
    ``augment``, ``wait``), the damaged samples skipped where the backend has a guard,
    ``samples`` seen and ``wall`` (seconds inside iteration)."""
    out = dict(backend.timings) if backend is not None else {}
    out.update(timings)
    guard = getattr(backend, "guard", None)
    out.update({"corrupt_skipped": float(guard.skipped)} if guard else {})  # on_corrupt: skip
    out["samples"] = float(samples)
    out["wall"] = wall
    return out


def bottleneck(profile: dict[str, float]) -> dict[str, Any]:
    """The verdict from a loader profile: the kind of work (storage reads, decode, or compute —
    augmentation, transfer, gathers) that took the most seconds, its share of the loader's work,
    and the share of the caller's time spent waiting for data (low: the loader keeps up, and
    the caller's own work sets the pace)."""
    kinds: dict[str, float] = {}
    for k, v in profile.items():
        if k in STAGE_KINDS:
            kinds[STAGE_KINDS[k]] = kinds.get(STAGE_KINDS[k], 0.0) + v
    total = sum(kinds.values())
    wall, wait = profile.get("wall", 0.0), profile.get("wait", 0.0)
    wait_share = wait / wall if wall > 0 else None
    if total <= 0:
        return {"verdict": "unknown", "shares": {}, "wait_share": wait_share,
                "summary": "unknown: nothing loaded yet"}
    shares = {k: v / total for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}
    top = next(iter(shares))
    verdict = f"{top}-bound"
    others = ", ".join(f"{k} {100 * v:.0f}%" for k, v in shares.items() if k != top)
    summary = f"{verdict}: {top} {100 * shares[top]:.0f}% of the loader's work" + (f" ({others})" if others else "")
    if wait_share is not None:
        summary += f"; the caller waited for data {100 * wait_share:.0f}% of its time"
        if wait_share < 0.1:
            summary += " (the loader keeps up: the caller's own work sets the pace)"
    return {"verdict": verdict, "shares": shares, "wait_share": wait_share, "summary": summary}


def profile_report(profile: dict[str, float], verdict: dict[str, Any], backend_name: str,
                   backend_reason: str, cache: ArtifactCache | None) -> str:
    """The profile as lines a person reads: the backend and why, seconds and µs/sample per
    stage (largest first), the remote cache's counts, and the verdict's summary."""
    p = dict(profile)
    n, wall, bad = p.pop("samples", 0), p.pop("wall", 0.0), int(p.pop("corrupt_skipped", 0))
    lines = [f"loader profile ({backend_name}, {int(n)} samples, {wall:.1f} s):",
             f"  backend      {backend_reason}"] + ([f"  damaged      {bad} samples skipped"] if bad else [])
    for k, v in sorted(p.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {k:<14} {v:8.3f} s" + (f"  {v / n * 1e6:8.1f} µs/sample" if n else ""))
    if cache is not None:
        st = cache.stats
        lines.append(f"  cache        {st['fetched']} files fetched ({st['fetched_bytes'] / 1e6:.1f} MB, "
                     f"{st['retried']} retried), {st['hits']} hits, {st['evicted']} evicted "
                     "(by this process: worker processes count their own)")
    lines.append(f"  verdict      {verdict['summary']}")
    return "\n".join(lines)
