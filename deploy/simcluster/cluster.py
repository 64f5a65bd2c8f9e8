"""A simulated cluster on one Linux machine: network namespaces joined by a bridge, each node's
link shaped with ``tc`` (tbf for bandwidth, netem for latency and loss), each node's processes
pinned to cores with ``taskset``.

    with SimCluster(nodes=2, rate="100mbit") as c:     # delay="0.2ms" where netem exists
        c.nodes[0].run(["python", "-c", "print('hello from node 0')"])
        print(c.nodes[1].address)                      # 10.213.0.2

Layout (nothing of it is in the host's own network namespace, so traffic stays inside):

    slsim-<id>-n0 (10.213.0.1/24, eth0) ─┐
    slsim-<id>-n1 (10.213.0.2/24, eth0) ─┼─ slsim-<id>-sw: bridge br0 (no address)
    ...                                   ┘

Each node's ``eth0`` sends through ``netem delay D [loss L]`` then ``tbf rate R``; the switch
port towards the node (its receive side) is ``tbf rate R`` too. So a link is full duplex at R
each way; one way between two nodes costs D (the round trip 2·D).

Teardown kills the processes still inside the namespaces and deletes them (their veths, the
bridge and every qdisc go with them). It runs on ``down()``/``__exit__`` (also on Ctrl-C),
from a reaper process when the owner dies without cleaning up (``kill -9``, a crash), and for
clusters whose owner is gone at the next start (``clean_stale``). Needs root or CAP_NET_ADMIN:
``netadmin_missing()`` says why not, for tests to skip with. Delay and loss need the kernel's
netem qdisc, which some kernels leave out (``netem_missing()`` says so; rate shaping with tbf
still works there).

This file uses only the standard library so it can run as the reaper script.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

PREFIX = "slsim-"
STATE_DIR = Path(os.environ.get("SLUICE_SIMCLUSTER_STATE", "/run/sluice-simcluster"))
RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit)$")
DELAY = re.compile(r"^\d+(\.\d+)?(us|ms|s)$")
LOSS = re.compile(r"^\d+(\.\d+)?%$")
CMD_TIMEOUT_S = 20  # one ip/tc call
KILL_WAIT_S = 5.0  # per namespace, SIGTERM then SIGKILL


class SimClusterError(RuntimeError):
    """The cluster could not be built or torn down; says which command failed and why."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    if check and p.returncode != 0:
        raise SimClusterError(f"{' '.join(cmd)} failed: {p.stderr.strip() or p.stdout.strip()}")
    return p


def _tc(ns: str, *args: str) -> None:
    cmd = ["ip", "netns", "exec", ns, "tc", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    if p.returncode != 0:
        raise SimClusterError(f"{' '.join(cmd)} failed: {p.stderr.strip()}")


def rate_bits(rate: str) -> float:
    """``100mbit`` -> 1e8 (bits per second)."""
    m = RATE.match(rate)
    if not m:
        raise ValueError(f"rate must look like 100mbit, 1gbit or 10gbit, got {rate!r}")
    unit = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m.group(2)]
    return float(rate[: -len(m.group(2))]) * unit


def _has_cap_net_admin() -> bool:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) & (1 << 12))
    except OSError:
        pass
    return False


_PROBED: dict[str, Any] = {}


def netadmin_missing() -> str | None:
    """Why this process cannot build a simulated cluster (None when it can): not root and no
    CAP_NET_ADMIN, a missing tool, or namespaces refused by the kernel/container."""
    if not _PROBED:
        _probe()
    return _PROBED["reason"]


def netem_missing() -> str | None:
    """Why links cannot get latency or loss here (None when they can): netem is a kernel
    module (CONFIG_NET_SCH_NETEM) that some kernels, e.g. minimal VM kernels, leave out."""
    if not _PROBED:
        _probe()
    return _PROBED["reason"] or _PROBED["netem"]


def _probe() -> None:
    reason, netem = None, None
    if not sys.platform.startswith("linux"):
        reason = "network namespaces need Linux"
    elif os.geteuid() != 0 and not _has_cap_net_admin():
        reason = "needs root or CAP_NET_ADMIN (network namespaces, veth, tc)"
    else:
        missing = [t for t in ("ip", "tc", "taskset") if shutil.which(t) is None]
        if missing:
            reason = f"missing tools: {', '.join(missing)} (apt-get install iproute2 util-linux)"
        else:
            probe = f"{PREFIX}probe-{os.getpid()}"
            p = _ip("netns", "add", probe, check=False)
            if p.returncode != 0:
                reason = f"cannot create a network namespace: {p.stderr.strip()}"
            else:
                q = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo",
                                    "root", "netem", "delay", "1ms"], capture_output=True,
                                   text=True, timeout=CMD_TIMEOUT_S)
                if q.returncode != 0:
                    netem = (f"this kernel ({os.uname().release}) has no netem qdisc "
                             f"(CONFIG_NET_SCH_NETEM): links can be rate-limited (tbf) but not "
                             f"delayed or lossy ({q.stderr.strip()})")
                _ip("netns", "del", probe, check=False)
    _PROBED.update(reason=reason, netem=netem)


