"""How much memory the loader may use: the one place that decides it.

A container's memory limit is a cgroup's, not the host's: a process limited to 2 GiB on a 256 GiB
host is killed by the OOM killer long before the host runs short. So the budget is the tighter
of two headrooms, each already net of what this process (and its neighbours) hold:

* the cgroup's: its limit minus its working set (usage less the inactive file cache the kernel
  reclaims first), for the process's own cgroup and every ancestor that sets a limit — cgroup v2
  (``memory.max``/``memory.current``) or v1 (``memory.limit_in_bytes``/``memory.usage_in_bytes``);
* the host's: ``MemAvailable`` from ``/proc/meminfo`` (free pages plus reclaimable page cache).

The loader may use ``fraction`` of that headroom (half by default: batches in flight, the model
and the page cache need the rest). ``MemoryBudget.explain()`` says where the number came from;
the loader's ``auto`` backend choice quotes it in ``profile_report()``.

A GPU has a budget of its own (``device_placement``): the memory backend keeps a decoded split
on the device when it fits ``fraction`` of the device's free memory (``torch.cuda.mem_get_info``),
or ``loader.device_memory_budget_bytes``; the model and its activations need the rest.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a huge page-rounded number
DEFAULT_FRACTION = 0.5


@dataclass(frozen=True)
class CgroupLimit:
    """The tightest memory limit among the process's cgroup and its ancestors."""
    path: str  # the cgroup directory that sets it
    version: int  # 1 or 2
    limit: int
    usage: int
    reclaimable: int  # inactive file cache the kernel drops before it reaches for the OOM killer

    @property
    def headroom(self) -> int:
        return max(0, self.limit - max(0, self.usage - self.reclaimable))


@dataclass(frozen=True)
class MemoryBudget:
    bytes: int  # what the loader may use
    headroom: int  # the tighter of the cgroup's and the host's
    host_available: int | None
    cgroup: CgroupLimit | None
    process_rss: int | None
    fraction: float

    def explain(self) -> str:
        parts = []
        if self.cgroup is not None:
            c = self.cgroup
            parts.append(f"cgroup v{c.version} {c.path}: limit {_gb(c.limit)}, working set "
                         f"{_gb(c.usage - c.reclaimable)}, headroom {_gb(c.headroom)}")
        else:
            parts.append("no cgroup memory limit")
        if self.host_available is not None:
            parts.append(f"host MemAvailable {_gb(self.host_available)}")
        if self.process_rss is not None:
            parts.append(f"this process holds {_gb(self.process_rss)}")
        return (f"memory budget {_gb(self.bytes)} = {self.fraction:g} × headroom {_gb(self.headroom)} "
                f"({'; '.join(parts)})")


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if abs(n) >= 1e8 else f"{n / 1e6:.0f} MB"


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: Path, keys: tuple[str, ...]) -> int:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    found = dict(line.split()[:2] for line in lines if len(line.split()) >= 2)
    for k in keys:
        if k in found:
            return int(found[k])
    return 0


def _mounts(mountinfo: str) -> dict[str, tuple[str, str]]:
    """{"v2": (mount root, mount point), "v1": (...)} for the memory controller's hierarchies."""
    out: dict[str, tuple[str, str]] = {}
    try:
        lines = Path(mountinfo).read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        pre, _, post = line.partition(" - ")
        f, p = pre.split(), post.split()
        if len(f) < 5 or len(p) < 3:
            continue
        if p[0] == "cgroup2":
            out.setdefault("v2", (f[3], f[4]))
        elif p[0] == "cgroup" and "memory" in p[2].split(","):
            out.setdefault("v1", (f[3], f[4]))
    return out


def _dirs(mount: tuple[str, str], path: str) -> list[Path]:
    """The cgroup's directory and its ancestors up to the mount point (innermost first)."""
    root, point = mount
    rel = path[len(root):] if root != "/" and path.startswith(root) else path
    d = Path(point) / rel.lstrip("/")
    if not d.is_dir():  # a cgroup namespace: the mount point is the process's own cgroup
        d = Path(point)
    out = [d]
    while d != Path(point) and d.parent != d:
        d = d.parent
        out.append(d)
    return out


