"""Drills with hostile inputs: each asserts a clear error naming the file or member, or a
counted quarantine, and that nothing good is lost. The image folder and the label tar are each
sharded once; every case then checks its own files' outcome."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from corpus import CLASSES, encode, gray_folder, image_folder, idx_bytes, label_tar, rgb, smooth_rgb, tar_of
from sluice.errors import ArtifactError, LoaderError, SourceError
from sluice.stages.data.config import IngestConfig, ShardConfig
from sluice.stages.data.shard import shard_dataset
from sluice.storage.artifact import open_artifact

pytestmark = pytest.mark.timeout(300)
ALL = dict(holdout_fraction=0, val_fraction=0, test_fraction=0)  # every sample lands in train
QUIET = dict(progress=False, workers=1)  # FFCV is imported once, in this process


def _pixels(art, key: str) -> np.ndarray:
    """A stored sample's pixels as the loader decodes them."""
    from sluice.stages.load.sample_index import SampleIndex
    i = art.keys("train").index(key)
    return SampleIndex(art, "train").pixels(i)


# ------------------------------------------------------------------ an image folder

@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    files = image_folder(root / "src")
    s = shard_dataset(IngestConfig(source=str(root / "src"), **ALL), root / "out",
                      ShardConfig(encoding="png", max_bad_fraction=0.5, **QUIET))
    art = open_artifact(s.root)
    art.verify()
    quarantine = {q.where: q for q in s.manifest.quarantine}
    return files, art, quarantine, s


@pytest.mark.drill("image-corrupt-bytes", "image-empty-file", "image-truncated-jpeg", "image-decompression-bomb")
@pytest.mark.parametrize("case,reason", [
    ("image-corrupt-bytes", "cannot decode image"),
    ("image-empty-file", "cannot decode image"),
    ("image-truncated-jpeg", "Truncated File Read"),
    ("image-decompression-bomb", "more than shard.max_pixels"),
])
@pytest.mark.slow
def test_bad_image_is_quarantined_naming_its_file(images, case, reason):
    files, art, quarantine, _ = images
    q = quarantine[str(files[case])]  # the record names the file itself
    assert reason in q.reason, q.reason
    assert q.key not in art.keys("train")


@pytest.mark.drill("image-corrupt-bytes", "image-empty-file", "image-truncated-jpeg", "image-decompression-bomb")
def test_nothing_good_is_lost_from_the_image_folder(images):
    files, art, quarantine, s = images
    keys = set(art.keys("train"))
    assert {f"{c}_good{i:02d}" for c in CLASSES for i in range(12)} <= keys
    assert len(quarantine) == 4 and s.manifest.quarantined == 4 and "quarantined 4" in s.format()
    assert art.manifest.counts()["train"] == 24 + 7  # the good ones + the 7 kept hostile files


@pytest.fixture(scope="module")
def grays(tmp_path_factory):
    root = tmp_path_factory.mktemp("grays")
    files = gray_folder(root / "src")
    s = shard_dataset(IngestConfig(source=str(root / "src"), **ALL), root / "out",
                      ShardConfig(encoding="png", max_bad_fraction=0.2, formats=["webdataset", "dali"], **QUIET))
    return files, open_artifact(s.root), {q.where: q for q in s.manifest.quarantine}


@pytest.mark.drill("image-16-bit-png")
def test_16_bit_png_is_scaled_not_saturated(grays):
    _, art, _ = grays
    px = _pixels(art, "a_deep")  # RGB, as the one colour image among them makes every image
    assert (px == px[:, :, :1]).all()
    src = np.arange(256) * 257  # every 16-bit level the file holds
    assert np.array_equal(px[:, :, 0].ravel(), np.round(src * 255 / 65535).astype(np.uint8))  # 256 levels, in order


@pytest.mark.drill("image-gray-among-rgb")
def test_rgb_among_gray_makes_every_image_rgb_and_loses_none(grays):
    files, art, quarantine = grays
    assert not quarantine and art.manifest.fields.image.shape == (16, 16, 3)
    assert len(art.keys("train")) == 14  # every gray one kept, the 16-bit one and the colour one too
    assert np.array_equal(_pixels(art, "b_colour"), rgb(3))
    gray = _pixels(art, "b_gray3")
    assert np.array_equal(gray, np.full((16, 16, 3), 30, np.uint8))  # gray as three equal planes


@pytest.mark.drill("image-exif-rotated")
def test_exif_rotation_is_applied(images):
    _, art, _, _ = images
    assert np.array_equal(_pixels(art, "a_rotated"), np.rot90(rgb(5, 12, 16), k=-1))  # upright, 16x12


