"""``loader.decode: device``: the backends hand over checked JPEG bytes and the loader decodes each
batch in one call, then augments it with the very draws of the CPU path. Without a GPU the path
runs with its CPU stand-in (OpenCV): the batches equal the CPU-decoded ones, op by op; images of
different sizes ride one zero-padded canvas, cropped as each would be alone; undecodable samples
are quarantined, and resume is exact, as on the CPU path. The nvJPEG tests are marked ``gpu``
and skip without CUDA (conftest) or torchvision."""
from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from sluice.errors import CorruptSample, LoaderError
from sluice.stages.data.config import IngestConfig, ShardConfig
from sluice.stages.data.shard import shard_dataset
from sluice.stages.load import Loader, LoaderConfig
from sluice.stages.load.augment import (AugmentSpec, Flip, Normalize, RandomResizedCrop, TorchAugment,
                                        batch_seed, crop_resize)
from sluice.stages.load.augment import draw_params
from sluice.stages.load.augment.base import TorchContext
from sluice.stages.load.augment.fast_cpu import OpenCvPrefix
from sluice.stages.load.canvas import canvas
from sluice.stages.load.device_decode import (DEVICE_DECODERS, CpuDecoder, choose_decode, decode_cpu,
                                              decode_encoded)
from sluice.stages.load.canvas import encoded
from sluice.stages.load.sample_index import SampleIndex
from sluice.storage.artifact import open_artifact

BACKENDS = ["webdataset", "ffcv"]
MEAN, STD = [0.4, 0.5, 0.6], [0.2, 0.25, 0.3]
OPS = {"random_resized_crop": [RandomResizedCrop(size=20, scale=(0.3, 1.0))],
       "flip": [Flip()],
       "normalize": [Normalize(mean=MEAN, std=STD)]}
# FFCV decodes its JPEG field with its own libjpeg-turbo settings, the stand-in with OpenCV's:
# a few levels apart (the photo's own 4:2:0 bytes are kept, and the two upsample chroma
# differently: measured up to 8 levels, 1.2 on average, on two host classes). The tar path
# decodes with OpenCV both ways: equal. The mean bound keeps a wrong crop or flip from passing.
LEVELS = {"webdataset": 1e-5, "ffcv": 12 / 255}
MEAN_LEVELS = {"webdataset": 1e-5, "ffcv": 3 / 255}


def smooth_jpegs(root: Path, sizes: list[tuple[int, int]], gray: bool = False) -> None:
    """JPEGs of gradients and a little noise (what a decoder renders alike), two classes."""
    from PIL import Image
    rng = np.random.default_rng(0)
    for k, (h, w) in enumerate(sizes):
        yy, xx = np.mgrid[0:h, 0:w]
        base = np.stack([(xx * (k % 7 + 1) * 3) % 256, (yy * (k % 5 + 1) * 3) % 256, (xx + yy + 9 * k) % 256], -1)
        img = np.clip(base + rng.integers(0, 20, base.shape), 0, 255).astype(np.uint8)
        d = root / f"c{k % 2}"
        d.mkdir(parents=True, exist_ok=True)
        im = Image.fromarray(img)
        (im.convert("L") if gray else im).save(d / f"{k:03d}.jpg", quality=92)


def _artifact(root: Path, sizes, gray: bool = False):
    smooth_jpegs(root / "src", sizes, gray)
    s = shard_dataset(IngestConfig(source=str(root / "src"), kind="folder", holdout_fraction=0, val_fraction=0,
                                   test_fraction=0),
                      root / "out", ShardConfig(encoding="jpg", jpeg_quality=90, shard_samples=16, progress=False,
                                                workers=1, **({"channels": 1} if gray else {})))
    return open_artifact(s.root)


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    """Fixed-size RGB (40×48), variable-size RGB, and fixed-size gray JPEG artifacts."""
    root = tmp_path_factory.mktemp("decode")
    rng = np.random.default_rng(1)
    var = [(int(rng.integers(24, 64)), int(rng.integers(24, 64))) for _ in range(44)]
    return {"fixed": _artifact(root / "fixed", [(40, 48)] * 44),
            "var": _artifact(root / "var", var),
            "gray": _artifact(root / "gray", [(36, 30)] * 20, gray=True)}


def _epoch(root, **cfg) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    loader = Loader(root, **{"batch_size": 8, "workers": 1, **cfg})
    loader.set_epoch(1)
    return [tuple(t.clone() for t in b) for b in loader]


