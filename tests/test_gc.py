"""``sluice gc`` (storage/gc.py) and the readers' leases it respects (storage/artifact.py), on real
artifacts written by the shard stage on small ``.npz`` sources."""
from __future__ import annotations

import gc as pygc
import hashlib
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT
from sluice.errors import ArtifactError, ConfigError
from sluice.flows.cli import main as cli_main
from sluice.stages.data.config import IngestConfig
from sluice.stages.data.shard import ShardConfig, shard_dataset
from sluice.stages.load import Loader
from sluice.storage.artifact import DatasetArtifact, open_artifact, reader_lock_file
from sluice.storage.gc import GC_LOCK, REMOVED_MARKER, collect
from sluice.storage.manifest import MANIFEST_NAME, read_manifest, write_manifest

# incremental=False: each version whole; parent/child links are made by hand where a test needs them
WHOLE = dict(workers=1, progress=False, shard_samples=8, incremental=False)
INGEST = dict(holdout_fraction=0, val_fraction=0, test_fraction=0.2)


def _source(path: Path, n: int, seed: int, test: int = 0, test_seed: int | None = None) -> Path:
    rng = np.random.default_rng(seed)
    arrays = {"images": rng.integers(0, 256, (n, 8, 8), dtype=np.uint8), "labels": np.arange(n) % 3}
    if test:
        trng = np.random.default_rng(test_seed if test_seed is not None else seed + 1000)
        arrays |= {"test_images": trng.integers(0, 256, (test, 8, 8), dtype=np.uint8),
                   "test_labels": np.arange(test) % 3}
    np.savez(path, **arrays)
    return path


def _shard(tmp_path: Path, root: Path, seed: int, n: int = 40, **cfg) -> str:
    """One whole version of a source of ``n`` images (different ``seed``: different version)."""
    src = _source(tmp_path / f"src{seed}.npz", n, seed)
    s = shard_dataset(IngestConfig(source=str(src), **INGEST), root, ShardConfig(**{**WHOLE, **cfg}))
    return Path(s.root).name


def _files(d: Path) -> dict[str, int]:
    return {p.relative_to(d).as_posix(): p.lstat().st_size for p in d.rglob("*") if p.is_file() or p.is_symlink()}


def _readable(root: Path, version: str) -> None:
    """The version opens, every file verifies against its sha256, and a loader yields a batch."""
    with DatasetArtifact(root / version) as art:
        art.verify(deep=True)
        L = Loader(art, split="train", batch_size=8, backend="memory", workers=0, verify="full")
        images, labels, _ = next(iter(L))
        assert len(labels) == 8 and images.shape[0] == 8


def _latest(root: Path) -> str:
    return (root / "LATEST").read_text().strip()


@pytest.mark.slow
def test_keep_last_n_removes_old_versions_and_frees_their_bytes(tmp_path):
    root = tmp_path / "ds"
    v = [_shard(tmp_path, root, seed) for seed in range(4)]
    assert _latest(root) == v[3] and len(set(v)) == 4
    old = {name: _files(root / name) for name in v[:2]}
    r = collect(root, keep=2)
    assert sorted(r.versions_removed) == sorted(v[:2]) and r.versions_kept == [v[3], v[2]]
    assert r.versions_held == [] and r.incomplete == [] and r.ok
    assert r.files_removed == sum(len(f) for f in old.values())
    assert r.bytes_freed == sum(sum(f.values()) for f in old.values())
    for name in v[:2]:
        assert not (root / name).exists()
    for name in v[2:]:
        _readable(root, name)
    # the root's dot-files (locks), LATEST and the readers' folder are left alone
    assert (root / "LATEST").is_file() and (root / f".{v[0]}.lock").exists() and (root / GC_LOCK).exists()
    assert (root / ".readers").is_dir()
    again = collect(root, keep=2)
    assert again.versions_removed == [] and again.files_removed == 0 and "nothing to remove" in again.format()


@pytest.mark.slow
def test_latest_is_never_removed(tmp_path):
    root = tmp_path / "ds"
    v = [_shard(tmp_path, root, seed) for seed in range(3)]
    (root / "LATEST").write_text(v[0] + "\n")  # rolled back to the oldest
    r = collect(root, keep=1)
    assert r.latest == v[0] and r.versions_kept == [v[2], v[0]] and r.versions_removed == [v[1]]
    assert (root / v[0] / MANIFEST_NAME).exists() and not (root / v[1]).exists()
    assert "(LATEST)" in r.format()
    _readable(root, v[0])
    _readable(root, v[2])
    assert open_artifact(root).root == str(root / v[0])


_HOLDER = """
import sys
from sluice.storage.artifact import open_artifact
art = open_artifact(sys.argv[1])
print("open", flush=True)
sys.stdin.read()  # until the test closes our stdin
"""


