"""Sources and splits: each kind of bad input gets an error naming the file and the problem."""
from __future__ import annotations

import gzip

import numpy as np
import pytest

from sluice.errors import SourceError
from sluice.stages.data.config import IngestConfig
from sluice.stages.data.ingest import open_source
from sluice.stages.data.sources.webdataset import expand_braces
from sluice.stages.data.split import plan_splits


def _idx(path, arr: np.ndarray, code=0x08, gz=True, dims=None):
    dims = arr.shape if dims is None else dims
    raw = bytes([0, 0, code, len(dims)]) + b"".join(int(d).to_bytes(4, "big") for d in dims) + arr.tobytes()
    path.write_bytes(gzip.compress(raw) if gz else raw)


def _idx_pair(root, n_img=10, n_lab=10, gz=True, prefix="train"):
    rng = np.random.default_rng(0)
    _idx(root / f"{prefix}-images-idx3-ubyte{'.gz' if gz else ''}", rng.integers(0, 255, (n_img, 28, 28), np.uint8), gz=gz)
    _idx(root / f"{prefix}-labels-idx1-ubyte{'.gz' if gz else ''}", rng.integers(0, 10, n_lab).astype(np.uint8), gz=gz)


def test_fashion_mnist_named_source():
    src = open_source("fashion-mnist")
    assert src.split_sizes() == {"train": 60000, "test": 10000}
    assert src.num_classes() == 10 and src.class_names()[0] == "T-shirt/top"
    s = src.load("test", 3)
    assert s.array.shape == (28, 28, 1) and s.array.dtype == np.uint8


@pytest.mark.parametrize("gz", [True, False])
def test_idx_plain_and_gzip(tmp_path, gz):
    _idx_pair(tmp_path, gz=gz)
    src = open_source(str(tmp_path))
    assert src.kind == "idx" and src.split_sizes() == {"train": 10}


def test_idx_header_disagrees_with_size(tmp_path):
    _idx_pair(tmp_path)
    arr = np.zeros((10, 28, 28), np.uint8)
    _idx(tmp_path / "train-images-idx3-ubyte.gz", arr, dims=(12, 28, 28))
    with pytest.raises(SourceError, match=r"train-images-idx3-ubyte.gz: IDX header says shape \(12, 28, 28\)"):
        open_source(str(tmp_path))


def test_idx_image_and_label_counts_differ(tmp_path):
    _idx_pair(tmp_path, n_img=10, n_lab=9)
    with pytest.raises(SourceError, match="holds 10 images but train-labels-idx1-ubyte.gz holds 9 labels"):
        open_source(str(tmp_path))


def test_idx_truncated_gzip(tmp_path):
    _idx_pair(tmp_path)
    p = tmp_path / "train-images-idx3-ubyte.gz"
    p.write_bytes(p.read_bytes()[:200])
    with pytest.raises(SourceError, match="not valid gzip"):
        open_source(str(tmp_path))


def test_missing_path():
    with pytest.raises(SourceError, match="source not found: /no/such/place"):
        open_source("/no/such/place")


def test_empty_sources(tmp_path):
    (tmp_path / "folder" / "cat").mkdir(parents=True)
    with pytest.raises(SourceError, match="is empty"):
        open_source(str(tmp_path / "folder"))
    (tmp_path / "bare").mkdir()
    with pytest.raises(SourceError, match="one sub-folder per class"):
        open_source(IngestConfig(source=str(tmp_path / "bare"), kind="folder"))
    np.savez(tmp_path / "e.npz", images=np.zeros((0, 4, 4), np.uint8), labels=np.zeros(0, np.int64))
    with pytest.raises(SourceError, match="is empty"):
        open_source(str(tmp_path / "e.npz"))


