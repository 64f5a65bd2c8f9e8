"""The sharding stage: quarantine, idempotence, kill -9 resume, formats and the CLI."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import FMNIST_INGEST, ROOT, write_images
from sluice.errors import TooManyBadSamples
from sluice.stages.data.config import IngestConfig
from sluice.stages.data.shard import ShardConfig, shard_dataset
from sluice.storage.artifact import ArtifactError, open_artifact

QUIET = dict(progress=False, workers=1)


def _tar_members(path: Path) -> list[str]:
    import tarfile
    with tarfile.open(path) as t:
        return t.getnames()


def test_corrupt_images_are_quarantined_and_good_ones_kept(tmp_path):
    write_images(tmp_path / "src", n_per_class=10, fmt="jpg")
    bad = tmp_path / "src" / "cat" / "img003.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 this is not a jpeg")
    (tmp_path / "src" / "dog" / "img004.jpg").write_bytes(b"")
    s = shard_dataset(IngestConfig(source=str(tmp_path / "src"), holdout_fraction=0, val_fraction=0,
                                   test_fraction=0.2),
                      tmp_path / "out", ShardConfig(encoding="jpg", max_bad_fraction=0.2, **QUIET))
    m = s.manifest
    assert m.quarantined == 2 and sum(m.counts().values()) == 18
    q = {r.key: r for r in m.quarantine}
    assert q["cat_img003"].reason.startswith("cannot decode image") and q["cat_img003"].where == str(bad)
    assert "dog_img004" in q
    keys = [k for split in m.splits for k in open_artifact(s.root).keys(split)]
    assert "cat_img003" not in keys and len(keys) == 18
    assert "quarantined 2" in s.format()


def test_too_many_bad_samples_fails_and_leaves_nothing(tmp_path):
    np.savez(tmp_path / "d.npz", images=np.zeros((20, 4, 4), np.uint8),
             labels=np.array([0, 1] * 5 + [7] * 10), class_names=np.array(["a", "b"]))
    with pytest.raises(TooManyBadSamples) as e:
        shard_dataset(str(tmp_path / "d.npz"), tmp_path / "out", ShardConfig(max_bad_fraction=0.1, **QUIET))
    assert "10 of 20 samples" in str(e.value) and "label 7 is out of range [0, 2)" in str(e.value)
    assert not any((tmp_path / "out").glob("*/manifest.json"))
    assert not [p for p in (tmp_path / "out").glob("*") if p.is_dir()]


@pytest.mark.parametrize("labels,reason", [
    (np.array([0.0, 1.0, 2.5, 1.0]), "label 2.5 is not an integer"),
    (np.array(["0", "1", "cat", "1"]), "label 'cat' is not an integer"),
    (np.array([0, 1, -1, 1]), "label -1 is out of range [0, 2)"),
])
def test_wrong_label_types_are_quarantined(tmp_path, labels, reason):
    np.savez(tmp_path / "d.npz", images=np.arange(4 * 16, dtype=np.uint8).reshape(4, 4, 4), labels=labels)
    s = shard_dataset(IngestConfig(source=str(tmp_path / "d.npz"), holdout_fraction=0, val_fraction=0,
                                   test_fraction=0),
                      tmp_path / "out", ShardConfig(max_bad_fraction=0.5, formats=["webdataset"], **QUIET))
    assert [q.reason for q in s.manifest.quarantine] == [reason]
    assert s.manifest.splits["train"].count == 3


def test_wrong_shape_quarantined_where_fixed_shape_required(tmp_path):
    from PIL import Image
    write_images(tmp_path / "src", n_per_class=5, size=(16, 16), fmt="png")
    Image.fromarray(np.zeros((9, 9, 3), np.uint8)).save(tmp_path / "src" / "cat" / "odd.png")
    s = shard_dataset(IngestConfig(source=str(tmp_path / "src"), holdout_fraction=0, val_fraction=0,
                                   test_fraction=0),
                      tmp_path / "out", ShardConfig(encoding="npy", max_bad_fraction=0.2, **QUIET))
    (q,) = s.manifest.quarantine
    assert q.key == "cat_odd" and "shape (9, 9, 3) differs from the dataset's (16, 16, 3)" in q.reason
    # Resizing makes every sample fit.
    s2 = shard_dataset(IngestConfig(source=str(tmp_path / "src"), holdout_fraction=0, val_fraction=0,
                                    test_fraction=0),
                       tmp_path / "out", ShardConfig(encoding="npy", image_size=(16, 16), **QUIET))
    assert s2.manifest.quarantined == 0 and s2.manifest.fields.image.shape == (16, 16, 3)


def test_rerun_is_a_noop(fmnist_artifact):
    root = Path(fmnist_artifact.root)
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
    again = shard_dataset(IngestConfig(**FMNIST_INGEST), root.parent,
                          ShardConfig(shard_samples=128, progress=False, workers=1))
    assert again.reused and again.root == str(root)
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == before


def test_config_change_gives_new_version(fmnist_artifact):
    other = shard_dataset(IngestConfig(**FMNIST_INGEST), Path(fmnist_artifact.root).parent,
                          ShardConfig(shard_samples=128, encoding="png", formats=["webdataset"], **QUIET))
    assert other.manifest.fingerprint != fmnist_artifact.manifest.fingerprint
    # workers and progress do not change the bytes, so they do not change the fingerprint
    assert ShardConfig(workers=1).content_fingerprint() == ShardConfig(workers=2, progress=False).content_fingerprint()


def test_every_sample_carries_index_and_key(fmnist_artifact):
    art = open_artifact(fmnist_artifact.root)
    sh = art.manifest.splits["val"].shards[0]
    names = _tar_members(art.local(sh.tar))
    keys = art.keys("val")
    assert names[:3] == [f"{keys[0]}.npy", f"{keys[0]}.cls", f"{keys[0]}.idx"]
    lines = art.local(sh.dali_index).read_text().splitlines()
    assert lines[0] == f"v1.2 {sh.count}"
    assert lines[1].split()[3] == f"{keys[0]}.npy"


def test_dali_index_matches_wds2idx(fmnist_artifact, tmp_path):
    """Our index is byte-identical to the one DALI's own tool derives from the tar."""
    art = open_artifact(fmnist_artifact.root)
    sh = art.manifest.splits["holdout"].shards[0]
    wds2idx = Path(sys.executable).parent / "wds2idx"
    subprocess.run([str(wds2idx), str(art.local(sh.tar)), str(tmp_path / "ref.idx")], check=True,
                   capture_output=True)
    assert (tmp_path / "ref.idx").read_text() == art.local(sh.dali_index).read_text()


