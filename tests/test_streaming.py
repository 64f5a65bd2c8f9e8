"""Streaming beyond memory: the memory budget (cgroup v1/v2 and MemAvailable), the shard-block
shuffle, and a profile that names the loader's bottleneck."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sluice.errors import LoaderError
from sluice.stages.load import Loader, LoaderConfig, SamplerConfig
from sluice.stages.load.backends import LOADER_BACKENDS
from sluice.stages.load.budget import cgroup_limit, memory_budget
from sluice.stages.load.choice import resolve_backend
from sluice.stages.load.profile import bottleneck
from sluice.stages.load.samplers import ShardBlockSampler, build_sampler
from sluice.storage.artifact import open_artifact


def _tree(tmp_path: Path, version: int, limits: dict[str, str], usage: dict[str, str], inactive: int) -> tuple[str, str]:
    """A /proc/self/cgroup, a mountinfo and cgroup directories as the kernel lays them out."""
    point = tmp_path / ("unified" if version == 2 else "memory")
    names = ("memory.max", "memory.current") if version == 2 else ("memory.limit_in_bytes", "memory.usage_in_bytes")
    stat = "inactive_file" if version == 2 else "total_inactive_file"
    for rel, limit in limits.items():
        d = point / rel
        d.mkdir(parents=True, exist_ok=True)
        (d / names[0]).write_text(limit + "\n")
        (d / names[1]).write_text(usage[rel] + "\n")
        (d / "memory.stat").write_text(f"anon 1\n{stat} {inactive}\n")
    fs = "cgroup2 cgroup2 rw" if version == 2 else "cgroup cgroup rw,memory"
    (tmp_path / "mountinfo").write_text(f"30 25 0:26 / {point} rw,relatime shared:5 - {fs}\n"
                                        "31 25 0:27 / /proc rw - proc proc rw\n")
    line = "0::/job/task\n" if version == 2 else "9:name=systemd:/\n4:memory:/job/task\n"
    (tmp_path / "cgroup").write_text(line)
    return str(tmp_path / "cgroup"), str(tmp_path / "mountinfo")


@pytest.mark.parametrize("version", [1, 2])
def test_cgroup_limit_is_the_tightest_ancestor_net_of_its_working_set(tmp_path, version):
    # the task's own group is unlimited; its parent allows 2 GB of which 1.5 GB is used, but
    # 0.25 GB of that is inactive file cache the kernel reclaims first
    unlimited = "max" if version == 2 else "9223372036854771712"
    cg, mi = _tree(tmp_path, version, {"job/task": unlimited, "job": str(2 * 10**9), "": unlimited},
                   {"job/task": str(10**9), "job": str(15 * 10**8), "": str(10**10)}, 25 * 10**7)
    c = cgroup_limit(cg, mi)
    assert c is not None and c.version == version and c.path.endswith("job")
    assert c.limit == 2 * 10**9 and c.headroom == 2 * 10**9 - (15 * 10**8 - 25 * 10**7)


def test_no_cgroup_limit_means_the_host_decides(tmp_path):
    cg, mi = _tree(tmp_path, 2, {"job/task": "max", "job": "max", "": "max"},
                   {"job/task": "1", "job": "1", "": "1"}, 0)
    assert cgroup_limit(cg, mi) is None
    b = memory_budget()
    assert 0 < b.bytes <= b.headroom and b.host_available and b.bytes == int(b.headroom * b.fraction)
    assert "MemAvailable" in b.explain()


def test_auto_explains_its_choice(fmnist_artifact):
    art = open_artifact(fmnist_artifact.root)
    need = art.manifest.splits["train"].count * 28 * 28
    cfg = LoaderConfig(batch_size=16, prefetch=1)  # batches in flight well below the split's size
    name, why = resolve_backend(art, cfg.model_copy(update={"memory_budget_bytes": need}))
    assert name == "memory" and "within" in why
    name, why = resolve_backend(art, cfg.model_copy(update={"memory_budget_bytes": need - 1}))
    assert name == "ffcv" and "more than the loader.memory_budget_bytes" in why
    L = Loader(art, cfg, memory_budget_bytes=need - 1, workers=1)
    assert L.backend_name == "ffcv"
    # a streaming backend's own buffers count too: FFCV decodes whole batches ahead
    ffcv, wds = (LOADER_BACKENDS.get(b).working_bytes(art, "train", cfg) for b in ("ffcv", "webdataset"))
    assert wds < ffcv < need
    name, why = resolve_backend(art, cfg.model_copy(update={"memory_budget_bytes": ffcv - 1}))
    assert name == "webdataset" and "ffcv needs" in why and "within it" in why
    name, why = resolve_backend(art, cfg.model_copy(update={"memory_budget_bytes": 1}))
    assert name == "webdataset" and "every backend needs more" in why
    with pytest.raises(LoaderError, match="more than the"):
        Loader(art, backend="memory", memory_budget_bytes=need - 1, workers=1).backend()


def test_shard_block_order_holds_a_window_of_shards_at_a_time():
    sizes = [5, 7, 3, 6, 4, 5, 2]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    s = ShardBlockSampler(sizes, window=3, seed=1)
    for epoch in range(3):
        order = s.epoch_order(epoch)
        assert sorted(order.tolist()) == list(range(sum(sizes)))           # each sample once
        shard = np.searchsorted(starts, order, side="right") - 1
        first = {k: int(np.argmax(shard == k)) for k in range(len(sizes))}
        slots = sorted(first, key=first.get)                               # shards in the order read
        for w in range(0, len(slots), 3):                                  # windows of 3, in turn:
            span = np.flatnonzero(np.isin(shard, slots[w:w + 3]))
            assert span.max() - span.min() + 1 == len(span)                # one contiguous block
    assert not np.array_equal(s.epoch_order(0), s.epoch_order(1))
    assert not np.array_equal(s.epoch_order(0), np.arange(sum(sizes)))


def test_shard_block_from_config_and_its_errors(fmnist_artifact):
    art = open_artifact(fmnist_artifact.root)
    sizes = [sh.count for sh in art.manifest.splits["train"].shards]
    smp = build_sampler(SamplerConfig(kind="shard_block", window=2), sum(sizes), 64, None, sizes)
    assert isinstance(smp, ShardBlockSampler)
    with pytest.raises(LoaderError, match="shard sizes"):
        build_sampler(SamplerConfig(kind="shard_block"), 10, 64, None, None)
    L = Loader(art, backend="webdataset", workers=1, batch_size=50,
               sampler=SamplerConfig(kind="shard_block", window=2, seed=4))
    got = np.concatenate([i.numpy() for _, _, i in L])
    assert np.array_equal(got, L.epoch_indices(0))


def test_bottleneck_verdicts():
    assert bottleneck({"read": 8.0, "decode": 2.0, "augment": 1.0, "wait": 9.0, "wall": 10.0})["verdict"] == "storage-bound"
    v = bottleneck({"read": 0.1, "decode": 6.0, "augment": 1.0, "transfer": 0.5, "wait": 1.0, "wall": 20.0})
    assert v["verdict"] == "decode-bound" and v["wait_share"] == 0.05 and "keeps up" in v["summary"]
    assert bottleneck({"read": 0.1, "gather": 1.0, "augment": 3.0})["verdict"] == "compute-bound"
    assert bottleneck({"decode+augment": 3.0, "read": 1.0})["verdict"] == "decode-bound"
    assert bottleneck({})["verdict"] == "unknown"


@pytest.mark.parametrize("backend", ["memory", "webdataset", "ffcv"])
def test_profile_separates_storage_reads_from_decode(fmnist_artifact, backend):
    L = Loader(fmnist_artifact.root, backend=backend, workers=1, batch_size=100)
    for _ in L:
        pass
    p = L.profile()
    assert p["read"] > 0 and p["samples"] == L.n and p["wall"] > 0
    assert ("gather" if backend == "memory" else "decode") in p
    report = L.profile_report()
    assert "verdict" in report and "-bound" in report and f"{backend}, as configured" in report


def test_a_process_forked_while_the_cache_holds_a_lock_does_not_keep_it(tmp_path):
    """DataLoader workers fork while the prefetch thread may hold a fetch lock: the child's
    inherited copy must not keep the lock held after the parent lets go (it did, and the
    worker then waited on it forever)."""
    from procwatch import lock_free_in_a_child_forked_inside
    from sluice.storage.cache import ArtifactCache
    cache = ArtifactCache(str(tmp_path / "remote"), "f" * 16, tmp_path / "cache")
    assert lock_free_in_a_child_forked_inside(cache._lock("file-x"), cache.dir / ".locks" / "file-x") == 0, \
        "the forked child still holds the parent's lock"


def test_the_loader_bottleneck_reaches_the_training_summary_and_the_nightly_report(fmnist_artifact):
    from sluice.flows.report import markdown_summary
    from sluice.stages.train import TrainConfig, train
    L = Loader(fmnist_artifact.root, backend="webdataset", workers=1, batch_size=32)
    r = train(TrainConfig(model_kwargs={"width": 8}, max_steps=6, batch_size=32, progress=False,
                          torch_threads=1), L)
    lp = r.summary["loader"]
    assert lp["backend"] == "webdataset" and "as configured" in lp["choice"]
    assert lp["verdict"].endswith("-bound") and "the caller waited" in lp["summary"]
    assert f"- loader `webdataset`: {lp['summary']}" in markdown_summary({"train": r.summary})
