"""``center_crop``, the evaluation transform (torchvision's ``Resize + CenterCrop``): its pixels by
hand and against PIL, on a fixed-size batch and on a canvas of photos of different sizes; eval
loaders over a variable-size JPEG split on every backend that reads one (webdataset, ffcv, and
DALI's CPU pipeline) give the same batches in split order; and the variable-size rule names every
op that makes one size."""
from __future__ import annotations

import gc
import importlib.util
import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sluice.errors import LoaderError
from sluice.stages.data.config import IngestConfig, ShardConfig
from sluice.stages.data.shard import shard_dataset
from sluice.stages.load import Loader
from sluice.stages.load.augment import (AugmentSpec, CenterCrop, Flip, Normalize, RandomResizedCrop,
                                        TorchAugment, draw_params)
from sluice.stages.load.augment.torch_path import check_variable_sizes
from sluice.stages.load.canvas import canvas
from sluice.stages.load.sample_index import SampleIndex
from sluice.storage.artifact import open_artifact

HAS_DALI = importlib.util.find_spec("nvidia.dali") is not None
BACKENDS = ["webdataset", "ffcv"] + (["dali"] if HAS_DALI else [])
MEAN, STD = [0.4, 0.5, 0.6], [0.2, 0.25, 0.3]


def _photo(h: int, w: int, k: int, rng: np.random.Generator, sharp: bool = True) -> np.ndarray:
    """A product-photo-like RGB image: a bright ellipse (the object, framed to the image) on a
    gradient, with stripes — sharp and fine (detail that a several-fold shrink aliases), or soft
    and wide (what JPEG's re-encoding in the FFCV field keeps) — and a little noise."""
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    bg = np.stack([xx / w * 120, yy / h * 120, np.full_like(xx, 40 + 3 * k)], -1)
    inside = ((yy - h / 2) / (0.45 * h)) ** 2 + ((xx - w / 2) / (0.45 * w)) ** 2 < 1
    wave = np.sin(xx * (0.8 + 0.1 * (k % 5)) / (1 if sharp else 4))
    stripes = 60 * (wave > 0) if sharp else 30 * wave
    obj = np.stack([180 + stripes, 120 + 0 * xx, 200 - stripes], -1)
    img = np.where(inside[..., None], obj, bg) + rng.normal(0, 4 if sharp else 1, (h, w, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def _photos(n: int, seed: int = 0, sharp: bool = True) -> list[np.ndarray]:
    """``n`` photos 40–146 px high in three aspect ratios (1, 4/3, 3/4), as issue #48's folder."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        h = int(rng.integers(40, 147))
        w = int(min(146, max(40, round(h * [1.0, 4 / 3, 3 / 4][k % 3]))))
        out.append(_photo(h, w, k, rng, sharp))
    return out


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """48 variable-size JPEG photos in two classes, sharded keeping the JPEG bytes (one split).
    Written before any DALI pipeline of this module exists (shard_dataset forks); pipelines are
    freed when their loaders are collected."""
    from PIL import Image
    root = tmp_path_factory.mktemp("photos")
    for k, img in enumerate(_photos(48, sharp=False)):
        d = root / "src" / f"c{k % 2}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(d / f"{k:03d}.jpg", quality=90)
    s = shard_dataset(IngestConfig(source=str(root / "src"), kind="folder", holdout_fraction=0, val_fraction=0,
                                   test_fraction=0),
                      root / "out", ShardConfig(encoding="jpg", jpeg_quality=90, shard_samples=16, progress=False,
                                                workers=1))
    yield open_artifact(s.root)
    gc.collect()


def _nchw(imgs: list[np.ndarray] | np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.stack(imgs)).permute(0, 3, 1, 2).float()


# ---- the op's pixels ---------------------------------------------------------------------

@pytest.mark.parametrize("antialias", [False, True])
@pytest.mark.parametrize("fast_cpu", [False, True])
def test_fixed_size_batch_is_resize_short_side_then_centre_crop(antialias, fast_cpu):
    """On one size: torchvision's ``Resize(r) + CenterCrop(s)`` written out by hand. 40×60
    landscape, s=16: resize to 16×24, crop columns 4..20; s=14, crop_fraction 0.875: r = 16,
    rows 1..15, columns 5..19; a 60×40 portrait: rows 4..20. (The OpenCV fast path is for a
    leading random_resized_crop only: the same pixels with it on.)"""
    rng = np.random.default_rng(0)
    land = np.stack([_photo(40, 60, k, rng) for k in range(3)])
    port = np.stack([_photo(60, 40, k, rng) for k in range(2)])

    def ours(imgs, op, resolution=None):
        return TorchAugment(AugmentSpec(ops=[op]), fast_cpu=fast_cpu)(torch.from_numpy(imgs), resolution) * 255

    def hand(imgs, hw, rows, cols):
        x = F.interpolate(_nchw(imgs), size=hw, mode="bilinear", align_corners=False, antialias=antialias)
        return x[:, :, rows[0]:rows[1], cols[0]:cols[1]]

    cases = [(land, CenterCrop(size=16, antialias=antialias), (16, 24), (0, 16), (4, 20)),
             (land, CenterCrop(size=14, crop_fraction=0.875, antialias=antialias), (16, 24), (1, 15), (5, 19)),
             (port, CenterCrop(size=16, antialias=antialias), (24, 16), (4, 20), (0, 16))]
    for imgs, op, hw, rows, cols in cases:
        got = ours(imgs, op)
        assert got.shape == (len(imgs), 3, op.size, op.size)
        assert (got - hand(imgs, hw, rows, cols)).abs().max() < 2e-3  # 0..255 levels
    # the epoch's resolution replaces the size, as for a random_resized_crop; with neither, the
    # output side is the short side (here: the central 40×40, no resampling)
    at_20 = ours(land, CenterCrop(size=16, antialias=antialias), 20)
    assert (at_20 - hand(land, (20, 30), (0, 20), (5, 25))).abs().max() < 2e-3
    assert torch.allclose(ours(land, CenterCrop(antialias=antialias)), _nchw(land)[:, :, :, 10:50], atol=2e-3)
    # squash: the whole image to the square (timm's crop_mode="squash"); with crop_fraction 0.8
    # both sides go to 20 and the central 16×16 is kept
    for imgs in (land, port):
        got = ours(imgs, CenterCrop(size=16, crop_mode="squash", antialias=antialias))
        assert (got - hand(imgs, (16, 16), (0, 16), (0, 16))).abs().max() < 2e-3
        got = ours(imgs, CenterCrop(size=16, crop_fraction=0.8, crop_mode="squash", antialias=antialias))
        assert (got - hand(imgs, (20, 20), (2, 18), (2, 18))).abs().max() < 2e-3


def test_antialias_is_pils_resize_and_plain_bilinear_is_not():
    """PIL (``Image.resize`` BILINEAR, which always antialiases, then ``crop``) on two photos shrunk
    3.4× and 1.3× to 32 px: ``antialias=True`` is within rounding of it; the default (bilinear
    without antialiasing, as the training crop samples) aliases the striped object, the more the
    more it shrinks (measured: 10.9 and 2.5 levels on average)."""
    from PIL import Image
    rng = np.random.default_rng(3)
    plain_off = []
    for h, w in [(146, 110), (41, 55)]:
        img = _photo(h, w, 2, rng)
        rh, rw = (int(32 * h / w), 32) if w < h else (32, int(32 * w / h))
        top, left = int(round((rh - 32) / 2)), int(round((rw - 32) / 2))
        pil = np.asarray(Image.fromarray(img).resize((rw, rh), Image.BILINEAR).crop((left, top, left + 32, top + 32)))
        pil = _nchw([pil])
        aa = TorchAugment(AugmentSpec(ops=[CenterCrop(size=32, antialias=True)]))(torch.from_numpy(img[None])) * 255
        plain = TorchAugment(AugmentSpec(ops=[CenterCrop(size=32)]))(torch.from_numpy(img[None])) * 255
        assert (aa - pil).abs().max() <= 1.0 + 1e-3 and (aa - pil).abs().mean() < 0.5  # PIL rounds to uint8
        plain_off.append((plain - pil).abs().mean().item())
    assert plain_off[0] > 5 and plain_off[1] < plain_off[0] / 2, plain_off


@pytest.mark.parametrize("antialias", [False, True])
def test_canvas_of_different_sizes_equals_each_image_alone(antialias):
    """Variable sizes on one zero-padded canvas: each output is that image cropped alone (the
    padding is never read), and the op draws nothing (a following flip's draws are unchanged)."""
    imgs = _photos(9, seed=1)
    c = canvas([torch.from_numpy(im) for im in imgs])
    spec = AugmentSpec(ops=[CenterCrop(size=24, crop_fraction=0.875, antialias=antialias), Flip(p=0.5)])
    got = TorchAugment(spec, seed=5)(c.pixels, None, c.sizes)
    assert got.shape == (9, 3, 24, 24)
    flips = draw_params([Flip(p=0.5)], 9, c.sizes[:, 0], c.sizes[:, 1], None, torch.Generator().manual_seed(5))[0]
    with_crop = draw_params(spec.ops, 9, c.sizes[:, 0], c.sizes[:, 1], None, torch.Generator().manual_seed(5))[1]
    assert torch.equal(flips["mask"], with_crop["mask"])
    alone = AugmentSpec(ops=[spec.ops[0]])
    for k, im in enumerate(imgs):
        ref = TorchAugment(alone)(torch.from_numpy(im[None]))[0]
        ref = ref.flip(-1) if flips["mask"][k] else ref
        assert (got[k] - ref).abs().max() < 1e-5


# ---- eval loaders over variable-size photos, every backend -----------------------------------

def _eval(root, backend: str, antialias: bool) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    spec = AugmentSpec(ops=[CenterCrop(size=32, antialias=antialias), Normalize(mean=MEAN, std=STD)])
    loader = Loader(root, backend=backend, batch_size=8, workers=1, augment=spec, sampler={"kind": "sequential"})
    xs, ids, lens = [], [], []
    for x, _, i in loader:
        xs.append(x.clone())
        ids.append(i.clone())
        lens.append(len(i))
        assert x.shape == (len(i), 3, 32, 32) and x.dtype == torch.float32
    del loader
    gc.collect()  # a DALI pipeline's threads end with it
    return torch.cat(xs), torch.cat(ids), lens


@pytest.mark.parametrize("antialias", [False, True])
def test_eval_loader_gives_the_same_centre_crops_on_every_backend(photos, antialias):
    """[center_crop(32), normalize] on the variable-size JPEG split: 32×32 batches, every sample
    once in split order, the same pixels on every backend: the tar shards and the .beton hold the
    same JPEG bytes (the photo's own) and every backend decodes them alike. DALI's antialiased
    filter differs from torch's in detail only (measured 2.1 levels at most). And the pixels are each photo's own centre crop."""
    assert photos.manifest.fields.image.shape is None  # variable sizes
    n = photos.manifest.split("train").count
    std = torch.tensor(STD).view(1, 3, 1, 1)
    out = {b: _eval(photos.root, b, antialias) for b in BACKENDS}
    ref, ref_ids, lens = out["webdataset"]
    assert torch.equal(ref_ids, torch.arange(n)) and lens == [8] * (n // 8)
    for backend, (x, ids, blens) in out.items():
        assert torch.equal(ids, ref_ids) and blens == lens, backend
        d = (x - ref).abs() * std * 255  # 0..255 levels
        if backend == "dali" and antialias:
            assert d.max() <= 4 and d.mean() < 0.05, (backend, d.max(), d.mean())
        else:
            assert d.max() < 0.02, (backend, d.max())
    # each sample is its own photo's centre crop (decoded here with PIL: a level or two apart)
    from PIL import Image
    si = SampleIndex(photos, "train")
    op = AugmentSpec(ops=[CenterCrop(size=32, antialias=antialias)])
    unnorm = ref * std + torch.tensor(MEAN).view(1, 3, 1, 1)
    for i in range(0, n, 5):
        img = np.asarray(Image.open(io.BytesIO(si.read(i))).convert("RGB"))
        alone = TorchAugment(op)(torch.from_numpy(img[None].copy()))[0]
        assert ((unnorm[i] - alone).abs() * 255).max() < 8, i


# ---- the variable-size rule ------------------------------------------------------------------

def test_variable_sizes_need_a_leading_op_that_makes_one_size(photos):
    """Neither crop leading: the error names both; a crop without any size asks for one; on the
    tar path and on DALI alike, before a batch is decoded."""
    with pytest.raises(LoaderError, match="start with center_crop or random_resized_crop") as e:
        check_variable_sizes([Flip(), CenterCrop(size=8)], None)
    assert "starts with flip" in str(e.value)
    with pytest.raises(LoaderError, match="give the center_crop a size"):
        check_variable_sizes([CenterCrop()], None)
    check_variable_sizes([CenterCrop()], 24)  # the resolution is its size
    check_variable_sizes([RandomResizedCrop(size=8), Flip()], None)
    for backend in BACKENDS:
        loader = Loader(photos.root, backend=backend, batch_size=8, workers=1,
                        augment=AugmentSpec(ops=[Flip(), CenterCrop(size=32)]))
        with pytest.raises(LoaderError, match="center_crop or random_resized_crop"):
            next(iter(loader))
        del loader
        gc.collect()


def test_a_crop_size_above_the_stored_one_is_refused(fmnist_artifact):
    """A fixed-size 28×28 split: a centre crop to 64 would only upsample (as a resolution or a
    random_resized_crop above the stored size is refused)."""
    with pytest.raises(LoaderError, match="above the stored 28"):
        Loader(fmnist_artifact.root, backend="webdataset", batch_size=8, augment=AugmentSpec(ops=[CenterCrop(size=64)]))
    Loader(fmnist_artifact.root, backend="webdataset", batch_size=8, augment=AugmentSpec(ops=[CenterCrop(size=20)]))


@pytest.mark.skipif(not HAS_DALI, reason="needs nvidia-dali")
@pytest.mark.parametrize("resolution", [None, 24])
def test_dali_fixed_size_centre_crop_equals_torch(fmnist_artifact, resolution):
    """On a fixed-size npy split (28×28 gray): DALI's ROI resize gives TorchAugment's pixels, and
    the epoch's resolution is the crop's output (no whole-image resize after it)."""
    from sluice.stages.load.backends.dali import DaliBackend
    art = open_artifact(fmnist_artifact.root)
    spec = AugmentSpec(ops=[CenterCrop(size=20, crop_fraction=0.875), Flip(), Normalize(mean=[0.3], std=[0.3])])
    be = DaliBackend(art, "train", spec, torch.device("cpu"), workers=1, seed=2)
    si = SampleIndex(art, "train")
    order = np.arange(100)
    from sluice.stages.load.augment import batch_seed
    ta = TorchAugment(spec)
    for b, (x, _, i) in enumerate(be.epoch(order, 50, False, resolution=resolution, epoch=1)):
        ta.reseed(batch_seed(2, 1, b))
        t = ta(torch.from_numpy(np.stack([si.pixels(int(k)) for k in i])), resolution=resolution)
        side = resolution or 20
        assert x.shape == t.shape == (50, 1, side, side)
        assert (x - t).abs().max() < 1e-4
    be.close()
    del be
    gc.collect()