KILL_SCRIPT = """
import sys
from sluice.stages.data.config import IngestConfig
from sluice.stages.data.shard import ShardConfig, shard_dataset
s = shard_dataset(IngestConfig(source="fashion-mnist", limit=int(sys.argv[2])), sys.argv[1],
                  ShardConfig(shard_samples=200, workers=1, progress=False))
print("REUSED", s.shards_reused, "WRITTEN", s.shards_written)
"""


@pytest.mark.slow
def test_kill_9_then_rerun_resumes_without_redoing_shards(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-c", KILL_SCRIPT, str(out), "6000"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and len(list(out.glob("*/*/shard-*.tar.done.json"))) < 3:
        time.sleep(0.02)
    p.send_signal(signal.SIGKILL)
    p.wait()
    # a shard counts as done once its completion record is written (storage/part_records.py)
    done_before = [r.with_name(r.name[:-len(".done.json")]) for r in sorted(out.glob("*/*/shard-*.tar.done.json"))]
    assert len(done_before) >= 3
    version = next(p for p in out.iterdir() if p.is_dir())
    assert not (version / "manifest.json").exists()
    with pytest.raises(ArtifactError, match="missing"):
        open_artifact(version)
    mtimes = {p: p.stat().st_mtime_ns for p in done_before}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    reused = int(r.stdout.split()[1])
    assert reused >= len(done_before)
    assert all(p.stat().st_mtime_ns == t for p, t in mtimes.items())
    art = open_artifact(out)
    art.verify()
    assert not list(version.rglob(".tmp-*"))
    assert sum(art.manifest.counts().values()) == 12000  # limit applies to each source split


def test_reshard_from_webdataset_shards(fmnist_artifact, tmp_path):
    art = open_artifact(fmnist_artifact.root)
    train_dir = art.local(art.manifest.splits["train"].shards[0].tar).parent
    s = shard_dataset(IngestConfig(source=str(train_dir), holdout_fraction=0, val_fraction=0,
                                   test_fraction=0, num_classes=10),
                      tmp_path / "re", ShardConfig(formats=["webdataset"], **QUIET))
    re = open_artifact(s.root)
    assert re.manifest.source.kind == "webdataset"
    assert re.keys("train") == art.keys("train")
    assert (re.labels("train") == art.labels("train")).all()


def test_truncated_webdataset_shard_fails_unless_its_readable_part_is_wanted(fmnist_artifact, tmp_path):
    """A truncated shard is refused, naming it; with ingest.keep_damaged the samples before the
    cut are kept and the damage is recorded in the manifest and the summary."""
    from sluice.errors import SourceError
    art = open_artifact(fmnist_artifact.root)
    tar = art.local(art.manifest.splits["train"].shards[0].tar)
    cut = tmp_path / "cut.tar"
    cut.write_bytes(tar.read_bytes()[: 1536 * 3 * 40 + 700])  # mid-way through a member
    ingest = dict(source=str(cut), holdout_fraction=0, val_fraction=0, test_fraction=0, num_classes=10)
    cfg = ShardConfig(formats=["webdataset"], max_bad_fraction=0.1, **QUIET)
    with pytest.raises(SourceError, match="cut.tar: damaged WebDataset shard .*keep_damaged"):
        shard_dataset(IngestConfig(**ingest), tmp_path / "re", cfg)
    assert not (tmp_path / "re").exists()
    s = shard_dataset(IngestConfig(**ingest, keep_damaged=True), tmp_path / "re", cfg)
    m = s.manifest
    assert m.splits["train"].count >= 39
    assert all("truncated" in q.reason or "no label" in q.reason for q in m.quarantine)
    (d,) = m.damaged_sources
    assert d.where == str(cut) and "kept the" in d.reason
    assert f"DAMAGED SOURCE {cut}" in s.format()


def test_cli_shard_prints_summary(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("ingest:\n  limit: 200\nshard:\n  formats: [webdataset, dali]\n  workers: 1\n")
    r = subprocess.run([sys.executable, "-m", "sluice.flows.cli", "shard", "fashion-mnist", "--out", str(tmp_path / "o"),
                        "--config", str(cfg), "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for word in ("train", "holdout", "val", "test", "quarantined 0", "shards written"):
        assert word in r.stdout
    bad = subprocess.run([sys.executable, "-m", "sluice.flows.cli", "shard", "fashion-mnist", "--out", str(tmp_path / "o"),
                          "--set", "shard.shard_samples=zero"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "shard.shard_samples" in bad.stderr


@pytest.mark.slow
def test_shard_map_can_run_elsewhere(tmp_path):
    """The shard writes can be handed to any executor (here a spawn process pool, which shares
    nothing with this process): the artifact is the same as the local pool's."""
    import concurrent.futures as cf
    import multiprocessing as mp
    from sluice.stages.data.shard import write_shard_from_spec
    ing = IngestConfig(source="fashion-mnist", limit=400)
    cfg = ShardConfig(shard_samples=100, formats=["webdataset", "dali"], progress=False, workers=1)

    def on_pool(spec, tasks):
        with cf.ProcessPoolExecutor(2, mp_context=mp.get_context("spawn")) as ex:
            return list(ex.map(write_shard_from_spec, [spec] * len(tasks), tasks))
    a = shard_dataset(ing, tmp_path / "a", cfg, map_shards=on_pool)
    b = shard_dataset(ing, tmp_path / "b", cfg)
    assert a.shards_written == b.shards_written == 10  # train 4, holdout 1, val 1, test 4
    assert [f.sha256 for f in a.manifest.files()] == [f.sha256 for f in b.manifest.files()]


@pytest.mark.slow
def test_pool_workers_do_not_run_the_parents_sigterm_handler(tmp_path, capfd):
    """Prefect installs a SIGTERM handler; shard pool workers are forked and then terminated,
    and must die quietly instead of printing the inherited handler's traceback."""
    def noisy(signum, frame):
        os.write(2, b"PARENT-HANDLER-RAN\n")
        raise SystemExit(1)

    old = signal.signal(signal.SIGTERM, noisy)
    try:
        write_images(tmp_path / "src", n_per_class=8, fmt="png")
        shard_dataset(IngestConfig(source=str(tmp_path / "src"), holdout_fraction=0,
                                   val_fraction=0, test_fraction=0.25),
                      tmp_path / "out", ShardConfig(shard_samples=4, progress=False, workers=2))
        time.sleep(0.5)  # terminated workers write (or not) as they exit
    finally:
        signal.signal(signal.SIGTERM, old)
    assert "PARENT-HANDLER-RAN" not in capfd.readouterr().err
