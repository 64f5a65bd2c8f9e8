"""Photos through the front door (issue #48): a folder of JPEG/PNG/WebP photos of any size and
mode, sharded with nothing set (``encoding: auto``), keeps each JPEG's bytes, turns gray into
RGB, composites transparency onto white, applies EXIF rotation, re-encodes what is not JPEG and
quarantines what does not decode; records each sample's size and the train split's statistics
(also across incremental versions); refuses empty and too small classes; keeps old
fingerprints; sizes the .beton's pages to the photos; and reads through the webdataset and ffcv
backends with a random resized crop. The photos are Fashion-MNIST's (``fashion_photos``)."""
from __future__ import annotations

import importlib.util
import io
import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from conftest import write_images
from sluice.errors import SourceError
from sluice.stages.data import fashion_photos as fp
from sluice.stages.data.config import IngestConfig, ShardConfig, auto_encoding
from sluice.stages.data.formats import beton
from sluice.stages.data.ingest import open_source
from sluice.stages.data.shard import shard_dataset
from sluice.stages.data.sources.base import sanitize_key
from sluice.stages.data.stats import image_stats
from sluice.storage.artifact import open_artifact
from sluice.storage.fingerprint import hash_obj

QUIET = dict(progress=False, workers=1)
N = 120  # 12 a class: enough for the default split fractions (10 a class)


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    return fp.make_fashion_photos(tmp_path_factory.mktemp("photos") / "fashion", n=N, seed=3, messy=True)


@pytest.fixture(scope="module")
def art(photos, tmp_path_factory):
    """The messy folder sharded with every setting at its default."""
    s = shard_dataset(str(photos), tmp_path_factory.mktemp("art"))
    return open_artifact(s.root)


def _files_by_key(folder: Path) -> dict[str, Path]:
    return {sanitize_key(f"{p.parent.name}_{p.stem}"): p for p in folder.glob("*/*") if p.is_file()}


def _messy(folder: Path) -> dict[str, dict]:
    """key -> what .complete says of each messy file."""
    return {sanitize_key(Path(m["path"]).parent.name + "_" + Path(m["path"]).stem): m
            for m in fp.info(folder)["messy_files"]}


def _stored(art) -> dict[str, tuple[str, int, bytes]]:
    """key -> (split, split index, stored image bytes), from the tar shards."""
    out = {}
    enc = art.manifest.fields.image.encoding
    for split, rec in art.manifest.splits.items():
        for sh in rec.shards:
            with tarfile.open(art.local(sh.tar)) as t:
                images = [m for m in t if m.name.endswith("." + enc)]
                for k, m in enumerate(images):
                    out[m.name.rsplit(".", 1)[0]] = (split, sh.first_index + k, t.extractfile(m).read())
    return out