def cgroup_limit(proc_cgroup: str = "/proc/self/cgroup",
                 mountinfo: str = "/proc/self/mountinfo") -> CgroupLimit | None:
    """The cgroup (v2 or v1) that leaves this process the least memory, or None without one."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    mounts = _mounts(mountinfo)
    best: CgroupLimit | None = None
    for line in lines:
        hid, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hid == "0" and controllers == "" and "v2" in mounts:
            version, dirs = 2, _dirs(mounts["v2"], path)
            files = ("memory.max", "memory.current", ("inactive_file",))
        elif "memory" in controllers.split(",") and "v1" in mounts:
            version, dirs = 1, _dirs(mounts["v1"], path)
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", ("total_inactive_file", "inactive_file"))
        else:
            continue
        for d in dirs:
            limit = _read_int(d / files[0])
            usage = _read_int(d / files[1])
            if limit is None or usage is None or limit >= UNLIMITED:
                continue
            c = CgroupLimit(str(d), version, limit, usage, _stat(d / "memory.stat", files[2]))
            if best is None or c.headroom < best.headroom:
                best = c
    return best


def host_available(meminfo: str = "/proc/meminfo") -> int | None:
    """``MemAvailable``: free memory plus what the kernel can reclaim without swapping."""
    kb = _stat(Path(meminfo), ("MemAvailable:",))
    if kb:
        return kb * 1024
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def process_rss() -> int | None:
    kb = _stat(Path("/proc/self/status"), ("VmRSS:",))
    return kb * 1024 if kb else None


def memory_budget(fraction: float = DEFAULT_FRACTION) -> MemoryBudget:
    """What the loader may hold: ``fraction`` of the tighter headroom (cgroup or host)."""
    cg = cgroup_limit()
    host = host_available()
    rooms = [r for r in (cg.headroom if cg else None, host) if r is not None]
    headroom = min(rooms) if rooms else 8 << 30
    return MemoryBudget(int(headroom * fraction), headroom, host, cg, process_rss(), fraction)


# ---- the device's budget: whether a decoded split may live on the GPU ----------------------

@dataclass(frozen=True)
class DevicePlacement:
    """Whether a split of ``need`` bytes stays on the device, and the budget that decided it."""
    on_device: bool
    need: int
    budget: int
    free: int | None  # the device's free memory when asked (None: not read, an override decided)
    fraction: float
    override: bool  # loader.device_memory_budget_bytes set the budget

    def explain(self) -> str:
        if self.override:
            source = f"loader.device_memory_budget_bytes {_gb(self.budget)}"
        elif self.free is None:
            source = "no free-memory reading from the device"
        else:
            source = f"device memory budget {_gb(self.budget)} = {self.fraction:g} × free {_gb(self.free)}"
        verdict = "within" if self.on_device else "more than"
        return f"the decoded split ({_gb(self.need)}) is {verdict} the {source}"


def device_placement(need: int, free: int | None, override: int | None = None,
                     fraction: float = DEFAULT_FRACTION) -> DevicePlacement:
    """Keep a decoded split of ``need`` bytes on the device when it fits ``fraction`` of the
    device's ``free`` bytes (the model, activations and batches in flight need the rest), or
    ``override`` where given. Takes free bytes, not a device, so it is decided the same way
    (and tested) anywhere."""
    if override is not None:
        budget = int(override)
    else:
        budget = int(free * fraction) if free is not None else 0
    return DevicePlacement(need <= budget, int(need), budget, free, fraction, override is not None)


def device_free_bytes(device) -> int | None:
    """Free memory on a CUDA ``device``: the driver's (``torch.cuda.mem_get_info``) plus what
    PyTorch's caching allocator holds unused (free to it, counted as used by the driver); None
    off CUDA."""
    import torch  # the host budget above needs no torch
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    with torch.cuda.device(device):
        free, _total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + max(0, cached))
