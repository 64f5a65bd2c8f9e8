"""The loader under a real memory cgroup smaller than the split: ``auto`` streams instead of
decoding the split into RAM, the epoch completes, and memory stays under the limit.

Needs root and a writable cgroup v1 memory hierarchy (skipped with the reason otherwise). The
cgroup is made inside this process's own memory cgroup, so the limit nests under whatever
already limits the test run, and it is removed afterwards.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid

import pytest

from benchmarks.loader_scale import own_memory_cgroup, remove_cgroup
from conftest import ROOT

LIMIT = 448 << 20
SIDE = 512  # stored image side: 768 kB decoded each


@pytest.fixture
def memory_cgroup():
    if os.geteuid() != 0:
        pytest.skip("needs root to create a memory cgroup")
    parent = own_memory_cgroup()
    if parent is None or not (parent / "memory.limit_in_bytes").exists():
        pytest.skip("no cgroup v1 memory hierarchy at /sys/fs/cgroup/memory")
    cg = parent / f"sluice-test-{uuid.uuid4().hex[:8]}"
    try:
        cg.mkdir()
        (cg / "memory.limit_in_bytes").write_text(str(LIMIT))
    except OSError as e:
        if cg.exists():
            cg.rmdir()
        pytest.skip(f"cgroup {parent} is not writable here ({e})")
    yield cg
    remove_cgroup(cg)  # the child has exited; any straggler moves out first


@pytest.fixture(scope="module")
def big_split(tmp_path_factory):
    """Real photo crops stored at 512×512: ~860 train samples decode to ~680 MB, more than the
    cgroup's 448 MiB, while the JPEG shards are ~30 MB."""
    pytest.importorskip("sklearn")
    from benchmarks.photo_crops import make_photo_folder
    from sluice.stages.data.config import IngestConfig, ShardConfig
    from sluice.stages.data.shard import shard_dataset
    d = tmp_path_factory.mktemp("big")
    folder = make_photo_folder(20e6, d / "src", min_side=300, max_side=427, progress=False)
    s = shard_dataset(IngestConfig(source=str(folder), kind="folder", holdout_fraction=0, val_fraction=0,
                                   test_fraction=0.05),
                      d / "out", ShardConfig(encoding="jpg", jpeg_quality=75, image_size=(SIDE, SIDE),
                                             shard_samples=64, progress=False))
    n = s.manifest.splits["train"].count
    assert n * SIDE * SIDE * 3 > LIMIT * 1.2, n
    return s.root


CHILD = textwrap.dedent("""
    import json, sys
    from sluice.errors import LoaderError
    from sluice.stages.load import AugmentSpec, Loader
    from sluice.stages.load.augment import Normalize, RandomResizedCrop
    root = sys.argv[1]
    out = {}
    try:
        Loader(root, backend="memory", workers=2).backend()
    except LoaderError as e:
        out["memory_refused"] = str(e)
    L = Loader(root, split="train", batch_size=32, workers=2,
               augment=AugmentSpec(ops=[RandomResizedCrop(size=64), Normalize(mean=[0.5] * 3, std=[0.25] * 3)]))
    seen = []
    for x, y, i in L:
        assert x.shape[1:] == (3, 64, 64)
        seen += i.tolist()
    status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
    out.update(backend=L.backend_name, reason=L.backend_reason, seen=seen, n=L.n,
               anon=int(status["RssAnon"].split()[0]) * 1024, report=L.profile_report())
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.slow
def test_auto_streams_under_a_memory_limit_smaller_than_the_split(memory_cgroup, big_split):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # The shell joins the cgroup, then becomes the loader: every byte it ever holds is charged there.
    r = subprocess.run(["sh", "-c", f'echo $$ > {memory_cgroup}/cgroup.procs && exec "$0" -c "$1" "$2"',
                        sys.executable, CHILD, big_split], capture_output=True, text=True, env=env, timeout=600)
    oom = (memory_cgroup / "memory.oom_control").read_text()
    assert r.returncode == 0, f"rc {r.returncode}\n{oom}\n{r.stderr[-3000:]}"
    out = json.loads(r.stdout.split("RESULT ", 1)[1])
    assert out["backend"] != "memory"
    assert "cgroup" in out["reason"] and "more than the" in out["reason"], out["reason"]
    assert "cgroup" in out["memory_refused"], out["memory_refused"]
    assert sorted(out["seen"]) == list(range(out["n"]))          # the whole epoch, each sample once
    # What the kernel charged this group at its peak (file pages mapped from libraries that other
    # groups brought into the page cache are not ours: VmHWM would count them)
    peak = int((memory_cgroup / "memory.max_usage_in_bytes").read_text())
    assert peak <= LIMIT and out["anon"] < LIMIT
    assert "oom_kill 0" in oom or "oom_kill" not in oom, oom
    print(out["reason"], f"\npeak {peak / 2**20:.0f} MiB of {LIMIT / 2**20:.0f}\n" + out["report"])
    assert "verdict" in out["report"] and out["backend"] in out["report"]
