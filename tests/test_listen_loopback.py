"""Single-node training opens nothing beyond loopback: while a real 2-rank torchrun job trains,
every socket that torchrun or its workers listen on is bound to 127.0.0.1 (or ::1), and a
connection to those ports through this host's other addresses is refused."""
from __future__ import annotations

import fcntl
import socket
import struct
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from procwatch import pids_with_env
from sluice.stages.load.arrays import fashion_mnist
from sluice.stages.run.launch import launch, make_job

pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads sockets from /proc (Linux)")


def _addr(hex_addr: str) -> str:
    """A /proc/net/tcp{,6} address (little-endian hex words) as text."""
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def listening() -> dict[int, tuple[str, int]]:
    """Every listening TCP socket on this host: inode -> (address, port)."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A":  # LISTEN
                addr, port = f[1].split(":")
                out[int(f[9])] = (_addr(addr), int(port, 16))
    return out


def socket_inodes(pid: int) -> set[int]:
    out = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            target = str(fd.readlink()) if fd.is_symlink() else ""
            if target.startswith("socket:["):
                out.add(int(target[8:-1]))
    except OSError:
        pass
    return out


def is_loopback(addr: str) -> bool:
    return addr.startswith("127.") or addr in ("::1", "::ffff:127.0.0.1") or addr.startswith("::ffff:127.")


def other_addresses() -> list[str]:
    """This host's IPv4 addresses outside loopback (SIOCGIFADDR per interface)."""
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            addr = socket.inet_ntoa(raw[20:24])
            if not addr.startswith("127."):
                out.append(addr)
    return out


@pytest.mark.slow
def test_single_node_training_listens_on_loopback_only(tmp_path):
    x, y = fashion_mnist("train")
    np.savez(tmp_path / "train.npz", images=x[:1024], labels=y[:1024])
    spec = {"kind": "arrays", "path": str(tmp_path / "train.npz"), "delay_s": 0.05}  # slow: time to look
    cfg = {"model_kwargs": {"width": 8}, "max_steps": 24, "batch_size": 32, "lr": 0.05, "progress": False,
           "torch_threads": 1}
    marker = f"SLUICE_LISTEN_PROBE={uuid.uuid4().hex}"
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = launch(make_job(cfg, spec), nproc=2, out_dir=tmp_path / "run", timeout_s=300,
                                   on_line=lambda s: None, env=dict([marker.split("=", 1)]))
        except Exception as e:  # noqa: BLE001 - surfaced below
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    seen: dict[tuple[int, str, int], str] = {}
    deadline = time.monotonic() + 240
    while t.is_alive() and time.monotonic() < deadline:
        socks = listening()
        for pid in pids_with_env(marker):
            for inode in socket_inodes(pid) & set(socks):
                addr, port = socks[inode]
                seen[(pid, addr, port)] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
        if (tmp_path / "run" / "metrics.jsonl").exists() and len({p for p, _, _ in seen}) >= 3:
            break  # torchrun's stores and both ranks' collectives are up
        time.sleep(0.2)
    reachable = []
    for addr in other_addresses():
        for _, _, port in seen:
            with socket.socket() as s:
                s.settimeout(2)
                if s.connect_ex((addr, port)) == 0:
                    reachable.append(f"{addr}:{port}")
    t.join(300)
    assert "error" not in box, box.get("error")
    assert box["result"].steps == 24
    assert len({p for p, _, _ in seen}) >= 3, seen  # torchrun and both ranks were seen listening
    exposed = {k: v for k, v in seen.items() if not is_loopback(k[1])}
    assert exposed == {}, f"listening beyond loopback: {exposed}"
    assert reachable == [], f"reachable from this host's other addresses: {reachable}"