def test_npz_refuses_pickled_arrays_and_mismatch(tmp_path):
    np.savez(tmp_path / "obj.npz", images=np.array([object()], dtype=object), labels=np.zeros(1))
    with pytest.raises(SourceError, match="unpickling"):
        open_source(str(tmp_path / "obj.npz"))
    np.savez(tmp_path / "m.npz", images=np.zeros((3, 4, 4), np.uint8), labels=np.zeros(2, np.int64))
    with pytest.raises(SourceError, match="holds 3 images but 'labels' holds 2"):
        open_source(str(tmp_path / "m.npz"))


def _npz(path, n, keys=None, **extra):
    arrays = {"images": np.arange(n * 16, dtype=np.uint8).reshape(n, 4, 4), "labels": np.arange(n) % 3, **extra}
    if keys is not None:
        arrays["keys"] = np.asarray(keys)
    np.savez(path, **arrays)
    return open_source(str(path))


def test_npz_keys_are_stable_sanitised_and_positional_by_default(tmp_path):
    assert _npz(tmp_path / "p.npz", 3).describe("train", 2)[0] == "train-000002"
    src = _npz(tmp_path / "k.npz", 3, keys=["fm-7", "fm 8/x.png", "fm-9"],
               test_images=np.zeros((2, 4, 4), np.uint8), test_labels=np.zeros(2, np.int64),
               test_keys=np.asarray(["t-0", "t-1"]))
    assert [src.describe("train", i)[0] for i in range(3)] == ["fm-7", "fm_8_x_png", "fm-9"]
    assert src.load("train", 1).key == "fm_8_x_png" and src.load("test", 1).key == "t-1"
    assert "k.npz[train][1]" in src.describe("train", 1)[1]


def test_npz_keys_refused_when_repeated_mismatched_or_not_strings(tmp_path):
    with pytest.raises(SourceError, match=r"d\.npz: 'keys' repeats the key 'a_b' .* at samples 0 and 2"):
        _npz(tmp_path / "d.npz", 3, keys=["a.b", "c", "a/b"])
    with pytest.raises(SourceError, match=r"n\.npz: 'keys' holds 2 keys for 3 samples"):
        _npz(tmp_path / "n.npz", 3, keys=["a", "b"])
    with pytest.raises(SourceError, match=r"i\.npz: 'keys' must be a 1-D array of strings"):
        _npz(tmp_path / "i.npz", 3, keys=np.arange(3))
    with pytest.raises(SourceError, match=r"t\.npz: has 'test_keys' but no test split"):
        _npz(tmp_path / "t.npz", 3, keys=["a", "b", "c"], test_keys=np.asarray(["x"]))
    with pytest.raises(SourceError, match=r"s\.npz: 'keys' and 'test_keys' share 1 key"):
        _npz(tmp_path / "s.npz", 2, keys=["a", "b"], test_images=np.zeros((1, 4, 4), np.uint8),
             test_labels=np.zeros(1, np.int64), test_keys=np.asarray(["b"]))


def test_deleting_an_npz_sample_keeps_every_other_sample_in_its_split(tmp_path):
    """With stable keys a deletion re-keys nothing, so no later sample changes split (with
    positional keys, every sample after the deleted one would take its neighbour's key)."""
    n, gone = 2000, 700
    keys = [f"fm-{i}" for i in range(n)]
    cfg = IngestConfig(source=str(tmp_path / "d.npz"))

    def by_key(src) -> dict[str, str]:
        return {src.describe(sp, i)[0]: split for split, xs in plan_splits(src, cfg).items() for sp, i in xs}
    before = by_key(_npz(tmp_path / "d.npz", n, keys=keys))
    images = np.delete(np.arange(n * 16, dtype=np.uint8).reshape(n, 4, 4), gone, axis=0)
    np.savez(tmp_path / "d.npz", images=images, labels=np.delete(np.arange(n) % 3, gone),
             keys=np.asarray(keys[:gone] + keys[gone + 1:]))
    after = by_key(open_source(cfg))
    assert "fm-700" not in after and len(after) == n - 1
    assert all(after[k] == split for k, split in before.items() if k != "fm-700")
    assert len({s for k, s in after.items() if int(k[3:]) > gone}) > 1  # the later samples spread over splits