@pytest.mark.drill("image-cmyk-jpeg")
def test_cmyk_jpeg_becomes_rgb(images):
    _, art, _, _ = images
    px = _pixels(art, "a_cmyk")
    assert px.shape == (16, 16, 3) and np.abs(px.astype(int) - smooth_rgb()).mean() < 4


@pytest.mark.drill("image-palette-alpha")
def test_palette_and_alpha_images_are_composited_onto_white(images):
    from PIL import Image
    _, art, _, _ = images

    def on_white(rgba: np.ndarray) -> np.ndarray:
        a = rgba[:, :, 3:].astype(np.float64) / 255
        return np.rint(rgba[:, :, :3] * a + 255 * (1 - a)).astype(np.uint8)
    pal = Image.fromarray(rgb(6)).convert("P", palette=Image.ADAPTIVE, colors=16)
    index = np.asarray(pal)
    pal.info["transparency"] = 0
    want = on_white(np.asarray(pal.convert("RGBA")))
    assert (index == 0).any() and (want[index == 0] == 255).all()  # the transparent entry: white
    assert np.array_equal(_pixels(art, "a_palette"), want)
    # alpha 9 of 255: nearly transparent, so nearly white (not the colours under the alpha)
    assert np.array_equal(_pixels(art, "a_rgba"), on_white(np.dstack([rgb(8), np.full((16, 16), 9, np.uint8)])))


@pytest.mark.drill("image-png-named-jpg", "image-odd-names")
def test_png_named_jpg_and_odd_names_are_kept(images):
    _, art, _, _ = images
    assert np.array_equal(_pixels(art, "a_actually-png"), rgb(9))
    keys = art.keys("train")
    assert "b_mlaut_n_me_1" in keys or any(k.startswith("b_") and "me" in k and "1" in k for k in keys)
    assert _pixels(art, "b_tiny").shape == (1, 1, 3)


@pytest.mark.drill("folder-empty-class")
def test_a_class_folder_without_images_is_refused_naming_it(tmp_path):
    for c in CLASSES:
        (tmp_path / "src" / c).mkdir(parents=True)
        for i in range(4):
            (tmp_path / "src" / c / f"{i}.png").write_bytes(encode(rgb(i)))
    (tmp_path / "src" / "c").mkdir()
    (tmp_path / "src" / "d").mkdir()
    (tmp_path / "src" / "d" / "IMG_0001.HEIC").write_bytes(b"a format the folder source does not read")
    with pytest.raises(SourceError) as e:
        shard_dataset(IngestConfig(source=str(tmp_path / "src"), **ALL), tmp_path / "out", ShardConfig(**QUIET))
    assert f"{tmp_path / 'src' / 'c'}: no files" in str(e.value)
    assert f"{tmp_path / 'src' / 'd'}: no images, but 1 other file(s) (1 .heic)" in str(e.value)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").rglob("manifest.json"))
    s = shard_dataset(IngestConfig(source=str(tmp_path / "src"), check_classes=False, **ALL), tmp_path / "out",
                      ShardConfig(**QUIET))
    assert s.manifest.counts()["train"] == 8 and s.manifest.fields.label.class_names == ["a", "b", "c", "d"]


@pytest.mark.drill("folder-tiny-class")
def test_a_class_too_small_for_the_split_fractions_is_refused_naming_it(tmp_path):
    for c, n in (("a", 40), ("b", 4)):
        (tmp_path / "src" / c).mkdir(parents=True)
        for i in range(n):
            (tmp_path / "src" / c / f"{i}.png").write_bytes(encode(rgb(i)))
    with pytest.raises(SourceError) as e:
        shard_dataset(IngestConfig(source=str(tmp_path / "src"), val_fraction=0.1, holdout_fraction=0,
                                   test_fraction=0), tmp_path / "out", ShardConfig(**QUIET))
    msg = str(e.value)
    assert "'b' (4)" in msg and "fewer than 10 images" in msg and "val_fraction=0.1" in msg
    assert "ingest.val_fraction to 0" in msg and "check_classes=false" in msg
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").rglob("manifest.json"))


# ------------------------------------------------------------------ a WebDataset tar

@pytest.fixture(scope="module")
def labels(tmp_path_factory):
    root = tmp_path_factory.mktemp("labels")
    tar = root / "src.tar"
    keys = label_tar(tar)
    s = shard_dataset(IngestConfig(source=str(tar), num_classes=10, **ALL), root / "out",
                      ShardConfig(max_bad_fraction=0.5, formats=["webdataset", "dali"], **QUIET))
    return tar, keys, open_artifact(s.root), {q.where: q for q in s.manifest.quarantine}, root