def _assert_same(a, b, atol, mean_atol=None):
    assert len(a) == len(b)
    for (xa, ya, ia), (xb, yb, ib) in zip(a, b):
        assert torch.equal(ia, ib) and torch.equal(ya, yb)
        assert xa.shape == xb.shape and xa.dtype == xb.dtype
        assert (xa - xb).abs().max().item() <= atol, (xa - xb).abs().max().item()
        if mean_atol is not None:
            assert (xa - xb).abs().mean().item() <= mean_atol, (xa - xb).abs().mean().item()


# ---- the same batches as the CPU path, one op at a time ------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(OPS))
def test_each_op_gives_the_cpu_paths_batches(arts, backend, op):
    root = arts["fixed"].root
    spec = AugmentSpec(ops=OPS[op])
    cpu = _epoch(root, backend=backend, augment=spec, decode="cpu", seed=3)
    dev = _epoch(root, backend=backend, augment=spec, decode="device", seed=3)
    scale = 1.0 if op != "normalize" else 1 / min(STD)  # normalise magnifies a level
    _assert_same(cpu, dev, LEVELS[backend] * scale, MEAN_LEVELS[backend] * scale)
    assert [len(b[1]) for b in dev] == [8] * 5 + [4]


@pytest.mark.parametrize("backend", BACKENDS)
def test_variable_sizes_cpu_and_device_decode_agree(arts, backend):
    root = arts["var"].root
    assert arts["var"].manifest.fields.image.shape is None
    spec = AugmentSpec.standard(size=20, mean=MEAN, std=STD)
    cpu = _epoch(root, backend=backend, augment=spec, decode="cpu")
    dev = _epoch(root, backend=backend, augment=spec, decode="device")
    _assert_same(cpu, dev, 1e-5)  # one decoder (OpenCV) both ways: FFCV decodes no variable sizes
    assert all(x.shape[1:] == (3, 20, 20) for x, _, _ in dev)
    assert np.array_equal(torch.cat([i for _, _, i in dev]).numpy(),
                          Loader(root, backend=backend, batch_size=8).epoch_indices(1))


@pytest.mark.parametrize("decode", ["cpu", "device"])
def test_variable_sizes_need_a_leading_crop(arts, decode):
    loader = Loader(arts["var"].root, backend="webdataset", batch_size=8, workers=0, decode=decode,
                    augment=AugmentSpec(ops=[Flip()]))
    with pytest.raises(LoaderError, match="random_resized_crop"):
        next(iter(loader))


def test_canvas_crop_resize_equals_each_image_alone():
    """Boxes in each image's pixels, theta against the canvas: the same pixels as cropping each
    image on its own, edges included (no zero of the padding is read)."""
    g = torch.Generator().manual_seed(0)
    sizes = [(31, 17), (12, 40), (25, 25), (9, 7)]
    imgs = [torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g) for h, w in sizes]
    c = canvas(imgs)
    boxes = torch.stack([RandomResizedCrop(scale=(0.1, 1.0)).draw(1, np.array([h]), np.array([w]), 16, g)["boxes"][0]
                         for h, w in sizes])
    boxes[0] = torch.tensor([31 - 5, 17 - 4, 5, 4])  # a crop in the bottom-right corner, upsampled
    flip = torch.tensor([False, True, False, True])
    x = c.pixels.permute(0, 3, 1, 2).float()
    got = crop_resize(x, boxes, (16, 16), flip, torch.from_numpy(c.sizes))
    for k, im in enumerate(imgs):
        ref = crop_resize(im.permute(2, 0, 1)[None].float(), boxes[k:k + 1], (16, 16), flip[k:k + 1])
        assert (got[k] - ref[0]).abs().max() < 1e-3  # 0..255 units


def test_augment_on_a_canvas_equals_the_per_image_reference():
    """``TorchAugment`` (torch path and OpenCV fast path) on a canvas with sizes: the draws and
    pixels of augmenting each image alone with the draws made for the batch's sizes."""
    g = torch.Generator().manual_seed(1)
    sizes = np.array([(30, 20), (22, 41), (30, 20), (50, 33)])
    imgs = [torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g) for h, w in sizes]
    c = canvas(imgs)
    spec = AugmentSpec.standard(size=16, mean=MEAN, std=STD)
    params = draw_params(spec.ops, 4, sizes[:, 0], sizes[:, 1], None, torch.Generator().manual_seed(7))
    for fast in (False, True):
        got = TorchAugment(spec, 7, fast_cpu=fast)(c.pixels, None, c.sizes)
        for k, im in enumerate(imgs):
            one = [{key: v[k:k + 1] for key, v in p.items()} for p in params]
            if fast:
                ref, _ = OpenCvPrefix()(im[None], spec.ops, one, False)
            else:
                ref = TorchAugment(spec).apply(im.permute(2, 0, 1)[None].float(), spec.ops, one, 0, TorchContext())
            assert (got[k] - ref[0]).abs().max() <= 1e-4


