"""The simulated cluster (deploy/simcluster): real namespaces, veths, a bridge and tbf links; and
that nothing of it outlives its owner — after ``down``, Ctrl-C, a crash, or a stale earlier run.
Skipped with the reason where this process cannot create network namespaces."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from deploy.simcluster import SimCluster, clean_stale, netadmin_missing
from deploy.simcluster.cluster import PREFIX, STATE_DIR, netem_missing

pytestmark = pytest.mark.skipif(bool(netadmin_missing()), reason=f"simulated cluster: {netadmin_missing()}")

SERVER = ("import socket,time\ns=socket.socket();s.bind(('0.0.0.0',5001));s.listen();c,_=s.accept()\n"
          "n,t=0,time.time()\nwhile (d:=c.recv(1<<20)):\n    n+=len(d)\nprint(n*8/(time.time()-t)/1e6)")
CLIENT = ("import socket,time\nfor _ in range(100):\n    try:\n        c=socket.create_connection(('{addr}',5001));break\n"
          "    except OSError: time.sleep(0.05)\nb=b'x'*(1<<20)\nfor _ in range({mb}): c.sendall(b)\nc.close()")


def leftovers(cid: str) -> dict:
    """Everything a cluster could leave behind: its namespaces and state file, and veths or
    tbf/netem qdiscs in this host's own namespace (the cluster never creates any there)."""
    nss = [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
           if n.startswith(f"{PREFIX}{cid}")]
    veths = subprocess.run(["ip", "-o", "link", "show", "type", "veth"], capture_output=True, text=True).stdout
    qd = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True).stdout
    return {"netns": nss, "veth": veths.splitlines(),
            "tbf": [x for x in qd.splitlines() if "tbf" in x or "netem" in x],
            "state": (STATE_DIR / f"{cid}.json").exists()}


CLEAN = {"netns": [], "veth": [], "tbf": [], "state": False}


def wait_clean(cid: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and leftovers(cid) != CLEAN:
        time.sleep(0.2)
    return leftovers(cid)


def test_nodes_talk_over_a_shaped_link_and_leave_nothing_behind():
    with SimCluster(2, rate="100mbit") as c:
        a, b = c.nodes
        assert a.address != b.address and a.cpus != b.cpus or len(os.sched_getaffinity(0)) == 1
        assert "tbf" in c.qdiscs() and "rate 100Mbit" in c.qdiscs()
        srv = a.popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
        b.run([sys.executable, "-c", CLIENT.format(addr=a.address, mb=12)], check=True, timeout=60)
        mbit = float(srv.communicate(timeout=60)[0])
        assert 60 < mbit < 110, mbit  # the link's rate, not the host's memory bandwidth
        # a process still running inside a node is stopped at teardown
        stray = b.popen(["sleep", "300"])
        # the node's processes are pinned to its core
        pinned = subprocess.run(["taskset", "-pc", str(stray.pid)], capture_output=True, text=True).stdout
        assert pinned.strip().endswith(b.cpus)
        cid = c.cid
        during = leftovers(cid)
        assert len(during["netns"]) == 3 and during["veth"] == [] and during["tbf"] == []
    assert stray.wait(10) is not None
    assert leftovers(cid) == CLEAN


def test_ctrl_c_tears_the_cluster_down():
    # started as a background job of a script would be: with SIGINT ignored
    p = subprocess.Popen([sys.executable, "-m", "deploy.simcluster", "up", "--nodes", "2", "--rate", "1gbit"],
                         cwd=ROOT, stdout=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    first = p.stdout.readline()
    cid = first.split()[1].rstrip(":")
    while "up;" not in p.stdout.readline():
        pass
    assert leftovers(cid)["netns"]
    p.send_signal(signal.SIGINT)
    assert p.wait(30) == 0
    assert leftovers(cid) == CLEAN


CRASH = """
import os, signal, sys
sys.path.insert(0, {root!r})
from deploy.simcluster import SimCluster
c = SimCluster(2, rate="1gbit", reaper={reaper}).up()
n = c.nodes[0].popen(["sleep", "300"])
print(c.cid, flush=True)
sys.stdin.readline()
os.kill(os.getpid(), signal.SIGKILL)
"""


def _crashed_cluster(reaper: bool) -> str:
    p = subprocess.Popen([sys.executable, "-c", CRASH.format(root=str(ROOT), reaper=reaper)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    cid = p.stdout.readline().strip()
    assert leftovers(cid)["netns"]
    p.stdin.write("\n")
    p.stdin.flush()
    assert p.wait(30) == -signal.SIGKILL
    return cid


def test_a_crashed_owner_is_cleaned_up_by_its_reaper():
    cid = _crashed_cluster(reaper=True)
    assert wait_clean(cid) == CLEAN


def test_a_stale_cluster_from_an_earlier_run_is_cleaned_not_fatal():
    cid = _crashed_cluster(reaper=False)  # as if the reaper had been killed too
    time.sleep(0.5)
    assert leftovers(cid)["netns"]  # left behind ...
    with SimCluster(1, rate=None) as c:  # ... and the next cluster starts anyway, cleaning it
        assert c.nodes[0].run(["true"]).returncode == 0
        assert leftovers(cid) == CLEAN
    assert clean_stale() == []


def test_bad_shapes_are_refused_before_anything_is_built():
    for kw in ({"rate": "fast"}, {"delay": "soon"}, {"loss": "1"}, {"nodes": 0}, {"cpus": ["0; rm"]}):
        with pytest.raises(ValueError):
            SimCluster(**{"nodes": 1, **kw})


@pytest.mark.skipif(bool(netem_missing()), reason=f"{netem_missing()}")
def test_delay_shapes_the_round_trip():
    with SimCluster(2, rate="1gbit", delay="5ms") as c:
        probe = ("import socket,time\ns=socket.create_connection(('{a}',5001))\nt=time.time()\n"
                 "for _ in range(5):\n    s.sendall(b'x');s.recv(1)\nprint((time.time()-t)/5)")
        echo = ("import socket\ns=socket.socket();s.bind(('0.0.0.0',5001));s.listen();c,_=s.accept()\n"
                "while (d:=c.recv(1)):\n    c.sendall(d)")
        srv = c.nodes[0].popen([sys.executable, "-c", echo])
        time.sleep(0.5)
        rtt = float(c.nodes[1].run([sys.executable, "-c", probe.format(a=c.nodes[0].address)],
                                   capture_output=True, text=True, check=True).stdout)
        srv.kill()
        assert rtt >= 0.009  # 5 ms each way
