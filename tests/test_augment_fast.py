"""TorchAugment's OpenCV fast path (``fast_cpu=True``, what the Loader uses on CPU): the same random
draws as the torch path, statistically the same images, the same output contract."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from sluice.stages.load.augment import (AugmentSpec, BrightnessContrast, Cutout, Flip, Normalize, RandomResizedCrop,
                            TorchAugment, Translate)

pytest.importorskip("cv2")


def _smooth(n=256, h=48, w=40, c=3, seed=0):
    """Smooth colour images (low-frequency sines): bilinear variants agree closely on them."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    ph = rng.uniform(0, 2 * np.pi, (n, c, 2))
    fr = rng.uniform(0.05, 0.25, (n, c, 2))
    img = 127.5 + 120 * np.sin(fr[..., 0, None, None] * xx + ph[..., 0, None, None]) \
        * np.cos(fr[..., 1, None, None] * yy + ph[..., 1, None, None])
    return torch.from_numpy(np.clip(img, 0, 255).round().astype(np.uint8).transpose(0, 2, 3, 1).copy())


def _ramp_images(n=2000, h=28, w=28):
    cols = (np.arange(w) * 9).astype(np.uint8)
    return torch.from_numpy(np.broadcast_to(cols, (n, h, w))[..., None].copy())


SPECS = [
    AugmentSpec.standard(),
    AugmentSpec(ops=[RandomResizedCrop(size=24, scale=(0.2, 1.0), ratio=(0.5, 2.0)), Flip(p=0.3)]),
    AugmentSpec(ops=[RandomResizedCrop(size=32)], channels_last=True),
    AugmentSpec(ops=[RandomResizedCrop(), Flip(), Normalize(mean=[0.5, 0.4, 0.3], std=[0.2, 0.3, 0.25])],
                channels_last=True),
    AugmentSpec(ops=[RandomResizedCrop(size=40), Flip(), Cutout(size=6, p=0.5), Translate(pad=2),
                     BrightnessContrast(), Normalize()]),
]


@pytest.mark.parametrize("spec", SPECS, ids=range(len(SPECS)))
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("c", [1, 3])
def test_fast_path_matches_torch_path(spec, threads, c):
    x = _smooth(c=c)
    if c == 1 and any(isinstance(o, Normalize) and len(o.mean) > 1 for o in spec.ops):
        pytest.skip("per-channel normalize needs 3 channels")
    ref = TorchAugment(spec, seed=11)
    fast = TorchAugment(spec, seed=11, fast_cpu=True, threads=threads)
    for res in (None, 20):
        a, b = ref(x, resolution=res), fast(x, resolution=res)
        # the same draws, in the same order: the generators stay in step
        assert torch.equal(ref.gen.get_state(), fast.gen.get_state())
        assert a.shape == b.shape and b.dtype == torch.float32
        assert a.is_contiguous() == b.is_contiguous()
        assert a.is_contiguous(memory_format=torch.channels_last) == b.is_contiguous(memory_format=torch.channels_last)
        # back to 0..255 units
        std = [o.std for o in spec.ops if isinstance(o, Normalize)]
        unit = 255.0 * (min(std[0]) if std else 1.0)
        d = (a - b).abs() * unit
        assert d.mean() < 2.0, d.mean()  # < 2/255 on average
        if not any(isinstance(o, (BrightnessContrast, Cutout, Translate)) for o in spec.ops):
            assert d.max() < 40


def test_fast_path_contract_and_range():
    x = torch.randint(0, 256, (64, 32, 32, 3), dtype=torch.uint8)
    spec = AugmentSpec(ops=[RandomResizedCrop(size=24), Flip(), Normalize(mean=[0.5, 0.4, 0.3], std=[0.2, 0.2, 0.2])],
                       channels_last=True)
    y = TorchAugment(spec, fast_cpu=True, threads=2)(x)
    assert y.shape == (64, 3, 24, 24) and y.dtype == torch.float32
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert y.min() >= (0 - 0.5) / 0.2 - 1e-4 and y.max() <= (1 - 0.3) / 0.2 + 1e-4
    plain = TorchAugment(AugmentSpec(ops=[RandomResizedCrop()]), fast_cpu=True)(x)
    assert plain.min() >= 0 and plain.max() <= 1 and plain.shape == (64, 3, 32, 32) and plain.is_contiguous()
    with pytest.raises(ValueError, match="2 values for 3 channels"):
        TorchAugment(AugmentSpec(ops=[RandomResizedCrop(), Normalize(mean=[0.1, 0.2])]), fast_cpu=True)(x)
    # input untouched; specs without a leading RRC take the torch path
    x0 = x.clone()
    TorchAugment(AugmentSpec.standard(), fast_cpu=True, threads=2)(x)
    assert torch.equal(x, x0)
    f = TorchAugment(AugmentSpec(ops=[Flip(), RandomResizedCrop()]), seed=3, fast_cpu=True)(x)
    t = TorchAugment(AugmentSpec(ops=[Flip(), RandomResizedCrop()]), seed=3)(x)
    assert torch.equal(f, t)
    # a non-contiguous input (a strided view) works
    xs = x[::2]
    a = TorchAugment(AugmentSpec.standard(), seed=1, fast_cpu=True)(xs)
    b = TorchAugment(AugmentSpec.standard(), seed=1, fast_cpu=True)(xs.contiguous())
    assert torch.equal(a, b)