# ---- damage, resume, channels: as on the CPU path ------------------------------------------

def _break_jpeg(art, victims) -> None:
    """Overwrite each victim's JPEG start-of-image marker in its tar: its bytes no longer decode."""
    si = SampleIndex(art, "train")
    for i in victims:
        with open(si.path(int(si.shard_of[i])), "r+b") as f:
            f.seek(int(si.offset[i]))
            f.write(b"\xa5\xa5\xa5\xa5")


@pytest.mark.parametrize("decode", ["cpu", "device"])
def test_undecodable_samples_are_quarantined(arts, tmp_path, decode):
    root = tmp_path / "a"
    shutil.copytree(arts["fixed"].root, root)
    victims = [3, 17]
    _break_jpeg(open_artifact(root), victims)
    cfg = dict(backend="webdataset", batch_size=8, workers=1, decode=decode, check_samples=False)
    with pytest.raises(CorruptSample) as e:
        list(Loader(root, **cfg))
    assert e.value.index in victims and "cannot decode its jpg bytes" in str(e.value)
    assert e.value.file.startswith("train/") and e.value.file.endswith(".tar")
    loader = Loader(root, **cfg, on_corrupt="skip", max_corrupt_fraction=0.1)
    seen = torch.cat([i for _, _, i in loader]).tolist()
    assert sorted(set(range(44)) - set(seen)) == victims and len(seen) == 42
    assert loader.profile()["corrupt_skipped"] == 2
    with pytest.raises(Exception, match="max_corrupt_fraction"):
        list(Loader(root, **cfg, on_corrupt="skip", max_corrupt_fraction=0.01))


@pytest.mark.parametrize("backend", BACKENDS)
def test_damaged_bytes_fail_their_checksum_before_any_decode(arts, tmp_path, backend):
    root = tmp_path / "a"
    shutil.copytree(arts["fixed"].root, root)
    _break_jpeg(open_artifact(root), [5])
    if backend == "ffcv":  # the same in the .beton: 4 bytes of the victim's stored JPEG
        from sluice.stages.data.formats.beton import read_layout
        path = next(root.glob("train/*.beton"))
        _, _, meta, _ = read_layout(str(path))
        with open(path, "r+b") as f:
            f.seek(int(meta[meta.dtype.names[0]]["data_ptr"][5]))
            f.write(b"\xa5\xa5\xa5\xa5")
    with pytest.raises(CorruptSample, match="checksum") as e:
        list(Loader(root, backend=backend, batch_size=8, workers=1, decode="device"))
    assert e.value.index == 5


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_mid_epoch_is_exact_in_device_mode(arts, backend):
    root = arts["var"].root
    cfg = dict(backend=backend, batch_size=8, workers=1, decode="device",
               augment=AugmentSpec.standard(size=16, mean=MEAN, std=STD))
    full = _epoch(root, **cfg)
    first = Loader(root, **cfg)
    first.set_epoch(1)
    it = iter(first)
    next(it), next(it)
    state = first.state_dict()
    resumed = Loader(root, **cfg)
    resumed.load_state_dict(state)
    _assert_same(full[2:], [tuple(t.clone() for t in b) for b in resumed], 0.0)


def test_gray_jpegs_decode_to_one_channel(arts):
    art = arts["gray"]
    assert art.manifest.fields.image.shape == (36, 30, 1)
    cpu = _epoch(art.root, backend="webdataset", decode="cpu")
    dev = _epoch(art.root, backend="webdataset", decode="device")
    _assert_same(cpu, dev, 0.0)
    assert dev[0][0].shape[1:] == (1, 36, 30)
    si = SampleIndex(art, "train")
    datas = [si.read(i) for i in range(3)]
    imgs, keep, bad = decode_encoded(CpuDecoder(torch.device("cpu")), encoded(datas), 3)  # gray -> RGB
    assert keep == [0, 1, 2] and not bad and all(im.shape[2] == 3 for im in imgs)
    assert torch.equal(imgs[0][..., 0], imgs[0][..., 2])
    assert np.array_equal(decode_cpu(datas[0], 1), si.pixels(0))


# ---- which decoder --------------------------------------------------------------------------

