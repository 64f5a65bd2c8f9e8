"""The artifact read back by each library's own reader: every sample bit-exact, in manifest
order, with the right label and index. These are the real readers, not ours."""
from __future__ import annotations

from conftest import FMNIST_INGEST

import io

import numpy as np

from sluice.stages.data.config import IngestConfig
from sluice.stages.data.ingest import open_source
from sluice.stages.data.split import plan_splits
from sluice.stages.data.shard import ShardConfig, shard_dataset
from sluice.storage.artifact import open_artifact

SPLIT = "val"


def _expected(split: str, limit: int = 600):
    """Source pixels and labels for ``split``, in manifest order (straight from the IDX files)."""
    src = open_source("fashion-mnist")
    plan = plan_splits(src, IngestConfig(**{**FMNIST_INGEST, "limit": limit}))[split]
    imgs = np.stack([src.load(sp, i).array for sp, i in plan])
    labels = np.array([int(src.load(sp, i).label) for sp, i in plan])
    return imgs, labels


def _shard_paths(art, split):
    s = art.manifest.splits[split]
    return [str(art.local(sh.tar)) for sh in s.shards], [str(art.local(sh.dali_index)) for sh in s.shards]


def test_webdataset_reads_artifact_bit_exact(fmnist_artifact):
    import webdataset as wds
    art = open_artifact(fmnist_artifact.root)
    tars, _ = _shard_paths(art, SPLIT)
    imgs, labels = _expected(SPLIT)
    ds = wds.WebDataset(tars, shardshuffle=False)  # no decoders: bytes only, nothing unpickled
    got = list(ds)
    assert len(got) == len(labels) == art.manifest.splits[SPLIT].count
    keys = art.keys(SPLIT)
    for n, sample in enumerate(got):
        assert sample["__key__"] == keys[n]
        assert np.array_equal(np.load(io.BytesIO(sample["npy"]), allow_pickle=False), imgs[n])
        assert int(sample["cls"]) == labels[n]
        assert int.from_bytes(sample["idx"], "little") == n


def test_dali_reads_artifact_with_index_files(fmnist_artifact):
    from nvidia.dali import fn, pipeline_def, types
    art = open_artifact(fmnist_artifact.root)
    tars, idxs = _shard_paths(art, SPLIT)
    imgs, labels = _expected(SPLIT)
    n = len(labels)

    @pipeline_def(batch_size=32, num_threads=1, device_id=None)
    def pipe():
        img, cls, idx = fn.readers.webdataset(paths=tars, index_paths=idxs, ext=["npy", "cls", "idx"],
                                              dtypes=[types.UINT8, types.UINT8, types.INT64],
                                              random_shuffle=False, name="r")
        return img, cls, idx
    p = pipe()
    p.build()
    seen = []
    while len(seen) < n:
        img_b, cls_b, idx_b = p.run()
        for k in range(len(img_b)):
            seen.append((np.array(img_b.at(k)), np.array(cls_b.at(k)), np.array(idx_b.at(k))))
    for k in range(n):
        raw, cls, idx = seen[k]
        assert np.array_equal(np.load(io.BytesIO(raw.tobytes()), allow_pickle=False), imgs[k])
        assert int(bytes(cls).decode()) == labels[k]
        assert int(idx[0]) == k


def test_ffcv_loader_reads_artifact(fmnist_artifact):
    from ffcv.fields.basics import IntDecoder
    from ffcv.fields.ndarray import NDArrayDecoder
    from ffcv.loader import Loader, OrderOption
    art = open_artifact(fmnist_artifact.root)
    imgs, labels = _expected(SPLIT)
    loader = Loader(str(art.local(art.manifest.splits[SPLIT].ffcv)), batch_size=50, num_workers=1,
                    order=OrderOption.SEQUENTIAL, drop_last=False,
                    pipelines={"image": [NDArrayDecoder()], "label": [IntDecoder()],
                               "index": [IntDecoder()], "key": None})
    got_i, got_l, got_x = [], [], []
    for x, y, idx in loader:
        got_x.append(np.array(x))
        got_l.append(np.array(y).reshape(-1))
        got_i.append(np.array(idx).reshape(-1))
    assert np.array_equal(np.concatenate(got_i), np.arange(len(labels)))
    assert np.array_equal(np.concatenate(got_l), labels)
    assert np.array_equal(np.concatenate(got_x), imgs)


def test_png_encoding_is_lossless_and_jpg_is_close(tmp_path):
    import webdataset as wds
    from PIL import Image
    imgs, labels = _expected("holdout", limit=200)
    for enc in ("png", "jpg"):
        s = shard_dataset(IngestConfig(**{**FMNIST_INGEST, "limit": 200}), tmp_path / enc,
                          ShardConfig(encoding=enc, formats=["webdataset", "dali"], progress=False, workers=1))
        art = open_artifact(s.root)
        tars, _ = _shard_paths(art, "holdout")
        for n, sample in enumerate(wds.WebDataset(tars, shardshuffle=False)):
            px = np.asarray(Image.open(io.BytesIO(sample[enc])))[:, :, None]
            if enc == "png":
                assert np.array_equal(px, imgs[n])
            else:
                assert np.abs(px.astype(int) - imgs[n]).mean() < 12
            assert int(sample["cls"]) == labels[n]
