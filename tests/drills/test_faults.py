"""Drills with faults: a full disk, kill -9 at random points of shard and train, two writers on
one output, a worker that dies, a rank that hangs. Each is bounded by a deadline (a hang fails
the drill), and each asserts a clear error or a complete result, that no process of the run is
left, and that no partial artifact is visible."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from corpus import ROOT, file_digests, marker, no_survivors, pids_with, run_cli, small_tmpfs, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds processes through /proc")]
SHARD = ["shard", "fashion-mnist", "--quiet", "--set", "ingest.limit=6000", "--set", "shard.shard_samples=500"]


def _start(args: list[str], mark, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sluice.flows.cli", *args], cwd=ROOT,
                            env={**os.environ, mark[0]: mark[1], **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _visible(out: Path) -> list[Path]:
    """What a reader could take for an artifact: a manifest, or a LATEST pointer."""
    return list(out.glob("*/manifest.json")) + list(out.glob("LATEST"))


@pytest.mark.drill("fault-disk-full")
@pytest.mark.parametrize("size,formats,workers", [
    ("1m", "[ffcv]", 1),  # the .beton writer hits the full disk (FFCV's own writer used to hang forever)
    ("6m", "[webdataset,dali,ffcv]", 2),  # the tar pool and the .beton writer side by side
])
def test_full_disk_fails_clearly_without_hanging(tmp_path, size, formats, workers):
    mark = marker()
    with small_tmpfs(tmp_path / "small", size) as disk:
        r = run_cli(SHARD + ["--out", str(disk / "ds"), "--set", f"shard.formats={formats}",
                             "--set", f"shard.workers={workers}"], timeout=120, env=dict([mark]))
        assert r.returncode == 2, r.stderr[-3000:]
        assert "disk full while writing" in r.stderr and str(disk / "ds") in r.stderr, r.stderr[-3000:]
        assert "Traceback" not in r.stderr
        assert _visible(disk / "ds") == []
        no_survivors(mark)


@pytest.mark.drill("fault-kill-9-shard")
def test_kill_9_at_random_points_leaves_nothing_running_and_resumes_byte_identical(tmp_path):
    from sluice.storage.artifact import open_artifact
    rng = random.Random(15)
    out = tmp_path / "ds"
    # 6400 train samples fill 3 FFCV pages: with several FFCV workers racing for pages, the old
    # writer gave every run different data.beton bytes
    args = ["shard", "fashion-mnist", "--quiet", "--set", "ingest.limit=8000", "--set", "shard.shard_samples=1000"]
    for _ in range(2):
        mark = marker()
        p = _start(args + ["--out", str(out), "--set", "shard.workers=2"], mark)
        time.sleep(rng.uniform(2.5, 6.0))  # start-up takes ~2 s: kill during scan or writing
        p.kill()
        p.communicate()
        no_survivors(mark, timeout=10)
        sizes = {q: q.stat().st_size for q in out.rglob("*") if q.is_file()}
        time.sleep(1.5)  # nothing goes on writing after the kill
        assert {q: q.stat().st_size for q in out.rglob("*") if q.is_file()} == sizes
        for manifest in out.glob("*/manifest.json"):  # visible only when complete (a fast machine)
            open_artifact(manifest.parent).verify()
    r = run_cli(args + ["--out", str(out), "--set", "shard.workers=2"], timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    from sluice.stages.data.config import IngestConfig, ShardConfig
    from sluice.stages.data.shard import shard_dataset
    shard_dataset(IngestConfig(source="fashion-mnist", limit=8000), tmp_path / "clean",  # uninterrupted, 1 worker
                  ShardConfig(shard_samples=1000, workers=1, progress=False))
    (a,), (b,) = list(out.glob("*/manifest.json")), list((tmp_path / "clean").glob("*/manifest.json"))
    assert a.parent.name == b.parent.name  # same fingerprint
    assert file_digests(a.parent) == file_digests(b.parent)  # data.beton included: same bytes


@pytest.mark.drill("fault-two-writers")
def test_two_writers_on_one_output_make_one_complete_artifact(tmp_path):
    from sluice.storage.artifact import open_artifact
    mark = marker()
    out = tmp_path / "ds"
    first = _start(SHARD + ["--out", str(out)], mark)
    # once the first holds the version's lock (it writes who it is into the lock file)...
    lock = wait_until("the first writer's lock", lambda: [q for q in out.glob(".*.lock") if q.read_text()],
                      timeout=120, every=0.05)[0]
    # ...it is held there (writing 6,000 samples takes about a second) while the second starts
    # on the same output and says whom it waits for
    os.kill(first.pid, signal.SIGSTOP)
    said: list[str] = []
    try:
        second = _start(SHARD + ["--out", str(out)], mark)

        def read_stderr() -> None:
            for line in second.stderr:
                said.append(line)
        reader = threading.Thread(target=read_stderr, daemon=True)
        reader.start()
        wait_until("the second writer to say whom it waits for",
                   lambda: any(f"is being written by pid {first.pid}" in s for s in said), timeout=120, every=0.05)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    first_out = first.communicate(timeout=240)
    second_stdout = second.stdout.read()
    second.wait(timeout=240)
    reader.join(10)
    assert first.returncode == 0 and second.returncode == 0, (first_out[1][-2000:], "".join(said)[-2000:])
    assert "up to date (nothing rewritten)" in second_stdout  # then it found the finished artifact
    art = open_artifact(out)
    art.verify()
    assert not list(out.rglob(".tmp-*")) and lock.read_text() == ""
    no_survivors(mark)


@pytest.mark.drill("fault-worker-dies")
def test_a_dead_shard_worker_fails_the_stage_instead_of_hanging(tmp_path):
    mark = marker()
    p = _start(["shard", "fashion-mnist", "--quiet", "--out", str(tmp_path / "ds"), "--set", "shard.workers=2",
                "--set", "ingest.limit=12000", "--set", "shard.formats=[webdataset,dali]"], mark)
    pgid = os.getpgid(p.pid)

    def pool_worker() -> int | None:  # a child of the stage: a tar pool worker (no .beton here)
        for pid in pids_with(mark):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                if int(stat[1]) == p.pid and os.getpgid(pid) == pgid:
                    return pid
            except (OSError, ValueError, IndexError):
                continue
        return None
    victim = wait_until("a shard worker", pool_worker, timeout=60, every=0.05)
    os.kill(victim, signal.SIGKILL)  # as the out-of-memory killer would
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2, err[-3000:]
    assert "worker process died" in err and "SIGKILL" in err, err[-3000:]
    assert _visible(tmp_path / "ds") == []
    no_survivors(mark)
    r = run_cli(["shard", "fashion-mnist", "--quiet", "--out", str(tmp_path / "ds"), "--set", "ingest.limit=12000",
                 "--set", "shard.formats=[webdataset,dali]"], timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]


# ------------------------------------------------------------------ training

TRAIN_SCRIPT = """
import sys
from sluice.stages.run.launch import launch, make_job
cfg = {"model_kwargs": {"width": 8}, "max_steps": 40, "batch_size": 32, "lr": 0.05, "progress": False,
       "torch_threads": 1, "checkpoint_every_steps": 5, "dist_timeout_s": 10}