@pytest.mark.drill("label-not-integer", "label-out-of-range", "member-missing")
@pytest.mark.parametrize("case,reason", [
    ("label-not-integer", "is not an integer"),
    ("label-out-of-range", "out of range [0, 10)"),
    ("member-missing", "member"),
])
def test_bad_label_or_member_is_quarantined_naming_the_member(labels, case, reason):
    tar, keys, art, quarantine, _ = labels
    for key in keys[case]:
        q = quarantine[f"{tar}:{key}"]  # file and member
        assert reason in q.reason, q.reason


@pytest.mark.drill("label-bom")
def test_label_with_byte_order_mark_is_read(labels):
    _, _, art, _, _ = labels
    i = art.keys("train").index("bom")
    assert art.labels("train")[i] == 4


@pytest.mark.drill("tar-duplicate-keys")
def test_duplicate_keys_lose_nothing(labels):
    _, _, art, _, _ = labels
    keys, lab = art.keys("train"), art.labels("train")
    assert lab[keys.index("twice")] == 7 and lab[keys.index("twice-dup1")] == 8
    assert {f"good{i:02d}" for i in range(40)} <= set(keys)


@pytest.mark.drill("tar-hostile-names")
def test_hostile_member_names_are_keys_never_paths(labels):
    tar, _, art, _, root = labels
    keys = art.keys("train")
    assert "escape" in keys and "abs_dir_rooted" in keys and not any("/" in k or ".." in k for k in keys)
    outside = [p for p in Path("/").glob("escape*")] + [p for p in tar.parent.parent.glob("escape*")]
    assert outside == [] and not Path("/abs/dir").exists()
    assert art.manifest.counts()["train"] == 40 + 3 + 1 + 2  # good + duplicates + bom + hostile names


# ------------------------------------------------------------------ source files

def _shards(dir_: Path, n: int = 3) -> list[Path]:
    gray = lambda v: __import__("corpus").encode(np.full((8, 8), v, np.uint8))  # noqa: E731
    dir_.mkdir(parents=True)
    return [tar_of(dir_ / f"s{k}.tar", [m for i in range(20) for m in
                                         ((f"k{k}-{i:02d}.png", gray(i)), (f"k{k}-{i:02d}.cls", b"1"))])
            for k in range(n)]


