"""The DALI loader backend: exact order, exact pixels, png/jpg decoding, and augmentation that is
statistically the same as TorchAugment (CPU pipelines; the GPU path is marked ``gpu``)."""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from conftest import write_images
from sluice.stages.load.augment import (AugmentSpec, BrightnessContrast, Cutout, Flip, Normalize,
                            RandomResizedCrop, TorchAugment, Translate)
from sluice.stages.data.config import IngestConfig
from sluice.stages.load.sample_index import SampleIndex
from sluice.stages.data.shard import ShardConfig, shard_dataset
from sluice.storage.artifact import open_artifact

pytest.importorskip("nvidia.dali")
from sluice.stages.load.backends.dali import DaliBackend  # noqa: E402

CPU = torch.device("cpu")
QUIET = dict(progress=False, workers=1)


def _image_artifact(tmp_path_factory, fmt):
    d = tmp_path_factory.mktemp(fmt)
    write_images(d / "src", n_per_class=12, size=(64, 64), fmt=fmt)
    s = shard_dataset(IngestConfig(source=str(d / "src"), holdout_fraction=0, val_fraction=0,
                                   test_fraction=0.2),
                      d / "out", ShardConfig(encoding=fmt, shard_samples=8, **QUIET))
    return open_artifact(s.root)


def _varsize_artifact(tmp_path_factory):
    d = tmp_path_factory.mktemp("varsize")
    write_images(d / "src", n_per_class=6, classes=("a",), size=(40, 50), fmt="jpg")
    write_images(d / "src", n_per_class=6, classes=("b",), size=(30, 20), fmt="jpg", seed=1)
    s = shard_dataset(IngestConfig(source=str(d / "src"), holdout_fraction=0, val_fraction=0,
                                   test_fraction=0.2),
                      d / "out", ShardConfig(encoding="jpg", shard_samples=4, **QUIET))
    return open_artifact(s.root)


@pytest.fixture(scope="module", autouse=True)
def arts(fmnist_artifact, tmp_path_factory):
    """Every artifact is written before any DALI pipeline exists: shard_dataset forks (its pool,
    the ffcv writer), and forking a process while DALI's threads run can deadlock the child.
    Pipelines are freed (threads joined) when their backends are collected."""
    out = {"fmnist": open_artifact(fmnist_artifact.root), "ramp": _ramp_artifact(tmp_path_factory),
           "png": _image_artifact(tmp_path_factory, "png"),
           "jpg": _image_artifact(tmp_path_factory, "jpg"),
           "varsize": _varsize_artifact(tmp_path_factory)}
    yield out
    gc.collect()


@pytest.fixture(scope="module")
def fmnist(arts):
    return arts["fmnist"]


@pytest.fixture(scope="module")
def ramp(arts):
    return arts["ramp"]


@pytest.fixture(scope="module")
def plain(fmnist):
    be = DaliBackend(fmnist, "train", None, CPU, workers=2, seed=0)
    yield be
    be.close()


def _collect(it):
    xs, ys, ids = zip(*list(it))
    return list(xs), list(ys), list(ids)


def _ramp_artifact(tmp_path_factory, n=256, h=48, w=64):
    """RGB npy images whose channel 0 is 4*x and channel 1 is 4*y (x and y are readable back)."""
    d = tmp_path_factory.mktemp("ramp")
    xs = np.broadcast_to(np.arange(w, dtype=np.uint8)[None, :] * 4, (h, w))
    ys = np.broadcast_to(np.arange(h, dtype=np.uint8)[:, None] * 4, (h, w))
    img = np.stack([xs, ys, np.zeros((h, w), np.uint8)], -1)
    np.savez(d / "ramp.npz", images=np.broadcast_to(img, (n, h, w, 3)).copy(),
             labels=np.arange(n) % 2, class_names=np.array(["a", "b"]))
    s = shard_dataset(IngestConfig(source=str(d / "ramp.npz"), holdout_fraction=0, val_fraction=0,
                                   test_fraction=0.1),
                      d / "out", ShardConfig(shard_samples=64, **QUIET))
    return open_artifact(s.root)