def test_auto_decodes_on_the_cpu_here(arts):
    loader = Loader(arts["fixed"].root, backend="webdataset", batch_size=8)
    assert loader.decoding.mode == "cpu" and "the CPU" in loader.decoding.reason
    assert LoaderConfig().decode == "auto"
    assert choose_decode("auto", torch.device("cpu"), "jpg").mode == "cpu"
    with pytest.warns(UserWarning, match="only JPEG is decoded on the device"):
        assert choose_decode("device", torch.device("cpu"), "npy").mode == "cpu"
    assert choose_decode("device", torch.device("cpu"), "jpg").decoder.name == "cpu (OpenCV)"
    device = Loader(arts["fixed"].root, backend="webdataset", decode="device")
    device.backend()
    assert device.backend_reason.endswith("decode: device on a CPU loader: batched in the loader with OpenCV")


def test_device_without_a_device_decoder_says_so_once(monkeypatch):
    monkeypatch.setattr("sluice.stages.load.device_decode.DEVICE_DECODERS",
                        [(n, lambda: False, cls) for n, _, cls in DEVICE_DECODERS])
    monkeypatch.setattr("sluice.stages.load.device_decode._SAID", set())
    with pytest.warns(UserWarning, match="no device JPEG decoder is installed") as w:
        c = choose_decode("device", torch.device("cuda", 0), "jpg")
    assert c.mode == "cpu" and c.decoder is None and len(w) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose_decode("device", torch.device("cuda", 0), "jpg").mode == "cpu"  # said once
        assert choose_decode("auto", torch.device("cuda", 0), "jpg").mode == "cpu"  # auto: no warning


def test_auto_on_cuda_picks_an_installed_device_decoder(monkeypatch):
    monkeypatch.setattr("sluice.stages.load.device_decode.DEVICE_DECODERS",
                        [(n, (lambda n=n: n == "nvidia-dali"), cls) for n, _, cls in DEVICE_DECODERS])
    c = choose_decode("auto", torch.device("cuda", 0), "jpg")
    assert c.mode == "device" and c.decoder.name == "dali mixed"
    assert choose_decode("auto", torch.device("cuda", 0), "png").mode == "cpu"


# ---- on a GPU: nvJPEG + device augmentation against the CPU path ----------------------------

def _cpu_reference(art, spec, batch, b, seed=0, epoch=1) -> torch.Tensor:
    """Batch ``b`` as the CPU path makes it with the torch ops: OpenCV decode, the same draws."""
    si = SampleIndex(art, "train")
    imgs = [torch.from_numpy(decode_cpu(si.read(int(i)), 3)) for i in batch]
    c = canvas(imgs)
    aug = TorchAugment(spec, fast_cpu=False)
    aug.reseed(batch_seed(seed, epoch, b))
    return aug(torch.from_numpy(np.asarray(c.pixels)), None, c.sizes)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["fixed", "var"])
def test_nvjpeg_and_device_augment_match_the_cpu_path(arts, backend, which):
    pytest.importorskip("torchvision", reason="nvJPEG decode needs torchvision")
    art = arts[which]
    spec = AugmentSpec.standard(size=20, mean=MEAN, std=STD)
    loader = Loader(art.root, backend=backend, batch_size=8, workers=1, device="cuda", decode="device",
                    augment=spec)
    assert loader.decoding.mode == "device" and "nvjpeg" in loader.decoding.reason
    loader.set_epoch(1)
    for b, (x, _, idx) in enumerate(loader):
        assert x.is_cuda
        ref = _cpu_reference(art, spec, idx.cpu().numpy(), b)
        levels = (x.cpu() - ref).abs() * torch.tensor(STD).view(1, 3, 1, 1) * 255
        assert levels.mean() < 1.5 and torch.quantile(levels.flatten(), 0.999) < 12, levels.max()


@pytest.mark.gpu
def test_nvjpeg_decodes_what_opencv_decodes(arts):
    pytest.importorskip("torchvision", reason="nvJPEG decode needs torchvision")
    from sluice.stages.load.device_decode import TorchvisionDecoder
    art = arts["var"]
    si = SampleIndex(art, "train")
    datas = [si.read(i) for i in range(16)]
    imgs, keep, bad = decode_encoded(TorchvisionDecoder(torch.device("cuda")), encoded(datas), 3)
    assert keep == list(range(16)) and not bad
    for im, d in zip(imgs, datas):
        ref = torch.from_numpy(decode_cpu(d, 3))
        assert im.is_cuda and im.shape == ref.shape
        assert (im.cpu().int() - ref.int()).abs().float().mean() < 1.5
    broken = datas[:3] + [b"\xa5" * 50] + datas[3:5]
    imgs, keep, bad = decode_encoded(TorchvisionDecoder(torch.device("cuda")), encoded(broken), 3)
    assert keep == [0, 1, 2, 4, 5] and [k for k, _ in bad] == [3]