def _start_time(pid: int) -> str | None:
    """A process's start time (field 22 of /proc/PID/stat), so a reused pid is not mistaken
    for the owner."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _namespaces(cid: str | None = None) -> list[str]:
    out = _ip("netns", "list", check=False).stdout.split("\n")
    names = [line.split()[0] for line in out if line.strip()]
    want = f"{PREFIX}{cid}-" if cid else PREFIX
    return [n for n in names if n.startswith(want)]


def _kill_inside(ns: str) -> None:
    """SIGTERM, then SIGKILL, every process in ``ns`` (bounded in time)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
        pids = [p for p in pids if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + KILL_WAIT_S
        while time.monotonic() < deadline:
            if not any(Path(f"/proc/{p}").exists() and _state(p) != "Z" for p in pids):
                return
            time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"


def teardown(cid: str) -> list[str]:
    """Remove cluster ``cid``: its processes, namespaces (veths, bridge, qdiscs with them) and
    state file. Returns the namespaces removed. Safe to call twice."""
    gone = []
    nss = _namespaces(cid)
    for ns in sorted(nss, key=lambda n: n.endswith("-sw")):  # nodes first, the switch last
        _kill_inside(ns)
        if _ip("netns", "del", ns, check=False).returncode == 0:
            gone.append(ns)
    with contextlib.suppress(FileNotFoundError):
        (STATE_DIR / f"{cid}.json").unlink()
    return gone


def _owner_alive(cid: str) -> bool:
    try:
        st = json.loads((STATE_DIR / f"{cid}.json").read_text())
    except (OSError, ValueError):
        return False
    return _start_time(int(st["pid"])) == st.get("start")


def clean_stale() -> list[str]:
    """Tear down every simulated cluster whose owner process is gone (a crash, ``kill -9`` of
    both the owner and its reaper). Live clusters of other processes are left alone."""
    cids = {n[len(PREFIX):].split("-", 1)[0] for n in _namespaces()}
    cids.discard("probe")
    removed: list[str] = []
    for cid in sorted(cids):
        if not _owner_alive(cid):
            removed += teardown(cid)
    if STATE_DIR.is_dir():  # state files of clusters already gone
        for f in STATE_DIR.glob("*.json"):
            if not _owner_alive(f.stem) and not _namespaces(f.stem):
                with contextlib.suppress(FileNotFoundError):
                    f.unlink()
    return removed


class SimNode:
    """One simulated machine: a network namespace with one NIC (``eth0``) and its cores."""

    def __init__(self, cluster: "SimCluster", index: int, cpus: str):
        self.cluster, self.index, self.cpus = cluster, index, cpus
        self.netns = f"{PREFIX}{cluster.cid}-n{index}"
        self.address = f"{cluster.subnet}.{index + 1}"
        self.interface = "eth0"

    def __repr__(self) -> str:
        return f"SimNode({self.index}, {self.address}, netns={self.netns}, cpus={self.cpus})"

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as run on this node: inside its namespace, pinned to its cores."""
        return ["ip", "netns", "exec", self.netns, "taskset", "-c", self.cpus, *argv]

    def run(self, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess:
        kw.setdefault("timeout", 600)
        return subprocess.run(self.command(argv), **kw)

    def popen(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        return subprocess.Popen(self.command(argv), **kw)

    def spec(self) -> dict[str, str]:
        """This node as Sluice's launch config describes it (``sluice.stages.run.nodes``)."""
        return {"address": self.address, "netns": self.netns, "interface": self.interface,
                "cpus": self.cpus}

    def set_link(self, up: bool) -> None:
        """Plug or unplug this node's cable (a node that cannot reach the others)."""
        _ip("-n", self.netns, "link", "set", self.interface, "up" if up else "down")


class SimCluster:
    """``nodes`` namespaces on ``subnet``.0/24 behind one bridge, links shaped to ``rate``
    (tbf, both directions) with one-way ``delay`` and optional ``loss`` (netem, on send)."""

    def __init__(self, nodes: int = 2, rate: str | None = "1gbit", delay: str | None = None,
                 loss: str | None = None, cpus: Sequence[str] | None = None,
                 subnet: str = "10.213.0", reaper: bool = True):
        if not 1 <= nodes <= 32:
            raise ValueError(f"nodes must be in 1..32, got {nodes}")
        if rate is not None:
            rate_bits(rate)
        if delay is not None and not DELAY.match(delay):
            raise ValueError(f"delay must look like 0.2ms or 50us, got {delay!r}")
        if loss is not None and not LOSS.match(loss):
            raise ValueError(f"loss must look like 0.1%, got {loss!r}")
        if not re.fullmatch(r"\d{1,3}\.\d{1,3}\.\d{1,3}", subnet):
            raise ValueError(f"subnet must be the first three octets, e.g. 10.213.0, got {subnet!r}")
        self.rate, self.delay, self.loss, self.subnet = rate, delay, loss, subnet
        self.cid = secrets.token_hex(3)
        have = sorted(os.sched_getaffinity(0))
        if cpus is None:
            cpus = [str(have[i % len(have)]) for i in range(nodes)]
        if len(cpus) != nodes or not all(re.fullmatch(r"[0-9]+([,-][0-9]+)*", c) for c in cpus):
            raise ValueError(f"cpus needs one taskset list per node (e.g. ['0', '1']), got {cpus!r}")
        self.nodes = [SimNode(self, i, c) for i, c in enumerate(cpus)]
        self.switch = f"{PREFIX}{self.cid}-sw"
        self._reaper: subprocess.Popen | None = None
        self._want_reaper = reaper
        self.is_up = False

    def __enter__(self) -> "SimCluster":
        self.up()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.down()

    def describe(self) -> str:
        shape = ", ".join(x for x in (self.rate, self.delay and f"delay {self.delay}",
                                      self.loss and f"loss {self.loss}") if x) or "unshaped"
        rows = [f"cluster {self.cid}: {len(self.nodes)} nodes, {shape}"]
        rows += [f"  node {n.index}: {n.address} netns {n.netns} cpus {n.cpus}" for n in self.nodes]
        return "\n".join(rows)

    # ------------------------------------------------------------------ up / down
    def up(self) -> "SimCluster":
        reason = netadmin_missing()
        if reason:
            raise SimClusterError(f"cannot build a simulated cluster: {reason}")
        clean_stale()
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        (STATE_DIR / f"{self.cid}.json").write_text(json.dumps(
            {"pid": os.getpid(), "start": _start_time(os.getpid()),
             "nodes": [n.netns for n in self.nodes], "switch": self.switch}))
        if self._want_reaper:
            self._reaper = subprocess.Popen([sys.executable, os.path.abspath(__file__), "reap",
                                             self.cid], stdin=subprocess.PIPE,
                                            start_new_session=True)
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        self.is_up = True
        return self

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for n in self.nodes:
            port = f"p{n.index}"
            _ip("netns", "add", n.netns)
            _ip("link", "add", "name", n.interface, "netns", n.netns, "type", "veth",
                "peer", "name", port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", n.netns, "link", "set", "lo", "up")
            _ip("-n", n.netns, "addr", "add", f"{n.address}/24", "dev", n.interface)
            _ip("-n", n.netns, "link", "set", n.interface, "up")
            self._shape(n, port)

    def _shape(self, n: SimNode, port: str) -> None:
        netem: list[str] = []
        if (self.delay or self.loss) and netem_missing():
            raise SimClusterError(f"cannot add delay={self.delay} loss={self.loss}: "
                                  f"{netem_missing()}; use delay=None")
        if self.delay:
            netem += ["delay", self.delay]
        if self.loss:
            netem += ["loss", self.loss]
        parent = ["root"]
        if netem:
            _tc(n.netns, "qdisc", "add", "dev", n.interface, "root", "handle", "1:", "netem",
                *netem, "limit", "100000")
            parent = ["parent", "1:1"]
        if self.rate:
            # burst: at least a 64 KB GSO segment, and ~4 ms of traffic so timer granularity
            # does not cap fast links below their rate
            burst = str(max(65536 * 2, int(rate_bits(self.rate) / 8 / 250)))
            tbf = ["tbf", "rate", self.rate, "burst", burst, "latency", "100ms"]
            _tc(n.netns, "qdisc", "add", "dev", n.interface, *parent, "handle", "10:", *tbf)
            _tc(self.switch, "qdisc", "add", "dev", port, "root", "handle", "10:", *tbf)

    def down(self) -> list[str]:
        """Tear the cluster down (idempotent); returns the namespaces removed."""
        gone = teardown(self.cid)
        if self._reaper is not None:
            with contextlib.suppress(OSError):
                self._reaper.stdin.close()  # type: ignore[union-attr]
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._reaper.wait(10)
            self._reaper = None
        self.is_up = False
        return gone

    def qdiscs(self) -> str:
        """``tc qdisc show`` of every node and switch port (for logs and checks)."""
        out = []
        for ns in [n.netns for n in self.nodes] + [self.switch]:
            p = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show"],
                               capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
            out.append(f"{ns}:\n{p.stdout}")
        return "\n".join(out)


def _reap(cid: str) -> None:
    """The reaper: wait until the owner closes our stdin (or dies), then tear ``cid`` down."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the owner's to handle
    with contextlib.suppress(OSError):
        while sys.stdin.buffer.read(4096):
            pass
    teardown(cid)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "reap":
    _reap(sys.argv[2])