data = {"kind": "arrays", "path": sys.argv[2], "delay_s": float(sys.argv[3])}
r = launch(make_job(cfg, data), nproc=2, out_dir=sys.argv[1], timeout_s=300, on_line=lambda s: None)
print("STEPS", r.steps, "RESUMED", r.resumed_from)
"""


@pytest.fixture(scope="module")
def train_npz(tmp_path_factory) -> Path:
    from sluice.stages.load.arrays import fashion_mnist
    x, y = fashion_mnist("train")
    path = tmp_path_factory.mktemp("train") / "train.npz"
    np.savez(path, images=x[:1024], labels=y[:1024])
    return path


def _launch(tmp_path: Path, npz: Path, mark, delay: float) -> subprocess.Popen:
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    return subprocess.Popen([sys.executable, str(script), str(tmp_path / "run"), str(npz), str(delay)], cwd=ROOT,
                            env={**os.environ, mark[0]: mark[1]}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.drill("fault-kill-9-train")
def test_kill_9_of_the_launcher_stops_training_and_a_new_launch_resumes(tmp_path, train_npz):
    from sluice.storage.checkpoint import load_checkpoint
    mark = marker()
    # 0.1 s a batch: at least 3.5 s of training remain after the first checkpoint (step 5), so
    # the kill always lands mid-run, however fast the host (0.03 s let a quick host finish first)
    p = _launch(tmp_path, train_npz, mark, delay=0.1)
    ckpt = tmp_path / "run" / "checkpoints" / "last.pt"
    wait_until("a checkpoint", ckpt.exists, timeout=180, every=0.1)
    time.sleep(random.Random(15).uniform(0.0, 1.0))
    p.kill()  # the flow process dies (OOM killer, node loss): torchrun and its ranks must follow
    p.communicate()
    no_survivors(mark, timeout=30)
    step = load_checkpoint(ckpt)["step"]
    assert 0 < step < 40
    again = _launch(tmp_path, train_npz, marker(), delay=0.0)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-3000:]
    assert "STEPS 40" in out and f"RESUMED {step}" in out, out


@pytest.mark.drill("fault-hung-rank")
@pytest.mark.timeout(600)  # the run's own dist timeout ends it; were it to hang, this fails it
def test_a_hung_rank_fails_the_run_instead_of_hanging(tmp_path, train_npz):
    mark = marker()
    p = _launch(tmp_path, train_npz, mark, delay=0.03)
    pid_file = tmp_path / "run" / "pids" / "rank1.pid"
    wait_until("rank 1 to train", lambda: pid_file.exists() and (tmp_path / "run" / "metrics.jsonl").exists(),
               timeout=180, every=0.2)
    os.kill(int(pid_file.read_text()), signal.SIGSTOP)  # alive but never answers again
    out, err = p.communicate(timeout=200)
    assert p.returncode != 0 and "STEPS" not in out
    assert "TrainError" in err or "LaunchError" in err, err[-3000:]
    no_survivors(mark, timeout=60)
