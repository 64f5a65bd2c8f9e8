"""``python -m deploy.simcluster``: build a simulated cluster and keep it while you work.

    python -m deploy.simcluster up --nodes 2 --rate 100mbit [--delay 0.2ms]   # Ctrl-C or SIGTERM tears it down
    python -m deploy.simcluster exec 0 -- python -c 'import socket; print(socket.gethostname())'
    python -m deploy.simcluster list
    python -m deploy.simcluster clean       # remove clusters whose owner is gone

``exec`` finds the newest live cluster (or ``--cluster ID``) and runs the command inside node
N's namespace, pinned to its cores. ``up --run CMD`` runs one command on every node at once
instead of waiting, with SIM_NODE, SIM_NODES and SIM_ADDRS (space-separated) in its
environment, and tears down when they end.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from deploy.simcluster.cluster import (PREFIX, STATE_DIR, SimCluster, _namespaces, _owner_alive,
                                       clean_stale, netadmin_missing)


def _live() -> list[dict]:
    out = []
    for f in sorted(STATE_DIR.glob("*.json"), key=lambda p: p.stat().st_mtime) if STATE_DIR.is_dir() else []:
        if _owner_alive(f.stem) and _namespaces(f.stem):
            out.append({"id": f.stem, **json.loads(f.read_text())})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deploy.simcluster", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build a cluster; keep it until Ctrl-C (or until --run ends)")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--rate", default="1gbit", help="per link, each way: 100mbit | 1gbit | 10gbit | none")
    up.add_argument("--delay", default=None, help="one way, per link, e.g. 0.2ms (needs netem in the kernel)")
    up.add_argument("--loss", default=None, help="e.g. 0.1%% (netem, on send)")
    up.add_argument("--cpus", nargs="*", help="taskset list per node (default: one core each, round robin)")
    up.add_argument("--run", help="a shell command run on every node at once")
    ex = sub.add_parser("exec", help="run a command on node N of a live cluster")
    ex.add_argument("node", type=int)
    ex.add_argument("--cluster", help="cluster id (default: the newest live one)")
    ex.add_argument("argv", nargs=argparse.REMAINDER)
    sub.add_parser("list", help="live clusters")
    sub.add_parser("clean", help="tear down clusters whose owner process is gone")
    a = ap.parse_args(argv)

    if a.cmd in ("up", "clean"):
        reason = netadmin_missing()
        if reason:
            print(f"simcluster: {reason}", file=sys.stderr)
            return 2
    if a.cmd == "clean":
        print("\n".join(clean_stale()) or "nothing stale")
        return 0
    if a.cmd == "list":
        for c in _live():
            print(f"{c['id']}: owner pid {c['pid']}, nodes {' '.join(c['nodes'])}")
        return 0
    if a.cmd == "exec":
        live = [c for c in _live() if a.cluster in (None, c["id"])]
        if not live:
            print("simcluster: no live cluster (start one with `up`)", file=sys.stderr)
            return 2
        nodes = live[-1]["nodes"]
        if not 0 <= a.node < len(nodes):
            print(f"simcluster: node must be 0..{len(nodes) - 1}", file=sys.stderr)
            return 2
        cmd = [x for x in a.argv if x != "--"] or [os.environ.get("SHELL", "/bin/sh")]
        return subprocess.call(["ip", "netns", "exec", nodes[a.node], *cmd])

    none = lambda v: None if v in (None, "none", "") else v  # noqa: E731
    with SimCluster(a.nodes, none(a.rate), none(a.delay), none(a.loss), a.cpus) as c:
        print(c.describe(), flush=True)
        if a.run:
            addrs = " ".join(n.address for n in c.nodes)
            procs = [n.popen(["sh", "-c", a.run], env={**os.environ, "SIM_NODE": str(n.index),
                                                       "SIM_NODES": str(len(c.nodes)),
                                                       "SIM_ADDRS": addrs})
                     for n in c.nodes]
            return max(p.wait() for p in procs)
        # Ctrl-C or SIGTERM tears it down, even where the shell that started us ignores SIGINT
        # (a background job of a non-interactive shell inherits SIGINT ignored).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        print(f"up; run commands with `python -m deploy.simcluster exec N -- CMD`; Ctrl-C or SIGTERM "
              f"tears it down ({PREFIX}{c.cid}-*)", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            print("tearing down", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