def _decode(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB")).astype(np.int16)


def _upright(path: Path) -> np.ndarray:
    """A numpy reference of what a photo looks like: EXIF rotation applied, transparency
    composited onto white, RGB."""
    with Image.open(path) as im:
        im = ImageOps.exif_transpose(im)
        if im.mode in ("RGBA", "LA", "P") and (im.mode != "P" or "transparency" in im.info):
            rgba = np.asarray(im.convert("RGBA")).astype(np.float64)
            a = rgba[:, :, 3:] / 255
            return np.rint(rgba[:, :, :3] * a + 255 * (1 - a)).astype(np.uint8)
        return np.asarray(im.convert("RGB"))


# ------------------------------------------------------------------ what is stored

def test_auto_stores_photos_as_jpeg_keeping_upright_rgb_jpeg_bytes(photos, art):
    m = art.manifest
    assert m.config["shard"]["encoding"] == "jpg" and m.fields.image.encoding == "jpg"  # resolved, not "auto"
    assert m.fields.image.shape is None and m.fields.image.ffcv_field == "rgb_image"
    files, messy, stored = _files_by_key(photos), _messy(photos), _stored(art)
    plain = [k for k in files if k not in messy]
    assert len(plain) == N
    for k in plain:  # baseline RGB JPEGs, upright: into the tar as they are
        assert stored[k][2] == files[k].read_bytes(), k
    for k, info in messy.items():  # everything else was decoded and re-encoded as JPEG
        if info["kind"] != "truncated":
            assert stored[k][2] != files[k].read_bytes() and stored[k][2][:2] == b"\xff\xd8", k


def test_gray_cmyk_and_webp_photos_become_rgb_jpegs_of_their_pixels(photos, art):
    files, stored = _files_by_key(photos), _stored(art)
    for k, info in _messy(photos).items():
        if info["kind"] not in ("gray", "cmyk", "webp"):
            continue
        got, want = _decode(stored[k][2]), _upright(files[k]).astype(np.int16)
        assert got.shape == want.shape and got.shape[2] == 3, k
        assert np.abs(got - want).mean() < 3, k  # the same picture, up to JPEG noise
        if info["kind"] == "gray":
            assert np.abs(got - got[:, :, :1]).max() <= 2  # gray as RGB: three (nearly) equal planes


def test_transparency_is_composited_onto_white_not_dropped(photos, art):
    files, stored = _files_by_key(photos), _stored(art)
    seen = 0
    for k, info in _messy(photos).items():
        if info["kind"] not in ("rgba", "palette"):
            continue
        y, x = info["transparent_pixel"]
        with Image.open(files[k]) as im:
            assert np.asarray(im.convert("RGBA"))[y, x, :3].max() == 0  # black under the alpha
        assert _decode(stored[k][2])[y, x].min() >= 235, k  # reads back white
        seen += 1
    assert seen == 4


def test_exif_rotation_is_applied(photos, art):
    files, stored = _files_by_key(photos), _stored(art)
    for k, info in _messy(photos).items():
        if info["kind"] != "exif6":
            continue
        with Image.open(files[k]) as im:
            w, h = im.size  # as stored in the file: on its side
        split, i, data = stored[k]
        assert list(art.sizes(split)[i]) == info["size"] == [w, h]  # height and width swapped
        got, want = _decode(data), _upright(files[k]).astype(np.int16)
        assert got.shape == (w, h, 3) and np.abs(got - want).mean() < 3


def test_shards_written_elsewhere_from_the_spec_turn_gray_into_rgb_too(photos, art, tmp_path):
    """``map_shards`` (a Prefect or Dask runner) gets the channels the scan settled in the spec."""
    from sluice.stages.data.shard import write_shard_from_spec
    other = shard_dataset(str(photos), tmp_path / "out", ShardConfig(formats=["webdataset"], **QUIET),
                          map_shards=lambda spec, tasks: [write_shard_from_spec(spec, t) for t in tasks])
    mine = {sh.tar.path: sh.tar.sha256 for rec in art.manifest.splits.values() for sh in rec.shards}
    theirs = {sh.tar.path: sh.tar.sha256 for rec in other.manifest.splits.values() for sh in rec.shards}
    assert theirs == mine


def test_a_truncated_photo_is_quarantined_naming_its_file(photos, art):
    (bad,) = [m for m in fp.info(photos)["messy_files"] if m["kind"] == "truncated"]
    (q,) = art.manifest.quarantine
    assert q.where == str(photos / bad["path"]) and "truncated" in q.reason
    assert q.key not in _stored(art)


def test_sizes_are_recorded_per_sample(photos, art):
    files, stored = _files_by_key(photos), _stored(art)
    for split in art.manifest.splits:
        sizes, keys = art.sizes(split), art.keys(split)
        assert sizes.shape == (len(keys), 2)
        for key, hw in zip(keys, sizes):
            with Image.open(files[key]) as im:
                w, h = ImageOps.exif_transpose(im).size
            assert tuple(hw) == (h, w), key
            assert _decode(stored[key][2]).shape[:2] == (h, w)


def _reference_stats(art, folder: Path):
    files, live = _files_by_key(folder), set(art.live("train").tolist())
    keys = [k for i, k in enumerate(art.keys("train")) if i in live]
    pix = [_upright(files[k]).reshape(-1, 3).astype(np.float64) / 255 for k in keys]
    allpix = np.concatenate(pix)
    hw = np.array([p.shape[:2] for p in (_upright(files[k]) for k in keys)])
    return keys, allpix.mean(0), allpix.std(0), hw


def test_train_statistics_match_numpy_over_the_decoded_train_images(photos, art):
    st = art.manifest.fields.image.stats
    assert st is image_stats(art) or st == image_stats(art)
    keys, mean, std, hw = _reference_stats(art, photos)
    assert st.split == "train" and st.samples == len(keys) == art.manifest.splits["train"].count
    assert st.channels == 3 and st.pixels == int((hw[:, 0] * hw[:, 1]).sum())
    np.testing.assert_allclose(st.mean, mean, rtol=0, atol=1e-12)
    np.testing.assert_allclose(st.std, std, rtol=0, atol=1e-12)
    assert len(set(np.round(st.mean, 3))) > 1  # tinted: real RGB, not three equal planes
    s = st.sizes
    assert (s.height.min, s.height.max, s.height.median) == (hw[:, 0].min(), hw[:, 0].max(), np.median(hw[:, 0]))
    assert (s.width.min, s.width.max, s.width.median) == (hw[:, 1].min(), hw[:, 1].max(), np.median(hw[:, 1]))
    assert s.short_side.median == np.median(hw.min(1)) and s.distinct == len({tuple(x) for x in hw})


# ------------------------------------------------------------------ growth

def test_an_incremental_version_carries_statistics_and_sizes_of_all_its_samples(tmp_path):
    small = fp.make_fashion_photos(tmp_path / "p100", n=100, seed=5)
    more = fp.make_fashion_photos(tmp_path / "p130", n=130, seed=5)  # the same first 100 images
    src = tmp_path / "src"
    shutil.copytree(small, src)
    first = shard_dataset(str(src), tmp_path / "out", ShardConfig(**QUIET))
    # the parent as a Sluice before sizes and statistics wrote it: this version still gets both
    manifest = Path(first.root) / "manifest.json"
    raw = json.loads(manifest.read_text())
    raw["fields"]["image"].pop("stats")
    for rec in raw["splits"].values():
        rec.pop("sizes")
    manifest.write_text(json.dumps(raw))
    for p in more.glob("*/*.jpg"):
        if int(p.stem) >= 100:
            shutil.copy(p, src / p.parent.name / p.name)
    (src / "coat" / "4.jpg").unlink()  # a deletion: its sample is removed, and leaves the statistics
    second = shard_dataset(str(src), tmp_path / "out", ShardConfig(**QUIET))
    m = second.manifest
    assert m.parent == first.root.rsplit("/", 1)[-1] and sum(m.delta.added.values()) == 30 and m.delta.removed
    a = open_artifact(second.root)
    keys, mean, std, hw = _reference_stats(a, src)
    st = m.fields.image.stats
    assert st.samples == len(keys) == a.manifest.splits["train"].live_count
    np.testing.assert_allclose(st.mean, mean, rtol=0, atol=1e-12)
    np.testing.assert_allclose(st.std, std, rtol=0, atol=1e-12)
    files = _files_by_key(src)
    for split in m.splits:
        live = set(a.live(split).tolist())
        for i, (key, size) in enumerate(zip(a.keys(split), a.sizes(split))):
            if i in live:
                with Image.open(files[key]) as im:
                    assert tuple(size) == im.size[::-1], key


def test_rgba_arrays_are_composited_onto_white_too():
    from sluice.stages.data.encode import decode_pixels
    from sluice.stages.data.sources.base import RawSample
    rgba = np.zeros((2, 3, 4), np.uint8)
    rgba[0, 0] = (10, 20, 30, 255)  # opaque: as it is
    rgba[1, 2] = (200, 0, 0, 128)  # half: halfway to white
    got = decode_pixels(RawSample("k", 0, "here", array=rgba), None, None)
    assert got.shape == (2, 3, 3) and got[0, 0].tolist() == [10, 20, 30] and got[0, 1].tolist() == [255] * 3
    assert got[1, 2].tolist() == [227, 127, 127]  # round((v * 128 + 255 * 127) / 255)


# ------------------------------------------------------------------ bad input

def test_an_empty_class_folder_is_refused_naming_it(tmp_path):
    write_images(tmp_path / "src", n_per_class=12, fmt="jpg")
    (tmp_path / "src" / "bird").mkdir()
    (tmp_path / "src" / "fish").mkdir()
    (tmp_path / "src" / "fish" / "a.heic").write_bytes(b"not read")
    with pytest.raises(SourceError) as e:
        open_source(str(tmp_path / "src"))
    msg = str(e.value)
    assert f"{tmp_path / 'src' / 'bird'}: no files" in msg and f"{tmp_path / 'src' / 'fish'}: no images" in msg
    assert "1 .heic" in msg and "check_classes" in msg
    # opted out: the empty folders keep their labels (sorted names) and get no samples
    s = shard_dataset(IngestConfig(source=str(tmp_path / "src"), check_classes=False), tmp_path / "out",
                      ShardConfig(formats=["webdataset"], **QUIET))
    assert s.manifest.fields.label.class_names == ["bird", "cat", "dog", "fish"]
    assert s.manifest.fields.label.num_classes == 4
    assert sum(rec.class_counts[0] + rec.class_counts[3] for rec in s.manifest.splits.values()) == 0
    assert set(open_artifact(s.root).labels("train").tolist()) <= {1, 2}


def test_a_class_too_small_for_the_splits_is_refused_naming_it(tmp_path):
    write_images(tmp_path / "src", n_per_class=30, classes=("cat", "dog"), fmt="png")
    write_images(tmp_path / "src", n_per_class=4, classes=("eel",), fmt="png", seed=1)
    with pytest.raises(SourceError) as e:
        open_source(str(tmp_path / "src"))
    msg = str(e.value)
    assert "'eel' (4)" in msg and "fewer than 10 images" in msg and "cat" not in msg.split("Each")[0]
    assert "val_fraction=0.1" in msg and "holdout_fraction=0.1" in msg and "test_fraction=0.1" in msg
    assert "66%" in msg  # (1 - 0.1) ** 4: the chance val gets none of them
    assert "check_classes=false" in msg
    # a larger smallest fraction needs fewer: 4 >= ceil(1 / 0.25)
    open_source(IngestConfig(source=str(tmp_path / "src"), val_fraction=0.25, holdout_fraction=0.25,
                             test_fraction=0.25))
    # no split drawn from train: nothing to reach
    open_source(IngestConfig(source=str(tmp_path / "src"), val_fraction=0, holdout_fraction=0, test_fraction=0))
    open_source(IngestConfig(source=str(tmp_path / "src"), check_classes=False))


# ------------------------------------------------------------------ encoding: auto

OLD_DEFAULT = {"encoding": "npy", "jpeg_quality": 90, "png_level": 1, "shard_samples": 5000, "shard_bytes": None,
               "formats": ["webdataset", "dali", "ffcv"], "image_size": None, "channels": None}


def test_auto_keeps_the_fingerprint_of_fashion_mnist_sharded_at_the_old_default(tmp_path):
    """An artifact made when npy was the default is found again: the default resolves to npy
    before anything is hashed, and the new ingest setting counts in no fingerprint."""
    src = open_source("fashion-mnist")
    assert ShardConfig().for_source(src).content_fingerprint() == hash_obj(OLD_DEFAULT)  # the old code's hash
    assert IngestConfig(check_classes=False).split_fingerprint() == IngestConfig().split_fingerprint()
    ingest = IngestConfig(source="fashion-mnist", limit=200)
    cfg = dict(formats=["webdataset"], **QUIET)
    explicit = shard_dataset(ingest, tmp_path / "out", ShardConfig(encoding="npy", **cfg))
    default = shard_dataset(ingest, tmp_path / "out", ShardConfig(**cfg))
    assert default.reused and default.root == explicit.root
    assert default.manifest.fingerprint == explicit.manifest.fingerprint
    assert default.manifest.config["shard"]["encoding"] == "npy"


def test_auto_chooses_by_what_the_source_holds(tmp_path):
    assert auto_encoding({"array": 10}) == "npy" and auto_encoding({}) == "npy"
    assert auto_encoding({"jpg": 6, "png": 4}) == "jpg" and auto_encoding({"jpg": 5, "png": 5}) == "jpg"
    assert auto_encoding({"png": 6, "jpg": 4}) == "png" and auto_encoding({"bmp": 3, "webp": 2}) == "png"
    assert auto_encoding({"npy": 8, "jpg": 2}) == "npy"
    # a folder of PNGs, gray and RGB of one size, stays lossless: png, every image RGB, none lost
    write_images(tmp_path / "src", n_per_class=12, size=(16, 16), fmt="png")
    for k in range(6):
        Image.fromarray(np.full((16, 16), 40 * k, np.uint8)).save(tmp_path / "src" / "cat" / f"gray{k}.png")
    s = shard_dataset(IngestConfig(source=str(tmp_path / "src")), tmp_path / "out",
                      ShardConfig(formats=["webdataset"], **QUIET))
    assert s.manifest.fields.image.encoding == "png" and s.manifest.fields.image.shape == (16, 16, 3)
    assert s.manifest.quarantined == 0 and sum(s.manifest.counts().values()) == 30
    # WebDataset shards of raw arrays stay raw
    wds = shard_dataset(IngestConfig(source="fashion-mnist", limit=100), tmp_path / "fm",
                        ShardConfig(formats=["webdataset"], **QUIET))
    tars = tmp_path / "tars"
    tars.mkdir()
    for p in Path(wds.root).glob("*/shard-*.tar"):
        shutil.copy(p, tars / f"{p.parent.name}-{p.name}")
    assert ShardConfig().for_source(open_source(str(tars))).encoding == "npy"


# ------------------------------------------------------------------ readers

def test_beton_pages_are_sized_to_the_photos(art):
    for split, rec in art.manifest.splits.items():
        if rec.ffcv is None:
            continue
        header = beton.read_layout(str(art.local(rec.ffcv)))[0]
        sizes = art.sizes(split)
        largest = max(beton.jpeg_bound(int(h), int(w)) for h, w in sizes) + max(len(k) for k in art.keys(split))
        assert int(header["page_size"]) == beton.page_size_for_largest(largest, exact=False) < beton.VARIABLE_PAGE_SIZE
        assert rec.ffcv.bytes < 2 * int(header["page_size"]) + 64 * rec.count * 1024  # no 8 MiB pages of padding


def test_the_beton_holds_the_very_jpeg_bytes_the_tar_shards_hold(art):
    """No second encoding for FFCV: each sample's .beton JPEG is the tar's (the photo's own bytes
    where they were kept), so every backend decodes the same image."""
    stored = _stored(art)
    by_index = {(split, i): data for split, i, data in stored.values()}
    checked = 0
    for split, rec in art.manifest.splits.items():
        if rec.ffcv is None:
            continue
        path = art.local(rec.ffcv)
        _, _, meta, alloc = beton.read_layout(str(path))
        image = meta[meta.dtype.names[0]]
        raw = np.memmap(path, np.uint8, mode="r")
        size_at = dict(zip(alloc["ptr"].tolist(), alloc["size"].tolist()))
        for k in range(len(meta)):
            p = int(image["data_ptr"][k])
            assert bytes(raw[p:p + size_at[p]]) == by_index[(split, k)], (split, k)
            checked += 1
    assert checked == len(stored)


@pytest.mark.parametrize("backend", ["webdataset", "ffcv"])
def test_the_photos_read_with_a_random_resized_crop(art, backend):
    if backend == "ffcv" and importlib.util.find_spec("ffcv") is None:
        pytest.skip("ffcv is not installed")
    from sluice.stages.load import AugmentSpec, Loader, LoaderConfig
    st = art.manifest.fields.image.stats
    loader = Loader(art.root, LoaderConfig(backend=backend, batch_size=16, workers=1,
                                           augment=AugmentSpec.standard(size=32, mean=st.mean, std=st.std)))
    seen = []
    for b in loader:
        assert tuple(b.inputs["images"].shape[1:]) == (3, 32, 32)
        seen += b.indices.tolist()
    assert sorted(seen) == list(range(art.manifest.splits["train"].count))


# ------------------------------------------------------------------ statistics of older artifacts

def test_statistics_of_an_artifact_written_before_them_are_computed_from_its_samples(tmp_path):
    s = shard_dataset(IngestConfig(source="fashion-mnist", limit=300), tmp_path / "out",
                      ShardConfig(formats=["webdataset", "ffcv"], **QUIET))
    st = s.manifest.fields.image.stats
    old = tmp_path / "old"
    shutil.copytree(s.root, old)
    raw = json.loads((old / "manifest.json").read_text())
    raw["fields"]["image"].pop("stats")
    for rec in raw["splits"].values():
        rec.pop("sizes")
    (old / "manifest.json").write_text(json.dumps(raw))
    assert image_stats(old, compute=False) is None
    assert image_stats(old) == st  # npy: the same integers, the same figures
    # from the .beton alone
    raw["splits"]["train"]["shards"] = []
    (old / "manifest.json").write_text(json.dumps(raw))
    assert image_stats(old) == st
    from sluice.stages.load.arrays import fashion_mnist
    imgs = fashion_mnist("train")[0][:300]
    keys = open_artifact(s.root).keys("train")
    ref = imgs[[int(k.split("-")[1]) for k in keys]].astype(np.float64) / 255
    assert st.channels == 1 and abs(st.mean[0] - ref.mean()) < 1e-12 and abs(st.std[0] - ref.std()) < 1e-12


# ------------------------------------------------------------------ the dataset builder

def test_fashion_photos_are_deterministic_balanced_prefixes_of_any_n(tmp_path):
    a = fp.make_fashion_photos(tmp_path / "a", n=20, seed=1)
    b = fp.make_fashion_photos(tmp_path / "b", n=30, seed=1)
    fa = {p.relative_to(a): p.read_bytes() for p in a.glob("*/*.jpg")}
    fb = {p.relative_to(b): p.read_bytes() for p in b.glob("*/*.jpg")}
    assert len(fa) == 20 and len(fb) == 30 and all(fb[k] == v for k, v in fa.items())
    assert sorted(d.name for d in b.iterdir() if d.is_dir()) == sorted(fp.CLASS_NAMES)
    assert all(len(list((b / c).glob("*.jpg"))) == 3 for c in fp.CLASS_NAMES)  # balanced
    aspects = set()
    for p in b.glob("*/*.jpg"):
        assert p.parent.name == fp.CLASS_NAMES[int(p.stem) % 10]
        with Image.open(p) as im:
            w, h = im.size
            assert im.mode == "RGB" and im.format == "JPEG" and 40 <= min(w, h) and max(w, h) <= 146
            short, long = sorted((w, h))
            assert long == short or long == round(short * 4 / 3)
            aspects.add("1:1" if w == h else "4:3" if w > h else "3:4")
            px = np.asarray(im).astype(int)
            assert np.abs(px[:, :, 0] - px[:, :, 2]).max() > 3  # tinted, not three equal planes
    assert aspects == {"1:1", "4:3", "3:4"}
    assert fp.LABELS[0] == sorted(fp.CLASS_NAMES).index("t-shirt_top") == 8
    c = fp.make_fashion_photos(tmp_path / "c", n=20, seed=2)
    assert {p.relative_to(c): p.read_bytes() for p in c.glob("*/*.jpg")} != fa  # the seed matters
    # complete: reused as it is; other parameters refused; no temporary folder left
    mtime = (a / fp.COMPLETE).stat().st_mtime_ns
    assert fp.make_fashion_photos(a, n=20, seed=1) == a and (a / fp.COMPLETE).stat().st_mtime_ns == mtime
    with pytest.raises(FileExistsError, match="n.: 20"):
        fp.make_fashion_photos(a, n=40, seed=1)
    assert not list(tmp_path.glob("*.tmp-*"))


def test_fashion_photos_cli(tmp_path, capsys):
    fp.main([str(tmp_path / "d"), "--n", "10", "--messy"])
    out = capsys.readouterr().out
    assert "10 photos in 10 class folders" in out and "13 messy files" in out and "ankle_boot, bag" in out
    kinds = [m["kind"] for m in fp.info(tmp_path / "d")["messy_files"]]
    assert sorted(set(kinds)) == sorted(fp.MESSY) and kinds.count("truncated") == 1
