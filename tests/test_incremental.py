"""Incremental versions: a grown or changed source is written on top of the newest
version; only new and changed samples are written, every backend reads the result as if it were
whole, and a removed sample is never yielded again."""
from __future__ import annotations

import json

import numpy as np
import pytest

from sluice.stages.data.config import IngestConfig, ShardConfig
from sluice.stages.data.shard import shard_dataset
from sluice.stages.data.verify import verify_artifact
from sluice.stages.load import Loader
from sluice.storage.artifact import DatasetArtifact
from sluice.storage.manifest import read_manifest

N = 900
BACKENDS = ["memory", "webdataset", "dali", "ffcv"]


def _images(n: int = 1200, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 8, 8, 1), dtype=np.uint8), rng.integers(0, 10, n)


def _write(path, x, y, keys) -> str:
    np.savez(path, images=x, labels=y, keys=np.array([f"s{k}" for k in keys]))
    return str(path)


CFG = ShardConfig(workers=1, progress=False, shard_samples=150)


@pytest.fixture(scope="module")
def grown(tmp_path_factory):
    """Night 0: the first 700 samples. Night 1: 200 more, one deleted, one changed, one relabelled."""
    d = tmp_path_factory.mktemp("inc")
    x, y = _images()
    out = d / "out"
    first = shard_dataset(IngestConfig(source=_write(d / "n0.npz", x[:700], y[:700], range(700))), out, CFG)
    x1, y1 = x.copy(), y.copy()
    x1[5] = 255 - x1[5]  # s5's pixels change
    y1[7] = (y1[7] + 3) % 10  # s7 is relabelled
    keep = [k for k in range(N) if k != 3]  # s3 is deleted
    second = shard_dataset(IngestConfig(source=_write(d / "n0.npz", x1[keep], y1[keep], keep)), out, CFG)
    return {"first": first, "second": second, "x": x1, "y": y1, "keep": keep, "out": out, "dir": d}


def test_child_names_its_parent_and_delta(grown):
    first, second = grown["first"], grown["second"]
    m = second.manifest
    assert not second.reused and m.parent == first.root.rsplit("/", 1)[-1]
    assert sorted(m.delta.removed) == ["s3"] and m.delta.changed == ["s5"] and m.delta.relabelled == ["s7"]
    assert sum(m.delta.added.values()) == N - 700
    # every parent file is reused as it is; the child's own files are the new samples' and the small ones
    parent_files = {f.path: f for f in first.manifest.files()}
    for f in m.files():
        if f.version is not None:
            assert f.version == m.parent and parent_files[f.path].sha256 == f.sha256
    own = {f.path.rsplit("/", 1)[-1] for f in m.own_files()}
    assert "data.beton" not in own and not any(p.startswith("shard-000000") for p in own)
    assert m.delta.written_bytes < 0.5 * first.manifest.total_bytes()
    # the split index space is the parent's with the new samples appended
    for split, rec in m.splits.items():
        old = first.manifest.splits[split]
        assert rec.count >= old.count
        assert DatasetArtifact(second.root).keys(split)[:old.count] == DatasetArtifact(first.root).keys(split)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.slow
def test_every_backend_yields_the_source_as_it_is_now(grown, backend):
    """Each live sample's pixels and label are the source's now (the relabel and the changed
    pixels included); removed and replaced samples never come out."""
    art = DatasetArtifact(grown["second"].root)
    x, y, keep = grown["x"], grown["y"], set(grown["keep"])
    seen = []
    for split in ("train", "val"):
        keys = art.keys(split)
        loader = Loader(art, split=split, batch_size=64, backend=backend, drop_last=False,
                        augment={"ops": []}, sampler={"kind": "shuffle", "seed": 1})
        got = 0
        for imgs, labels, idx in loader:
            for img, lab, i in zip(imgs.numpy(), labels.numpy(), idx.numpy()):
                k = int(keys[i][1:])
                assert k in keep, f"{keys[i]} was deleted but {backend} yielded it"
                assert int(lab) == int(y[k]), f"{keys[i]}: label {lab}, the source says {y[k]}"
                assert np.array_equal(np.rint(img[0] * 255).astype(np.uint8) if img.dtype != np.uint8 else img[0],
                                      x[k][..., 0]), f"{keys[i]}: pixels differ from the source ({backend})"
                seen.append(keys[i])
                got += 1
        assert got == art.manifest.split(split).live_count
    assert len(seen) == len(set(seen)), "a key was yielded twice in one epoch"
    assert "s5" in seen or "s5" not in {k for s in ("train", "val") for k in art.keys(s)}


def test_removed_index_is_in_no_order_at_any_world_size(grown):
    art = DatasetArtifact(grown["second"].root)
    for split, rec in art.manifest.splits.items():
        if not rec.removed:
            continue
        for world in (1, 3):
            for kind in ("sequential", "shuffle", "shard_block"):
                order = np.concatenate([Loader(art, split=split, batch_size=16, backend="memory", rank=r,
                                               world_size=world, sampler={"kind": kind}).epoch_indices(0)
                                        for r in range(world)])
                assert not set(order.tolist()) & set(rec.removed), (split, world, kind)
                assert set(order.tolist()) == set(art.live(split).tolist())


def test_verify_checks_a_child_through_its_parents_files(grown):
    report = verify_artifact(grown["second"].root, full=True)
    assert not report.damaged, report.format()
    assert report.samples > 0


def test_same_source_again_is_a_no_op(grown):
    x, y, keep = grown["x"], grown["y"], grown["keep"]
    again = shard_dataset(IngestConfig(source=_write(grown["dir"] / "n0.npz", x[keep], y[keep], keep)),
                          grown["out"], CFG)
    assert again.reused and again.root == grown["second"].root


