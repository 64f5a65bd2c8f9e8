"""Drills with corruption at rest: bytes of a finished artifact overwritten in place (file sizes
unchanged), as rot, a bad disk or a hand edit would. Whatever the backend, at default settings
the loader raises a clear ``CorruptSample`` before a damaged sample is yielded; with
``on_corrupt: skip`` every yielded sample equals what was written and exactly the damaged ones
are missing (and counted); ``sluice verify`` names each damaged file and sample."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from corpus import run_cli
from sluice.errors import ArtifactError, CorruptSample, TooManyCorruptSamples
from sluice.stages.data.config import IngestConfig, ShardConfig
from sluice.stages.data.formats.beton import FIELD_DESCRIPTOR, HEADER, read_layout
from sluice.stages.data.shard import shard_dataset
from sluice.stages.load import Loader
from sluice.stages.load.sample_index import SampleIndex
from sluice.storage.artifact import open_artifact

pytestmark = pytest.mark.timeout(300)
BACKENDS = ["memory", "webdataset", "ffcv", "dali"]
TAR_BACKENDS = ["memory", "webdataset", "dali"]  # the ones that read the tar shards
STREAMING = "webdataset-streaming"  # the webdataset backend's plain streaming mode (backend_params.webdataset.streaming)
VICTIMS = (3, 250, 411)  # split indices damaged in the first train shard (shards hold 500)
RGB_VICTIMS = (3, 50, 77)  # the same in the RGB JPEG artifact (shards hold 100)


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict:
    """2,000 Fashion-MNIST images sharded once per encoding; the train split decoded as the
    reference every yielded sample is compared with."""
    root = tmp_path_factory.mktemp("corrupt")
    out = {}
    for enc in ("npy", "png"):
        s = shard_dataset(IngestConfig(source="fashion-mnist", limit=2000), root / enc,
                          ShardConfig(encoding=enc, shard_samples=500, progress=False, workers=1))
        art = open_artifact(s.root)
        si = SampleIndex(art, "train")
        out[enc] = {"root": Path(s.root), "images": np.stack([si.pixels(i) for i in range(si.count)]),
                    "labels": art.labels("train"), "victims": VICTIMS}
    return out


@pytest.fixture(scope="module")
def rgb(tmp_path_factory) -> dict:
    """300 RGB 32×32 JPEGs sharded as ``jpg``: the ``.beton`` holds an RGB image field (JPEG
    bytes, checked from the stored bytes, not the decoded pixels). The reference is what FFCV
    decodes from the clean file, by split index."""
    from PIL import Image
    root = tmp_path_factory.mktemp("rgb")
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:32, 0:32]
    for c in range(3):
        (root / "src" / f"c{c}").mkdir(parents=True)
        for k in range(100):
            base = np.stack([(xx * (k % 7 + 1) + 40 * c) % 256, (yy * (k % 5 + 1)) % 256, (xx + yy + k) % 256], -1)
            img = np.clip(base + rng.integers(0, 40, base.shape), 0, 255).astype(np.uint8)
            Image.fromarray(img).save(root / "src" / f"c{c}" / f"{k:03d}.jpg", quality=95)
    s = shard_dataset(IngestConfig(source=str(root / "src"), kind="folder", holdout_fraction=0, val_fraction=0,
                                   test_fraction=0),
                      root / "out", ShardConfig(encoding="jpg", jpeg_quality=90, shard_samples=100, progress=False,
                                                workers=1))
    art = open_artifact(s.root)
    assert art.manifest.fields.image.ffcv_field == "rgb_image"
    n = art.manifest.split("train").count
    images = np.zeros((n, 32, 32, 3), np.uint8)
    for x, _, idx in Loader(s.root, backend="ffcv", batch_size=64, workers=1):
        images[idx.numpy()] = np.rint(x.numpy() * 255).astype(np.uint8).transpose(0, 2, 3, 1)
    return {"root": Path(s.root), "images": images, "labels": art.labels("train"), "victims": RGB_VICTIMS}


def _reference(request, clean: dict, enc: str) -> dict:
    return request.getfixturevalue("rgb") if enc == "rgb" else clean[enc]


def _copy(ref: dict, tmp_path: Path) -> Path:
    dest = tmp_path / ref["root"].name
    shutil.copytree(ref["root"], dest)
    return dest


def _overwrite(path: Path, offset: int, data: bytes) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(offset)
        assert f.read(len(data)) != data
        f.seek(offset)
        f.write(data)
    assert path.stat().st_size == size


def damage_tar(root: Path, where: str, victims=VICTIMS) -> set[int]:
    """16 bytes of pixel data (``pixels``) or 4 bytes of the image member's header (``header``)
    of each victim, inside the first train tar."""
    si = SampleIndex(open_artifact(root), "train")
    for i in victims:
        assert si.shard_of[i] == 0
        at = int(si.offset[i]) + (int(si.size[i]) // 2 if where == "pixels" else 8)
        _overwrite(Path(si.path(0)), at, b"\xa5" * (16 if where == "pixels" else 4))
    return set(victims)


def damage_beton(root: Path, where: str, victims=VICTIMS) -> set[int]:
    """64 bytes inside each victim's stored pixels (``pixels``; for an RGB field, 16 bytes in the
    middle of its JPEG bytes), or its label in its metadata record (``record``), in the train
    ``.beton``."""
    path = root / "train" / "data.beton"
    _, fields, meta, alloc = read_layout(str(path))
    meta_at = HEADER.itemsize + FIELD_DESCRIPTOR.itemsize * len(fields)  # the metadata region
    image = meta[meta.dtype.names[0]]
    for i in victims:
        if where == "pixels" and image.dtype.names:  # an RGB field: (mode, width, height, data_ptr)
            ptr = int(image["data_ptr"][i])
            size = int(alloc["size"][alloc["ptr"] == ptr][0])
            _overwrite(path, ptr + size // 2, b"\x5a" * 16)
        elif where == "pixels":
            ptr = int(image[i])
            _overwrite(path, ptr + 300, b"\x5a" * 64)
        else:  # the label: the second field of the record, found by its bytes
            label_at = meta_at + i * meta.dtype.itemsize + meta.dtype.fields[meta.dtype.names[1]][1]
            _overwrite(path, label_at, (int(meta[meta.dtype.names[1]][i]) ^ 7).to_bytes(8, "little"))
    return set(victims)


def read_split(root: Path, backend: str, reference: dict, **cfg) -> tuple[list[int], Loader]:
    """Every batch of one epoch; asserts each yielded sample equals what was written (image and
    label, by split index) and returns the indices yielded."""
    if backend == STREAMING:
        backend, cfg = "webdataset", {**cfg, "backend_params": {"webdataset": {"streaming": True}}}
    loader = Loader(root, backend=backend, batch_size=cfg.pop("batch_size", 64), workers=1, **cfg)
    seen: list[int] = []
    for x, y, idx in loader:
        got = np.rint(x.numpy() * 255).astype(np.uint8).transpose(0, 2, 3, 1)
        i = idx.numpy()
        want = reference["images"][i]
        bad = [int(i[k]) for k in range(len(i)) if not np.array_equal(got[k], want[k])]
        assert not bad, f"{backend} yielded samples that differ from what was written: {bad}"
        assert np.array_equal(y.numpy(), reference["labels"][i])
        seen += i.tolist()
    return seen, loader


CASES = [(b, "npy", "tar", "pixels") for b in TAR_BACKENDS] + [(b, "npy", "tar", "header") for b in TAR_BACKENDS] + \
        [(b, "png", "tar", w) for b in ("memory", "webdataset") for w in ("pixels", "header")] + \
        [("ffcv", "npy", "beton", "pixels"), ("ffcv", "npy", "beton", "record")] + \
        [(STREAMING, "npy", "tar", "pixels"), (STREAMING, "npy", "tar", "header")] + \
        [pytest.param("ffcv", "rgb", "beton", w, marks=pytest.mark.slow) for w in ("pixels", "record")]


def _damage(root: Path, fmt: str, where: str, victims=VICTIMS) -> set[int]:
    return damage_tar(root, where, victims) if fmt == "tar" else damage_beton(root, where, victims)


@pytest.mark.drill("corrupt-pixels", "corrupt-header")
@pytest.mark.parametrize("backend,enc,fmt,where", CASES)
@pytest.mark.slow
def test_default_fails_naming_the_sample_before_it_is_yielded(request, clean, tmp_path, backend, enc, fmt, where):
    ref = _reference(request, clean, enc)
    root = _copy(ref, tmp_path)
    victims = _damage(root, fmt, where, ref["victims"])
    with pytest.raises(CorruptSample) as e:
        read_split(root, backend, ref)  # asserts nothing damaged came out first
    msg, err = str(e.value), e.value
    assert err.index in victims and err.split == "train"
    assert err.key == open_artifact(root).keys("train")[err.index] and repr(err.key) in msg
    assert f"index {err.index}" in msg and "sluice shard" in msg and "sluice verify" in msg
    assert err.file in msg and err.file.startswith("train/")
    assert "TokenError" not in msg and "Traceback" not in msg


@pytest.mark.drill("corrupt-skip")
@pytest.mark.parametrize("backend,enc,fmt,where", CASES)
@pytest.mark.slow
def test_skip_drops_exactly_the_damaged_samples(request, clean, tmp_path, backend, enc, fmt, where):
    ref = _reference(request, clean, enc)
    root = _copy(ref, tmp_path)
    victims = _damage(root, fmt, where, ref["victims"])
    seen, loader = read_split(root, backend, ref, on_corrupt="skip", max_corrupt_fraction=0.01)
    n = len(ref["labels"])
    assert len(seen) == len(set(seen)) == n - len(victims)
    assert set(range(n)) - set(seen) == victims
    assert loader.profile()["corrupt_skipped"] == len(victims)
    assert "3 samples skipped" in loader.profile_report()


@pytest.mark.drill("corrupt-skip")
@pytest.mark.parametrize("backend", BACKENDS + [STREAMING])
@pytest.mark.slow
def test_skip_fails_past_the_threshold(clean, tmp_path, backend):
    root = _copy(clean["npy"], tmp_path)
    damage_beton(root, "pixels") if backend == "ffcv" else damage_tar(root, "pixels")
    with pytest.raises(TooManyCorruptSamples, match="max_corrupt_fraction=0.001"):
        read_split(root, backend, clean["npy"], on_corrupt="skip", max_corrupt_fraction=0.001)


@pytest.mark.drill("corrupt-pixels")
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_clean_artifact_reads_whole_on_every_backend(clean, tmp_path, backend):
    seen, loader = read_split(clean["npy"]["root"], backend, clean["npy"])
    assert sorted(seen) == list(range(len(clean["npy"]["labels"])))
    assert loader.profile()["corrupt_skipped"] == 0


@pytest.mark.drill("corrupt-verify")
@pytest.mark.slow
def test_sluice_verify_names_every_damaged_file_and_sample(clean, tmp_path):
    root = _copy(clean["npy"], tmp_path)
    r = run_cli(["verify", str(root)], timeout=120)
    assert r.returncode == 0 and "no damage" in r.stdout, r.stdout + r.stderr
    damage_tar(root, "pixels", victims=(3,))
    damage_tar(root, "header", victims=(250,))
    damage_beton(root, "pixels", victims=(7,))
    r = run_cli(["verify", str(root), "--json"], timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    found = {(d["file"], d["index"]) for d in json.loads(r.stdout)["damaged"]}
    assert found == {("train/shard-000000.tar", 3), ("train/shard-000000.tar", 250), ("train/data.beton", 7)}
    r = run_cli(["verify", str(root)], timeout=120)
    assert "train/shard-000000.tar" in r.stdout and "3 damaged samples" in r.stdout, r.stdout
    keys = open_artifact(root).keys("train")
    assert keys[3] in r.stdout and keys[7] in r.stdout
    r = run_cli(["verify", str(root), "--full"], timeout=120)
    assert r.returncode == 1 and "sha256" in r.stdout, r.stdout


@pytest.mark.drill("corrupt-no-sums")
@pytest.mark.slow
def test_an_artifact_without_checksums_stays_readable_and_says_so(clean, tmp_path):
    root = _copy(clean["npy"], tmp_path)
    m = json.loads((root / "manifest.json").read_text())
    for s in m["splits"].values():
        s.pop("sums")
    (root / "manifest.json").write_text(json.dumps(m))
    with pytest.warns(UserWarning, match="no per-sample checksums"):
        seen, _ = read_split(root, "memory", clean["npy"])
    assert len(seen) == len(clean["npy"]["labels"])
    damage_tar(root, "header", victims=(0, 3))  # .npy headers: never handed to a parser
    for backend in TAR_BACKENDS:  # unchecked, yet nothing yielded differs from what was written
        seen, _ = read_split(root, backend, clean["npy"])
        assert len(seen) == len(clean["npy"]["labels"])
    damage_tar(root, "pixels", victims=(5,))
    r = run_cli(["verify", str(root), "--full"], timeout=120)
    assert r.returncode == 1 and "no per-sample checksums" in r.stdout and "shard-000000.tar" in r.stdout, r.stdout


EMPTIED = (248, 249, 250, 251)  # batch 62 of a sequential epoch in batches of 4: every sample damaged


@pytest.mark.drill("corrupt-skip")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.slow
def test_skip_yields_an_empty_batch_where_every_sample_was_damaged(clean, tmp_path, backend):
    """Every backend yields a batch in its place (empty, shaped like the others), so an epoch has
    as many batches on every rank and DDP stays in step; DALI, which cannot run an empty batch,
    yields it without running it."""
    root = _copy(clean["npy"], tmp_path)
    victims = damage_beton(root, "pixels", EMPTIED + (3,)) if backend == "ffcv" else \
        damage_tar(root, "pixels", EMPTIED + (3,))
    loader = Loader(root, backend=backend, batch_size=4, workers=1, sampler={"kind": "sequential"},
                    on_corrupt="skip", max_corrupt_fraction=0.01)
    batches = [(x, y, i) for x, y, i in loader]
    n = len(clean["npy"]["labels"])
    assert len(batches) == len(loader) == -(-n // 4)
    x, y, i = batches[62]
    assert len(y) == len(i) == 0 and x.shape == (0, *batches[61][0].shape[1:]) and x.dtype == torch.float32
    assert len(batches[0][1]) == 3 and sum(len(b[1]) for b in batches) == n - len(victims)
    assert loader.profile()["corrupt_skipped"] == len(victims)


@pytest.mark.drill("corrupt-skip")
@pytest.mark.slow
def test_training_steps_through_an_empty_batch(clean, tmp_path):
    """An empty batch is a step with a zero loss (not NaN), and the summary counts every skip."""
    from sluice.stages.train import TrainConfig, train
    root = _copy(clean["npy"], tmp_path)
    damage_tar(root, "pixels", EMPTIED + (3,))
    loader = Loader(root, backend="memory", batch_size=4, workers=1, sampler={"kind": "sequential"},
                    on_corrupt="skip", max_corrupt_fraction=0.01)
    r = train(TrainConfig(model_kwargs={"width": 8}, max_steps=70, batch_size=4, lr=0.01, progress=False,
                          torch_threads=1, log_every_steps=1), loader)
    assert r.steps == 70 and all(np.isfinite(m["loss"]) for m in r.metrics)
    assert r.metrics[62]["loss"] == 0.0 and r.summary["loader"]["corrupt_skipped"] == 5