@pytest.mark.slow
def test_import_does_not_load_dali():
    import subprocess
    import sys
    code = "import sys; import sluice.stages.load.backends.dali; print('nvidia.dali' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=str(__import__('conftest').ROOT), check=True)
    assert out.stdout.strip() == "False"


def test_missing_dali_names_the_package(fmnist, monkeypatch):
    import importlib

    from sluice.errors import MissingDependency
    real = importlib.import_module

    def fake(name, *a, **k):
        if name.startswith("nvidia.dali"):
            raise ImportError("No module named 'nvidia.dali'")
        return real(name, *a, **k)
    monkeypatch.setattr(importlib, "import_module", fake)
    with pytest.raises(MissingDependency, match="nvidia-dali-cuda120"):
        DaliBackend(fmnist, "train", None, CPU, workers=1)


def test_order_exact_and_pixels_exact(fmnist, plain):
    n = fmnist.manifest.split("train").count
    labels = fmnist.labels("train")
    si = SampleIndex(fmnist, "train")
    order = np.random.default_rng(1).permutation(n)
    xs, ys, ids = _collect(plain.epoch(order, 64, drop_last=False))
    assert [len(i) for i in ids] == [64] * (n // 64) + ([n % 64] if n % 64 else [])
    got = torch.cat(ids).numpy()
    assert np.array_equal(got, order)
    assert np.array_equal(torch.cat(ys).numpy(), labels[order])
    for x, i in zip(xs, ids):
        assert x.dtype == torch.float32 and x.shape[1:] == (1, 28, 28)
        ref = torch.stack([torch.from_numpy(si.pixels(int(k)).copy()) for k in i])
        assert torch.equal(x, ref.permute(0, 3, 1, 2).float() / 255.0)
    # a second epoch with another order (pipeline reused), drop_last and start_batch
    order2 = np.random.default_rng(2).permutation(n)[:300]
    _, ys2, ids2 = _collect(plain.epoch(order2, 64, drop_last=True, start_batch=2, epoch=1))
    assert [len(i) for i in ids2] == [64, 64]
    assert np.array_equal(torch.cat(ids2).numpy(), order2[128:256])
    assert np.array_equal(torch.cat(ys2).numpy(), labels[order2[128:256]])
    # abandoning an epoch half way leaves the backend usable
    it = plain.epoch(order, 32, drop_last=False)
    next(it)
    _, _, ids3 = _collect(plain.epoch(order[:70], 32, drop_last=False))
    assert np.array_equal(torch.cat(ids3).numpy(), order[:70])
    assert list(plain.epoch(order[:10], 32, drop_last=True)) == []
    assert set(plain.timings) >= {"read", "decode+augment", "transfer"}


@pytest.mark.parametrize("fmt", ["png", "jpg"])
def test_png_jpg_decode(arts, fmt):
    a = arts[fmt]
    n = a.manifest.split("train").count
    order = np.arange(n)[::-1].copy()
    be = DaliBackend(a, "train", None, CPU, workers=2)
    xs, ys, ids = _collect(be.epoch(order, 7, drop_last=False))
    assert np.array_equal(torch.cat(ids).numpy(), order)
    si = SampleIndex(a, "train")
    for x, i in zip(xs, ids):
        assert x.dtype == torch.float32 and x.shape[1:] == (3, 64, 64)
        assert 0.0 <= x.min() and x.max() <= 1.0
        ref = torch.stack([torch.from_numpy(si.pixels(int(k)).copy()) for k in i]).permute(0, 3, 1, 2).float() / 255
        if fmt == "png":
            assert torch.equal(x, ref)
        else:  # libjpeg-turbo vs PIL: a few levels at most
            assert (x - ref).abs().mean() < 3 / 255
    # standard augmentation at a new resolution on decoded images
    be2 = DaliBackend(a, "train", AugmentSpec.standard(mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25)), CPU, 2)
    x, _, _ = next(iter(be2.epoch(order, 8, drop_last=False, resolution=32)))
    assert x.shape == (8, 3, 32, 32) and x.min() >= -2.0 - 1e-5 and x.max() <= 2.0 + 1e-5