def test_splits_are_deterministic_disjoint_and_complete():
    src = open_source("fashion-mnist")
    cfg = IngestConfig(limit=1000, seed=7)
    a, b = plan_splits(src, cfg), plan_splits(src, cfg)
    assert a == b
    sizes = {k: len(v) for k, v in a.items()}
    assert 60 <= sizes["holdout"] <= 140 and 60 <= sizes["val"] <= 140 and sizes["test"] == 1000
    from_train = [x for s in ("train", "holdout", "val") for x in a[s]]
    assert sorted(from_train) == [("train", i) for i in range(1000)]
    assert plan_splits(src, IngestConfig(limit=1000, seed=8))["holdout"] != a["holdout"]


def _membership(plan) -> dict:
    return {x: split for split, xs in plan.items() for x in xs}


def test_growth_never_moves_a_sample_between_splits():
    """The night's new samples get splits of their own; every existing sample keeps its
    split, so yesterday's training samples never reach today's val."""
    src = open_source("fashion-mnist")
    before = _membership(plan_splits(src, IngestConfig(limit=5000)))
    after = _membership(plan_splits(src, IngestConfig(limit=6000)))
    assert all(after[x] == split for x, split in before.items())
    assert len(after) == len(before) + 1000 + 1000  # 1,000 more of each source split


def test_turning_the_holdout_on_never_changes_val():
    """RHO-LOSS on (holdout 0.1) or off (0): samples move only between train and holdout."""
    src = open_source("fashion-mnist")
    off = plan_splits(src, IngestConfig(limit=3000, holdout_fraction=0.0))
    on = plan_splits(src, IngestConfig(limit=3000, holdout_fraction=0.1))
    assert on["val"] == off["val"] and not off["holdout"] and on["holdout"]
    assert set(on["holdout"]) <= set(off["train"])


def test_a_folder_source_that_grows_and_loses_files_keeps_every_split(tmp_path):
    from PIL import Image
    for c in ("a", "b"):
        (tmp_path / c).mkdir()
        for i in range(60):
            Image.new("L", (4, 4), i).save(tmp_path / c / f"{i:03d}.png")
    cfg = IngestConfig(source=str(tmp_path))

    def by_key() -> dict[str, str]:
        src = open_source(cfg)
        return {src.describe(sp, i)[0]: split for split, xs in plan_splits(src, cfg).items() for sp, i in xs}
    before = by_key()
    for i in range(60, 90):  # new files sort between and after the old ones
        Image.new("L", (4, 4), i).save(tmp_path / "a" / f"{i:03d}.png")
    (tmp_path / "b" / "007.png").unlink()  # a deletion request
    after = by_key()
    assert "b_007" not in after and len(after) == len(before) + 29
    assert all(after[k] == split for k, split in before.items() if k != "b_007")


def test_source_without_test_split_gets_one(tmp_path):
    np.savez(tmp_path / "d.npz", images=np.zeros((1000, 4, 4), np.uint8), labels=np.arange(1000) % 3)
    plan = plan_splits(open_source(str(tmp_path / "d.npz")), IngestConfig())
    sizes = {k: len(v) for k, v in plan.items()}
    assert sum(sizes.values()) == 1000 and all(60 <= sizes[s] <= 140 for s in ("holdout", "val", "test"))


def test_bad_fractions_refused():
    with pytest.raises(ValueError, match="must be < 1"):
        IngestConfig(holdout_fraction=0.5, val_fraction=0.5)


def test_brace_expansion():
    assert expand_braces("s-{00..02}.tar") == ["s-00.tar", "s-01.tar", "s-02.tar"]
    assert expand_braces("{a,b}/x-{1..2}") == ["a/x-1", "a/x-2", "b/x-1", "b/x-2"]