@pytest.mark.slow
def test_a_version_held_by_a_reader_in_another_process_is_skipped(tmp_path):
    root = tmp_path / "ds"
    v = [_shard(tmp_path, root, seed) for seed in range(3)]
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(root / v[0])], cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        r = collect(root, keep=1)
        assert r.versions_held == [v[0]] and r.versions_removed == [v[1]] and r.versions_kept == [v[2]]
        assert "held" in r.format() and v[0] in r.format()
        assert (root / v[0] / MANIFEST_NAME).exists() and not (root / v[1]).exists()
        _readable(root, v[0])
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    r = collect(root, keep=1)  # the reader is gone: its lease with it
    assert r.versions_removed == [v[0]] and r.versions_held == [] and not (root / v[0]).exists()


@pytest.mark.slow
def test_leases_in_this_process_last_as_long_as_the_artifact(tmp_path):
    root = tmp_path / "ds"
    v = [_shard(tmp_path, root, seed) for seed in range(3)]
    with open_artifact(root / v[0]) as art:
        assert collect(root, keep=2).versions_held == [v[0]]
    assert art._lease is None  # closed by the with block; closing again is harmless
    art.close()
    # a Loader keeps its artifact, so its lease, while it lives; garbage collection ends it
    L = Loader(root / v[0], split="train", batch_size=8, backend="memory", workers=0)
    assert collect(root, keep=2).versions_held == [v[0]]
    # a pickled copy (a spawned worker's) holds a lease of its own
    copy = pickle.loads(pickle.dumps(L.artifact))
    assert copy._lease is not None and copy._lease.fd != L.artifact._lease.fd
    del L
    pygc.collect()
    assert collect(root, keep=2).versions_held == [v[0]]
    copy.close()
    r = collect(root, keep=2)
    assert r.versions_removed == [v[0]] and r.versions_held == []
    with pytest.raises(ArtifactError, match="manifest.json is missing"):
        DatasetArtifact(root / v[0])


def test_the_lease_is_close_on_exec_and_optional(tmp_path):
    root = tmp_path / "ds"
    v = _shard(tmp_path, root, 0)
    with DatasetArtifact(root / v) as art:
        assert art._lease is not None and not os.get_inheritable(art._lease.fd)
        assert Path(art._lease.path) == reader_lock_file(root / v) == root.resolve() / ".readers" / f"{v}.lock"
    # where no lock can be made (here .readers is a plain file), the artifact is read without one
    other = tmp_path / "ro"
    w = _shard(tmp_path, other, 1)
    (other / ".readers").write_text("not a folder")
    with DatasetArtifact(other / w) as art:
        assert art._lease is None
        art.verify(deep=True)


@pytest.mark.slow
def test_kept_versions_keep_the_files_they_reuse_from_a_removed_one(tmp_path):
    """B reuses A's train split (its records point at A's files, ``version`` = A): gc removes A's
    manifest and its other files, keeps what B reads; once B goes too, A's leftovers go."""
    root = tmp_path / "ds"
    a, b = _shard(tmp_path, root, 0), _shard(tmp_path, root, 1)
    ma, mb = read_manifest(root / a), read_manifest(root / b)
    train = ma.splits["train"].model_copy(deep=True)
    for f in train.files():
        f.version = a
    mb.splits["train"] = train
    mb.parent = a
    write_manifest(root / b, mb)
    for f in read_manifest(root / b).splits["train"].files():  # B now really reads A's files
        assert f.version == a and (root / a / f.path).is_file()
    for p in (root / b / "train").iterdir():
        p.unlink()
    _readable(root, b)
    a_train = {f.path for f in ma.splits["train"].files()}
    a_files = _files(root / a)
    gone = {p: n for p, n in a_files.items() if p not in a_train}
    assert gone and MANIFEST_NAME in gone

    r = collect(root, keep=1)
    assert r.versions_removed == [a] and r.versions_kept == [b] and r.dirs_left == {a: len(a_train)}
    assert r.files_removed == len(gone) and r.bytes_freed == sum(gone.values())
    left = _files(root / a)
    assert set(left) == a_train | {REMOVED_MARKER}
    assert all(left[p] == a_files[p] for p in a_train)
    _readable(root, b)
    with pytest.raises(ArtifactError):
        open_artifact(root / a)

    # a later run keeps the leftovers while B lists them, and never takes them for a version
    again = collect(root, keep=1)
    assert again.files_removed == 0 and again.dirs_left == {a: len(a_train)} and again.incomplete == []
    _readable(root, b)

    c = _shard(tmp_path, root, 2)
    b_files = _files(root / b)
    r = collect(root, keep=1)
    assert r.versions_removed == [b] and r.versions_kept == [c] and r.dirs_left == {}
    assert not (root / a).exists() and not (root / b).exists()
    assert r.files_removed == len(b_files) + len(a_train)
    assert r.bytes_freed == sum(b_files.values()) + sum(a_files[p] for p in a_train)
    _readable(root, c)


def test_a_directory_without_manifest_is_never_touched(tmp_path):
    root = tmp_path / "ds"
    v = [_shard(tmp_path, root, seed) for seed in range(2)]
    killed = root / "0123456789abcdef"  # a run killed before its manifest: it may resume
    (killed / "train").mkdir(parents=True)
    (killed / "train" / "shard-000000.tar").write_bytes(b"x" * 1000)
    (killed / "scan.json").write_text("{}")
    os.utime(killed / "train" / "shard-000000.tar", (0, 0))  # old as the hills
    before = _files(killed)
    r = collect(root, keep=1)
    assert r.incomplete == [killed.name] and r.versions_removed == [v[0]]
    assert _files(killed) == before and "did not finish" in r.format()