def test_variable_size_images(arts):
    a = arts["varsize"]
    assert a.manifest.fields.image.shape is None
    order = np.arange(a.manifest.split("train").count)
    be = DaliBackend(a, "train", AugmentSpec(ops=[RandomResizedCrop(size=16), Flip(), Cutout(size=4)]), CPU, 2)
    xs, _, ids = _collect(be.epoch(order, 4, False))
    assert all(x.shape[1:] == (3, 16, 16) for x in xs) and np.array_equal(torch.cat(ids).numpy(), order)
    be = DaliBackend(a, "train", AugmentSpec(ops=[Flip()]), CPU, 2)
    assert all(b[0].shape[1:] == (3, 24, 24) for b in be.epoch(order, 4, False, resolution=24))
    with pytest.raises(ValueError, match="different sizes"):
        list(be.epoch(order, 4, False))


def _crop_stats(x: torch.Tensor, h: int, w: int):
    """From ramp images (ch0 = 4x/255, ch1 = 4y/255 after crop+bilinear resize): flip flags and
    crop area fractions."""
    s = x.shape[-1]
    row = x[:, 0, s // 2, :] * 255 / 4  # source x coordinate of each output column
    col = x[:, 1, :, s // 2] * 255 / 4
    flipped = row[:, 0] > row[:, -1]
    bw = (row[:, 0] - row[:, -1]).abs() * s / (s - 1)
    bh = (col[:, -1] - col[:, 0]).abs() * s / (s - 1)
    return flipped.numpy(), (bw * bh / (h * w)).numpy()


def test_rrc_and_flip_statistics_match_torch(ramp):
    scale = (0.25, 0.8)
    spec = AugmentSpec(ops=[RandomResizedCrop(size=24, scale=scale), Flip(p=0.3)])
    be = DaliBackend(ramp, "train", spec, CPU, workers=2, seed=3)
    n = ramp.manifest.split("train").count
    order = np.concatenate([np.random.default_rng(k).permutation(n) for k in range(5)])
    xs, _, ids = _collect(be.epoch(order, 128, drop_last=False))
    x = torch.cat(xs)
    assert x.shape == (len(order), 3, 24, 24) and np.array_equal(torch.cat(ids).numpy(), order)
    assert x.min() >= 0 and x.max() <= 1
    flipped, area = _crop_stats(x, 48, 64)
    assert abs(flipped.mean() - 0.3) < 0.06
    assert area.min() > scale[0] - 0.03 and area.max() < scale[1] + 0.03
    # the torch reference on the same images
    si = SampleIndex(ramp, "train")
    imgs = torch.from_numpy(np.stack([si.pixels(int(i)) for i in order[:1000]]))
    tx = torch.cat([TorchAugment(spec, seed=5)(imgs[k:k + 200]) for k in range(0, 1000, 200)])
    tflip, tarea = _crop_stats(tx, 48, 64)
    assert abs(tflip.mean() - flipped.mean()) < 0.07
    assert abs(np.mean(tarea) - np.mean(area)) < 0.03
    assert abs(np.std(tarea) - np.std(area)) < 0.03
    # reproducible, and start_batch resumes with exactly a full epoch's batches
    a = torch.cat([b[0] for b in be.epoch(order[:512], 128, False, epoch=7)])
    b = torch.cat([b[0] for b in be.epoch(order[:512], 128, False, start_batch=2, epoch=7)])
    c = torch.cat([b[0] for b in be.epoch(order[:512], 128, False, epoch=8)])
    assert torch.equal(a[256:], b) and not torch.equal(a, c)
    # resolution overrides the RRC size, without a rebuild
    x2, _, _ = next(iter(be.epoch(order, 16, False, resolution=40)))
    assert x2.shape == (16, 3, 40, 40)


def test_all_ops_against_torch(fmnist):
    spec = AugmentSpec(ops=[RandomResizedCrop(scale=(0.5, 1.0)), Flip(), Translate(pad=3),
                            Cutout(size=8, p=0.7), BrightnessContrast(brightness=0.3, contrast=0.3),
                            Normalize(mean=[0.3], std=[0.3])], channels_last=True)
    be = DaliBackend(fmnist, "train", spec, CPU, workers=2, seed=1)
    n = fmnist.manifest.split("train").count
    order = np.arange(n)
    xs, _, _ = _collect(be.epoch(order, 100, drop_last=False))
    x = torch.cat(xs)
    assert x.shape == (n, 1, 28, 28) and x.is_contiguous(memory_format=torch.channels_last)
    si = SampleIndex(fmnist, "train")
    imgs = torch.from_numpy(np.stack([si.pixels(int(i)) for i in order]))
    t = TorchAugment(spec, seed=2)(imgs)
    lo, hi = (0 - 0.3) / 0.3, (1 - 0.3) / 0.3
    assert x.min() >= lo - 1e-4 and x.max() <= hi + 1e-4
    assert abs(x.mean() - t.mean()) < 0.05 and abs(x.std() - t.std()) < 0.05
    # fraction of pixels at exactly "zero" (cutout, translate padding, background)
    zx, zt = (x <= lo + 1e-4).float().mean(), (t <= lo + 1e-4).float().mean()
    assert abs(zx - zt) < 0.04
    # no RRC: a resolution resizes the whole image
    be2 = DaliBackend(fmnist, "train", AugmentSpec(ops=[Flip()]), CPU, workers=2)
    x2, _, _ = next(iter(be2.epoch(order, 10, False, resolution=20)))
    assert x2.shape == (10, 1, 20, 20) and 0 <= x2.min() and x2.max() <= 1


def test_normalize_must_be_last(fmnist):
    with pytest.raises(ValueError, match="last"):
        DaliBackend(fmnist, "train", AugmentSpec(ops=[Normalize(), Flip()]), CPU, workers=1)


@pytest.mark.gpu
def test_gpu_pipeline(fmnist):
    be = DaliBackend(fmnist, "train", AugmentSpec.standard(), torch.device("cuda"), workers=2)
    order = np.arange(200)
    xs, ys, ids = _collect(be.epoch(order, 64, drop_last=False))
    assert xs[0].device.type == "cuda" and np.array_equal(torch.cat(ids).numpy(), order)


@pytest.mark.slow
def test_ten_shuffled_epochs_deliver_every_sample_once_in_order_augmented(fmnist):
    """DALI's CPU pipeline (2 threads, built once and reused) on npy FMNIST with RRC + flip +
    normalize: ten epochs' orders come back whole, each sample once and in order, as normalised
    float images that the augmentation changed (its speed is benchmarks/loader.py's to measure)."""
    be = DaliBackend(fmnist, "train", AugmentSpec.standard(), CPU, workers=2)
    n = fmnist.manifest.split("train").count
    si = SampleIndex(fmnist, "train")
    changed = 0
    for k in range(10):
        order = np.random.default_rng(k).permutation(n)
        ids = []
        for x, _, i in be.epoch(order, 256, False, epoch=k):
            assert x.dtype == torch.float32 and x.shape == (len(i), 1, 28, 28)
            assert torch.isfinite(x).all()
            raw = torch.from_numpy(np.stack([si.pixels(int(j)) for j in i[:8]])).float().div(255)
            unnormalised = x[:8] * 0.25 + 0.5  # AugmentSpec.standard(): mean 0.5, std 0.25
            changed += int((unnormalised - raw.reshape(unnormalised.shape)).abs().flatten(1).amax(1).gt(0.05).sum())
            ids.append(i)
        assert np.array_equal(torch.cat(ids).numpy(), order)  # every sample, once, in order
    assert changed > 0  # the crops and flips were applied


@pytest.mark.parametrize("ops,resolution", [
    ([Flip(), Translate(pad=3), Cutout(size=8, p=0.7), BrightnessContrast(brightness=0.3, contrast=0.3),
      Normalize(mean=[0.3], std=[0.3])], None),
    ([RandomResizedCrop(scale=(0.5, 1.0)), Flip()], None),
    ([RandomResizedCrop(size=20, scale=(0.2, 1.0), ratio=(0.5, 2.0)), Flip(p=0.4), Cutout(size=5)], 36),
    ([Translate(pad=4), Flip()], 20),
])
def test_same_draws_as_torch_augment(fmnist, ops, resolution):
    """Batch b's parameters come from batch_seed(seed, epoch, b) with TorchAugment's own draw
    order, so TorchAugment reseeded with it gives the same images up to float rounding."""
    from sluice.stages.load.augment import batch_seed
    spec = AugmentSpec(ops=ops)
    be = DaliBackend(fmnist, "train", spec, CPU, workers=2, seed=4)
    si = SampleIndex(fmnist, "train")
    ta = TorchAugment(spec)
    order = np.random.default_rng(0).permutation(fmnist.manifest.split("train").count)[:250]
    for b, (x, _, i) in enumerate(be.epoch(order, 100, False, resolution=resolution, epoch=3)):
        ta.reseed(batch_seed(4, 3, b))
        t = ta(torch.from_numpy(np.stack([si.pixels(int(k)) for k in i])), resolution=resolution)
        assert x.shape == t.shape
        d = (x - t).abs()
        if resolution and not any(isinstance(o, RandomResizedCrop) for o in ops):
            # antialiased whole-image resize: DALI's and torch's filters differ slightly
            assert d.max() < 0.06 and d.mean() < 3e-3, (b, d.max(), d.mean())
        else:
            assert d.max() < 1e-4, (b, d.max())


@pytest.mark.parametrize("ops", [
    [Flip(), Translate(pad=3), Cutout(size=8, p=0.7), BrightnessContrast(brightness=0.3, contrast=0.3),
     Normalize(mean=[0.3], std=[0.3])],
    [RandomResizedCrop(size=20, scale=(0.3, 1.0)), Flip(p=0.4), Cutout(size=5), Normalize()],
], ids=["no-crop", "crop"])
@pytest.mark.slow
def test_every_backend_augments_batch_b_of_epoch_e_identically(fmnist, ops):
    """One draw per (seed, epoch, batch), made by the ops themselves, applied by every backend:
    memory, FFCV and WebDataset give bit-identical batches; DALI's operators give the same
    images up to float rounding (resampling filters differ slightly after a crop)."""
    from sluice.stages.load import Loader, LoaderConfig
    out = {}
    for backend in ("memory", "ffcv", "webdataset", "dali"):
        cfg = LoaderConfig(split="train", batch_size=100, backend=backend, workers=1, seed=5,
                           augment=AugmentSpec(ops=ops), prefetch=0)
        loader = Loader(fmnist, cfg)
        loader.set_epoch(2)
        out[backend] = [b for _, b in zip(range(3), loader)]
    ref = out["memory"]
    for backend, batches in out.items():
        for (x, y, i), (rx, ry, ri) in zip(batches, ref):
            assert torch.equal(i, ri) and torch.equal(y, ry)
            if backend != "dali":
                assert torch.equal(x, rx), backend
            elif ops[0].op == "random_resized_crop":  # OpenCV (uint8) vs DALI (float) resampling
                assert (x - rx).abs().mean() < 0.02, (x - rx).abs().mean()
            else:
                assert (x - rx).abs().max() < 1e-4, (x - rx).abs().max()