def test_a_relabel_back_drops_the_relabel_record(tmp_path):
    x, y = _images(320)
    out = tmp_path / "out"
    src = tmp_path / "s.npz"
    shard_dataset(IngestConfig(source=_write(src, x[:300], y[:300], range(300))), out, CFG)
    y2 = y.copy()
    y2[:20] = (y2[:20] + 1) % 10
    b = shard_dataset(IngestConfig(source=_write(src, x[:300], y2[:300], range(300))), out, CFG)
    assert len(b.manifest.delta.relabelled) == 20 and sum(len(s.relabelled) for s in b.manifest.splits.values()) == 20
    c = shard_dataset(IngestConfig(source=_write(src, x, y, range(320))), out, CFG)  # labels back, 20 more
    assert c.manifest.parent == b.root.rsplit("/", 1)[-1] and len(c.manifest.delta.relabelled) == 20
    assert all(not s.relabelled for s in c.manifest.splits.values())
    old = {f.path for f in b.manifest.files() if f.path.endswith((".tar", ".beton"))}
    assert old and all(f.version is not None for f in c.manifest.files() if f.path in old)


@pytest.mark.slow
def test_unusable_parent_means_a_whole_version_with_the_reason(tmp_path):
    x, y = _images(400)
    out = tmp_path / "out"
    src = tmp_path / "s.npz"
    a = shard_dataset(IngestConfig(source=_write(src, x[:300], y[:300], range(300))), out, CFG)
    (out / a.root.rsplit("/", 1)[-1] / "train" / "labels.npy").write_bytes(b"garbage")
    b = shard_dataset(IngestConfig(source=_write(src, x, y, range(400))), out, CFG)
    assert b.manifest.parent is None and b.manifest.delta is None
    assert "damaged" in b.manifest.parent_refused and "written whole" in b.format()
    assert all(f.version is None for f in b.manifest.files())
    assert (out / a.root.rsplit("/", 1)[-1] / "manifest.json").exists()  # the parent stays until gc
    # another encoding: refused with the reason, not mixed
    c = shard_dataset(IngestConfig(source=_write(src, x, y, range(400))), out,
                      CFG.model_copy(update={"encoding": "png"}))
    assert c.manifest.parent is None and "encoded differently" in c.manifest.parent_refused


@pytest.mark.slow
def test_a_missing_parent_or_ancestor_means_a_whole_version_with_the_reason(tmp_path):
    """LATEST names a version whose directory is gone, or a version whose reused files lay in an
    ancestor deleted by hand: the next version is written whole, saying why; nothing is half-read."""
    import shutil
    from sluice.errors import ArtifactError
    x, y = _images(500)
    out = tmp_path / "out"
    src = tmp_path / "s.npz"
    a = shard_dataset(IngestConfig(source=_write(src, x[:300], y[:300], range(300))), out, CFG)
    b = shard_dataset(IngestConfig(source=_write(src, x[:400], y[:400], range(400))), out, CFG)
    assert b.manifest.parent == a.root.rsplit("/", 1)[-1]
    shutil.rmtree(out / b.manifest.parent)  # the ancestor b reads its old samples from
    with pytest.raises(ArtifactError, match=a.root.rsplit("/", 1)[-1]):
        DatasetArtifact(b.root).verify(deep=False)  # a clear error naming where the missing file was
    c = shard_dataset(IngestConfig(source=_write(src, x, y, range(500))), out, CFG)
    assert c.manifest.parent is None and "written whole" in c.manifest.parent_refused
    assert sum(c.manifest.counts().values()) == 500 and verify_artifact(c.root).ok
    shutil.rmtree(c.root)  # LATEST now names a directory that is gone
    d = shard_dataset(IngestConfig(source=_write(src, x, y, range(500))), out, CFG)
    assert d.manifest.parent is None and "unreadable" in d.manifest.parent_refused
    assert verify_artifact(d.root).ok


@pytest.mark.slow
def test_incremental_off_writes_whole_versions(tmp_path):
    x, y = _images(400)
    out = tmp_path / "out"
    src = tmp_path / "s.npz"
    off = CFG.model_copy(update={"incremental": False})
    shard_dataset(IngestConfig(source=_write(src, x[:300], y[:300], range(300))), out, off)
    b = shard_dataset(IngestConfig(source=_write(src, x, y, range(400))), out, off)
    assert b.manifest.parent is None and b.manifest.parent_refused is None
    assert all(f.version is None for f in b.manifest.files())


def test_older_sluice_refuses_a_child_manifest(grown):
    """extra=forbid: a reader that does not know ``removed`` must not read the child unchecked."""
    data = json.loads((grown["out"] / grown["second"].root.rsplit("/", 1)[-1] / "manifest.json").read_text())
    assert data["parent"] and any(s["removed"] for s in data["splits"].values())
    assert read_manifest(grown["second"].root).parent == data["parent"]


def test_a_larger_limit_on_the_same_file_is_a_new_version(tmp_path):
    """``ingest.limit`` reveals more of an unchanged file: new samples, not the old version again."""
    x, y = _images(500)
    src = _write(tmp_path / "s.npz", x, y, range(500))
    out = tmp_path / "out"
    a = shard_dataset(IngestConfig(source=src, limit=300), out, CFG)
    b = shard_dataset(IngestConfig(source=src, limit=500), out, CFG)
    assert not b.reused and b.root != a.root and b.manifest.parent == a.root.rsplit("/", 1)[-1]
    assert sum(b.manifest.delta.added.values()) == 200 and not b.manifest.delta.removed
    again = shard_dataset(IngestConfig(source=src, limit=500), out, CFG)
    assert again.reused and again.root == b.root