@pytest.mark.slow
def test_dry_run_removes_nothing_and_reports_what_would_go(tmp_path):
    root = tmp_path / "ds"
    v = [_shard(tmp_path, root, seed) for seed in range(3)]

    def snapshot() -> dict[str, str]:
        return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in root.rglob("*") if p.is_file() and p.name != GC_LOCK}
    before = snapshot()
    dry = collect(root, keep=1, dry_run=True)
    assert snapshot() == before and not (root / ".readers").exists()
    assert dry.dry_run and sorted(dry.versions_removed) == sorted(v[:2]) and "would remove" in dry.format()
    real = collect(root, keep=1)
    assert sorted(real.versions_removed) == sorted(dry.versions_removed)
    assert (real.files_removed, real.bytes_freed) == (dry.files_removed, dry.bytes_freed) and real.bytes_freed > 0
    assert not (root / v[0]).exists()


def test_symlinks_are_never_followed_out_of_the_root(tmp_path):
    root = tmp_path / "ds"
    v = [_shard(tmp_path, root, seed) for seed in range(2)]
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "precious.txt").write_text("keep me")
    (outside / "sub" / "also.txt").write_text("keep me too")
    (root / v[0] / "train" / "link-dir").symlink_to(outside, target_is_directory=True)
    (root / v[0] / "link-file").symlink_to(outside / "precious.txt")
    (root / "elsewhere").symlink_to(outside, target_is_directory=True)  # a symlink at the root
    r = collect(root, keep=1)
    assert r.versions_removed == [v[0]] and not (root / v[0]).exists()
    assert (outside / "precious.txt").read_text() == "keep me" and (outside / "sub" / "also.txt").exists()
    assert (root / "elsewhere").is_symlink()


def test_bad_roots_and_bad_keep_are_clear_errors(tmp_path):
    root = tmp_path / "ds"
    v = [_shard(tmp_path, root, seed) for seed in range(2)]
    with pytest.raises(ArtifactError, match="does not exist"):
        collect(tmp_path / "nope")
    with pytest.raises(ArtifactError, match="not a dataset root"):
        collect(root / v[0])  # one version, not the root
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArtifactError, match="not a dataset root"):
        collect(tmp_path / "empty")
    for keep in (0, -1, True):
        with pytest.raises(ConfigError, match="keep"):
            collect(root, keep=keep)
    # a manifest that cannot be read: no telling which files it uses, so nothing is removed
    before = _files(root)
    bad = root / "feedfacefeedface"
    bad.mkdir()
    (bad / MANIFEST_NAME).write_text("{ not json")
    with pytest.raises(ArtifactError, match="cannot read"):
        collect(root, keep=1)
    assert all((root / p).exists() for p in before)


@pytest.mark.slow
def test_a_real_incremental_chain(tmp_path):
    """The shard stage's own versions on top of a parent: gc keeps what the newest one reuses."""
    root, src = tmp_path / "ds", tmp_path / "grow.npz"
    rng = np.random.default_rng(7)
    images = rng.integers(0, 256, (64, 8, 8), dtype=np.uint8)
    versions = []
    for n in (40, 48, 56):
        np.savez(src, images=images[:n], labels=np.arange(n) % 3)
        s = shard_dataset(IngestConfig(source=str(src), **INGEST), root,
                          ShardConfig(**{**WHOLE, "incremental": True}))
        versions.append(Path(s.root).name)
    newest = read_manifest(root / versions[-1])
    reused = {f.version for f in newest.files()} - {None}
    if not reused:
        pytest.skip("the shard stage wrote the version whole (no incremental writing here)")
    r = collect(root, keep=1)
    assert r.versions_kept == [versions[-1]] and sorted(r.versions_removed) == sorted(versions[:-1])
    assert set(r.dirs_left) == reused
    for f in newest.files():
        assert (root / (f.version or versions[-1]) / f.path).is_file()
    _readable(root, versions[-1])


@pytest.mark.slow
def test_the_cli_prints_the_report(tmp_path, capsys):
    root = tmp_path / "ds"
    v = [_shard(tmp_path, root, seed) for seed in range(3)]
    assert cli_main(["gc", str(root), "--keep", "2", "--dry-run", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["versions_removed"] == [v[0]] and report["dry_run"] and report["ok"]
    assert (root / v[0] / MANIFEST_NAME).exists()
    r = subprocess.run([sys.executable, "-m", "sluice.flows.cli", "gc", str(root), "--keep", "2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"sluice gc {root.resolve()}" in r.stdout and f"removed  {v[0]}" in r.stdout
    assert f"kept     {v[2]}  (LATEST)" in r.stdout and f"kept     {v[1]}" in r.stdout
    assert not (root / v[0]).exists()
    assert cli_main(["gc", str(tmp_path / "nope")]) == 2
    assert "sluice gc: error: no dataset root" in capsys.readouterr().err
