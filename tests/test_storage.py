"""Storage layer: atomic writes, manifests, verification, fsspec URLs."""
from __future__ import annotations

import subprocess

import numpy as np
import pytest

from sluice.errors import WriteError
from sluice.storage import atomic
from sluice.storage.artifact import ArtifactError, open_artifact
from sluice.storage.manifest import read_manifest
from conftest import FMNIST_INGEST


def test_atomic_write_replaces_whole_file(tmp_path):
    target = tmp_path / "a" / "f.json"
    atomic.write_json(target, {"v": 1})
    atomic.write_json(target, {"v": 2})
    read = target.read_text()
    assert '"v": 2' in read
    assert [p.name for p in target.parent.iterdir()] == ["f.json"]


def test_failed_write_keeps_old_file_and_leaves_no_temp(tmp_path):
    target = tmp_path / "f.bin"
    atomic.write_bytes(target, b"old")
    with pytest.raises(RuntimeError):
        with atomic.atomic_open(target) as f:
            f.write(b"new partial")
            raise RuntimeError("producer crashed")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_disk_full_names_the_file(tmp_path):
    """A real full filesystem (a 64 KiB tmpfs) gives ENOSPC, reported with the path."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        with pytest.raises(WriteError) as e:
            atomic.write_bytes(mnt / "big.bin", b"x" * (1 << 20))
        assert "disk full" in str(e.value) and "big.bin" in str(e.value)
        assert list(mnt.iterdir()) == []
    finally:
        subprocess.run(["umount", str(mnt)])


def test_manifest_round_trip_and_verify(fmnist_artifact):
    root = fmnist_artifact.root
    m = read_manifest(root)
    assert m == fmnist_artifact.manifest
    art = open_artifact(root)
    art.verify(deep=True)
    assert set(m.splits) == {"train", "holdout", "val", "test"}
    for name, s in m.splits.items():
        assert len(art.labels(name)) == s.count == len(art.keys(name))
        assert sum(sh.count for sh in s.shards) == s.count
        assert [sh.first_index for sh in s.shards] == list(np.cumsum([0] + [sh.count for sh in s.shards])[:-1])


def test_open_artifact_follows_latest(fmnist_artifact):
    """LATEST names the version the last run produced or found (other tests add versions)."""
    from pathlib import Path
    from sluice.stages.data.config import IngestConfig
    from sluice.stages.data.shard import ShardConfig, shard_dataset
    dataset_root = Path(fmnist_artifact.root).parent
    shard_dataset(IngestConfig(**FMNIST_INGEST), dataset_root,
                  ShardConfig(shard_samples=128, progress=False, workers=1))
    assert open_artifact(dataset_root).fingerprint == fmnist_artifact.manifest.fingerprint


def test_verify_detects_corruption_and_truncation(fmnist_artifact, tmp_path):
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(fmnist_artifact.root, copy)
    art = open_artifact(copy)
    shard = copy / art.manifest.splits["train"].shards[0].tar.path
    data = bytearray(shard.read_bytes())
    data[2000] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="checksum mismatch.*shard-000000.tar"):
        art.verify()
    shard.write_bytes(bytes(data[:1000]))
    with pytest.raises(ArtifactError, match="1000 bytes, manifest says"):
        art.verify(deep=False)


def test_missing_artifact_is_a_clear_error(tmp_path):
    with pytest.raises(ArtifactError, match="manifest.json is missing"):
        open_artifact(tmp_path)


def test_shard_to_fsspec_url():
    """Any fsspec URL works as the output; memory:// stands in for s3:// in tests."""
    from sluice.stages.data.config import IngestConfig
    from sluice.stages.data.shard import ShardConfig, shard_dataset
    s = shard_dataset(IngestConfig(source="fashion-mnist", limit=100), "memory://sluice-test/ds",
                      ShardConfig(formats=["webdataset", "dali"], progress=False, workers=1))
    assert s.root.startswith("memory://")
    art = open_artifact("memory://sluice-test/ds")
    art.verify(deep=True)
    assert len(art.labels("train")) == art.manifest.splits["train"].count == 80


@pytest.mark.slow
def test_a_fork_never_inherits_a_cache_lock_it_cannot_see(tmp_path):
    """A DataLoader worker forked while the prefetch thread opens or closes a cache lock file must
    not keep that lock held: before the fix, a fork right after the thread's ``os.open`` left the
    child holding the parent's lock and waiting on it forever (a clean-clone hang)."""
    import os
    import signal
    import threading

    from sluice.storage.cache import ArtifactCache
    cache = ArtifactCache("s3://bucket/unused", "0" * 16, tmp_path / "c")
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            with cache._lock("shared"):
                pass
    t = threading.Thread(target=churn, daemon=True)
    t.start()
    stuck = 0
    try:
        for _ in range(60):
            pid = os.fork()
            if pid == 0:  # the child: take the lock, or be stopped by the alarm
                signal.alarm(5)
                with cache._lock("shared"):
                    pass
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            stuck += os.waitstatus_to_exitcode(status) != 0
    finally:
        stop.set()
        t.join(5)
    assert stuck == 0, f"{stuck} of 60 forked children waited forever on an inherited lock"


def test_schema_1_artifacts_are_still_read_and_unknown_schemas_refused(fmnist_artifact, tmp_path):
    """Schema 2 changed only how samples are assigned to splits (#28), not the files: an older
    artifact opens as it is; a schema this Sluice does not know is a clear error."""
    import json
    import shutil
    root = tmp_path / "art"
    shutil.copytree(fmnist_artifact.root, root)
    m = json.loads((root / "manifest.json").read_text())
    assert m["schema_version"] == 2
    for version, ok in ((1, True), (99, False)):
        (root / "manifest.json").write_text(json.dumps({**m, "schema_version": version}))
        if ok:
            assert open_artifact(root).manifest.counts() == fmnist_artifact.manifest.counts()
        else:
            with pytest.raises(ArtifactError, match="schema version 99; this Sluice reads 1, 2"):
                open_artifact(root)