def test_fast_path_flip_rate_and_crop_scale():
    x = _ramp_images()
    # RRC with the whole image (scale 1, ratio 1) + flip: only the flip decides the ramp's direction
    spec = AugmentSpec(ops=[RandomResizedCrop(scale=(1.0, 1.0), ratio=(1.0, 1.0)), Flip(p=0.3)])
    out = TorchAugment(spec, seed=0, fast_cpu=True, threads=2)(x)
    flipped = (out[:, 0, 0, 0] > out[:, 0, 0, -1]).float().mean().item()
    assert abs(flipped - 0.3) < 0.04
    ref = TorchAugment(spec, seed=0)(x)
    assert torch.equal(out[:, 0, 0, 0] > out[:, 0, 0, -1], ref[:, 0, 0, 0] > ref[:, 0, 0, -1])
    spec = AugmentSpec(ops=[RandomResizedCrop(size=28, scale=(0.25, 0.5), ratio=(1.0, 1.0))])
    out = TorchAugment(spec, seed=1, fast_cpu=True)(x) * 255 / 9
    width = (out[:, 0, 0, -1] - out[:, 0, 0, 0] + 1).numpy()
    area = (width / 28) ** 2
    assert area.min() > 0.25 * 0.8 and area.max() < 0.5 * 1.2
    assert 0.3 < np.median(area) < 0.45


def test_fast_path_is_reproducible_and_pickles():
    import pickle
    x = _smooth(n=100)
    a = TorchAugment(AugmentSpec.standard(), seed=5, fast_cpu=True, threads=2)
    y1 = a(x)
    a.reseed(5)
    assert torch.equal(a(x), y1)
    b = pickle.loads(pickle.dumps(a))
    b.reseed(5)
    assert torch.equal(b(x), y1)


class _FakeIndex:
    """What ``_pixels`` needs of a SampleIndex: the encoding, raw bytes, the PIL decode (timed and
    untimed), where to add its decode time, and how it names damage."""
    encoding = "jpg"

    def __init__(self, blobs):
        from sluice.stages.load.timings import Timings
        self.blobs = blobs
        self.timings = Timings()

    def read(self, i):
        return self.blobs[i]

    def decode(self, data):
        import io
        from PIL import Image
        with Image.open(io.BytesIO(data)) as im:
            arr = np.asarray(im)
        return arr[:, :, None] if arr.ndim == 2 else arr

    decode_untimed = decode  # the batched path times decoding itself

    def damaged(self, i, reason):
        raise AssertionError(f"sample {i} reported damaged: {reason}")

    def pixels(self, i):
        return self.decode(self.blobs[i])


def test_opencv_jpeg_decode_matches_pil():
    import io
    from PIL import Image
    from sluice.stages.load.decode import pixels as _pixels
    rng = np.random.default_rng(0)
    smooth = _smooth(n=4, h=37, w=53).numpy()
    blobs = []
    for k, img in enumerate(smooth):
        noisy = np.clip(img.astype(int) + rng.integers(-20, 20, img.shape), 0, 255).astype(np.uint8)
        for arr, mode in [(img, "RGB"), (noisy, "RGB"), (img[..., 0], "L"), (noisy, "CMYK")]:
            im = Image.fromarray(arr, "RGB" if mode != "L" else "L")
            im = im.convert(mode) if mode == "CMYK" else im
            b = io.BytesIO()
            kw = {"quality": 75 + 5 * k, "subsampling": k % 3} if mode == "RGB" else {"quality": 90}
            if mode == "RGB" and k == 1:  # an EXIF orientation tag: PIL does not apply it, nor do we
                exif = Image.Exif()
                exif[0x0112] = 6
                kw["exif"] = exif.tobytes()
            im.save(b, "JPEG", **kw)
            blobs.append(b.getvalue())
    from sluice.stages.load.decode import jpeg_components as _jpeg_components
    assert [_jpeg_components(b) for b in blobs[:4]] == [3, 3, 1, 4]  # OpenCV, OpenCV, OpenCV, PIL
    assert _jpeg_components(b"not a jpeg") is None
    si = _FakeIndex(blobs)
    for i in range(len(blobs)):
        a, b = _pixels(si, i), si.pixels(i)
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), i