@pytest.mark.drill("tar-truncated")
def test_truncated_tar_fails_naming_it_unless_its_readable_part_is_wanted(tmp_path):
    good, *_ = _shards(tmp_path / "src", 1)
    data = good.read_bytes()
    good.write_bytes(data[: len(data) * 6 // 10])
    with pytest.raises(SourceError, match=f"{good}: damaged WebDataset shard"):
        shard_dataset(IngestConfig(source=str(good), **ALL), tmp_path / "out", ShardConfig(**QUIET))
    assert not (tmp_path / "out").exists()
    s = shard_dataset(IngestConfig(source=str(good), keep_damaged=True, **ALL), tmp_path / "out",
                      ShardConfig(max_bad_fraction=0.2, **QUIET))
    assert 10 <= s.manifest.counts()["train"] < 20 and [d.where for d in s.manifest.damaged_sources] == [str(good)]


@pytest.mark.drill("tar-zero-length")
def test_zero_length_tar_fails_naming_it_unless_the_others_are_wanted(tmp_path):
    shards = _shards(tmp_path / "src", 3)
    shards[1].write_bytes(b"")
    with pytest.raises(SourceError, match=f"{shards[1]}: damaged"):
        shard_dataset(IngestConfig(source=str(tmp_path / "src"), **ALL), tmp_path / "out", ShardConfig(**QUIET))
    s = shard_dataset(IngestConfig(source=str(tmp_path / "src"), keep_damaged=True, **ALL), tmp_path / "out",
                      ShardConfig(**QUIET))
    assert s.manifest.counts()["train"] == 40 and s.manifest.damaged_sources[0].where == str(shards[1])


@pytest.mark.drill("tar-corrupt-header")
def test_corrupt_tar_header_fails_naming_it(tmp_path):
    (good,) = _shards(tmp_path / "src", 1)
    data = bytearray(good.read_bytes())
    data[512 * 6: 512 * 6 + 100] = b"\xee" * 100  # the 4th member's header
    good.write_bytes(bytes(data))
    with pytest.raises(SourceError, match=f"{good}: damaged WebDataset shard"):
        shard_dataset(IngestConfig(source=str(good), **ALL), tmp_path / "out", ShardConfig(**QUIET))


@pytest.mark.drill("idx-header-overflow", "idx-truncated-gzip")
@pytest.mark.parametrize("case", ["idx-header-overflow", "idx-truncated-gzip"])
def test_malformed_idx_fails_naming_the_file(tmp_path, case):
    d = tmp_path / "idx"
    d.mkdir()
    labels = idx_bytes([4], bytes(4))
    if case == "idx-header-overflow":
        images = idx_bytes([2 ** 31, 2 ** 31, 2 ** 31], bytes(64))
        bad = d / "train-images-idx3-ubyte"
        bad.write_bytes(images)
        (d / "train-labels-idx1-ubyte").write_bytes(labels)
    else:
        bad = d / "train-images-idx3-ubyte.gz"
        bad.write_bytes(gzip.compress(idx_bytes([4, 2, 2], bytes(16)))[:-12])
        (d / "train-labels-idx1-ubyte").write_bytes(labels)
    with pytest.raises(SourceError, match=str(bad)):
        shard_dataset(str(d), tmp_path / "out", ShardConfig(**QUIET))


@pytest.mark.drill("npz-pickled")
def test_pickled_npz_is_refused(tmp_path):
    np.savez(tmp_path / "p.npz", images=np.array([object()] * 3, dtype=object), labels=np.zeros(3, int))
    with pytest.raises(SourceError, match="unpickling"):
        shard_dataset(str(tmp_path / "p.npz"), tmp_path / "out", ShardConfig(**QUIET))


# ------------------------------------------------------------------ configs (through the CLI)

@pytest.mark.drill("config-image-size")
@pytest.mark.parametrize("size", ["[0,0]", "[-3,28]"])
def test_nonpositive_image_size_is_refused_up_front(tmp_path, capsys, size):
    from sluice.flows.cli import main
    rc = main(["shard", "fashion-mnist", "--out", str(tmp_path / "o"), "--set", f"shard.image_size={size}"])
    assert rc == 2 and "shard.image_size" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.drill("config-eval-split")
@pytest.mark.parametrize("sets,field", [
    (["promotion.eval_split=tset"], "eval_split"),
    (["promotion.eval_split=val", "data.ingest.val_fraction=0"], "eval_split"),
    (["promotion.eval_split=holdout", "selection.method=none"], "eval_split"),  # no IL model: no holdout
    (["promotion.eval_split=test", "promotion.report_split=val", "data.ingest.val_fraction=0"], "report_split"),
])
def test_bad_eval_split_is_refused_before_any_stage(tmp_path, capsys, sets, field):
    from sluice.flows.cli import main
    args = ["run", "nightly", "--data-root", str(tmp_path / "d")] + [a for s in sets for a in ("--set", s)]
    assert main(args) == 2
    assert f"promotion.{field}" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()  # nothing ran


# ------------------------------------------------------------------ artifacts and loader state

@pytest.mark.drill("manifest-count-raised")
@pytest.mark.parametrize("backend", ["memory", "ffcv", "webdataset"])
@pytest.mark.slow
def test_raised_manifest_count_is_refused_before_the_first_batch(fmnist_artifact, tmp_path, backend):
    import shutil
    from sluice.stages.load import Loader
    root = tmp_path / "art"
    shutil.copytree(fmnist_artifact.root, root)
    m = json.loads((root / "manifest.json").read_text())
    held = m["splits"]["val"]["count"]
    m["splits"]["val"]["count"] += 500
    (root / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match=f"split 'val' has .* samples by its manifest, but .* holds {held}"):
        Loader(root, split="val", batch_size=32, backend=backend, workers=0)


@pytest.mark.drill("loader-state-negative")
def test_loader_state_out_of_range_is_refused(fmnist_artifact):
    from sluice.stages.load import Loader
    loader = Loader(fmnist_artifact.root, split="val", batch_size=16, backend="memory", workers=0)
    state = loader.state_dict()
    for bad in ({"next_batch": -5}, {"next_batch": len(loader) + 1}, {"epoch": -1}, {"next_batch": 1.5}):
        with pytest.raises(LoaderError):
            loader.load_state_dict({**state, **bad})
    loader.load_state_dict({**state, "next_batch": len(loader)})  # a finished epoch is fine


@pytest.mark.drill("registry-read-only")
def test_models_list_creates_nothing(tmp_path, capsys):
    from sluice.flows.cli import main
    assert main(["models", "list", "--data-root", str(tmp_path / "fresh")]) == 0
    assert "no models registered" in capsys.readouterr().out
    assert not (tmp_path / "fresh").exists()
