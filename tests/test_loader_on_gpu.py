"""The memory backend on a CUDA device: the split stays on the GPU where it fits the device's
budget, else in pinned host RAM; either way the batches are the CPU loader's.

The budget decision and the three ways a batch is gathered (numpy, a held tensor, a staged
host tensor) are checked on every machine; the tests marked ``gpu`` run them on CUDA and skip
cleanly without it (conftest).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from sluice.stages.load import Loader, LoaderConfig, SamplerConfig
from sluice.stages.load.augment import AugmentSpec, Flip, Normalize, RandomResizedCrop, TorchAugment, batch_seed
from sluice.stages.load.backends.memory import MemoryBackend
from sluice.stages.load.budget import device_placement
from sluice.stages.load.integrity import Guard
from sluice.stages.load.finish_batches import BatchFinisher
from sluice.stages.load.timings import Timings
from test_gpu_paths import make_rgb_artifact

gpu = pytest.mark.gpu
DAMAGED = [3, 40, 41, 200]
SPEC = AugmentSpec(ops=[RandomResizedCrop(size=24, scale=(0.3, 1.0)), Flip(),
                        Normalize(mean=[0.4, 0.5, 0.6], std=[0.2, 0.25, 0.3])])


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    """A 600-sample RGB artifact (npy, small shards)."""
    return make_rgb_artifact(tmp_path_factory.mktemp("rgb"), test=100)


# ---- the device budget: decided from free bytes, so testable anywhere ---------------------

def test_split_stays_on_the_device_within_half_its_free_memory():
    p = device_placement(need=1_000_000_000, free=3_000_000_000)
    assert p.on_device and p.budget == 1_500_000_000
    assert "within" in p.explain() and "0.5 × free 3.00 GB" in p.explain()
    p = device_placement(need=1_000_000_000, free=1_900_000_000)
    assert not p.on_device and "more than" in p.explain()
    assert device_placement(need=10, free=40, fraction=0.2).on_device is False


def test_device_budget_override_wins_over_free_memory():
    p = device_placement(need=100, free=10**12, override=99)
    assert not p.on_device and p.override and "loader.device_memory_budget_bytes" in p.explain()
    assert device_placement(need=100, free=None, override=100).on_device
    assert not device_placement(need=1, free=None).on_device  # nothing read: the host keeps it
    assert LoaderConfig(device_memory_budget_bytes=5).device_memory_budget_bytes == 5
    assert LoaderConfig().device_memory_budget_bytes is None


# ---- how a batch is gathered: the same batches wherever the split lives ---------------------

def _with_damage(art) -> MemoryBackend:
    be = MemoryBackend(art, "train", 1, guard=Guard(art, "train", "skip", max_fraction=0.5))
    be.damaged[DAMAGED] = True
    return be


def _as_held(be: MemoryBackend, images: np.ndarray) -> None:
    """The split as a tensor held where it is (on CPU here; the GPU on a CUDA device)."""
    h = be.held
    h.images, h.held_labels = torch.from_numpy(images), torch.from_numpy(be.labels).long()
    h.resident, h.staged = True, False


def _as_staged(be: MemoryBackend, images: np.ndarray) -> None:
    h = be.held
    h.images, h.held_labels = torch.from_numpy(images), None
    h.resident, h.staged = False, True


@pytest.mark.parametrize("hold", [_as_held, _as_staged])
def test_tensor_gathers_equal_the_numpy_gather_with_damage_skipped(art, hold):
    """A held or staged split yields the numpy path's samples, labels and indices, damaged ones
    dropped and counted alike, from any start batch."""
    be = _with_damage(art)
    images = be.held.images
    order = np.random.default_rng(0).permutation(len(be.labels))
    for start in (0, 3):
        before = be.guard.skipped
        ref = list(be.epoch(order, 64, False, start))
        dropped = be.guard.skipped - before
        hold(be, images)
        got = list(be.epoch(order, 64, False, start))
        assert be.guard.skipped - before == 2 * dropped and (start or dropped == len(DAMAGED))
        assert len(got) == len(ref)
        for (x, y, i), (rx, ry, ri) in zip(got, ref):
            assert np.array_equal(np.asarray(x), rx) and np.array_equal(np.asarray(y), ry)
            assert np.array_equal(np.asarray(i), ri) and not set(DAMAGED) & set(np.asarray(i).tolist())
        be.held.images, be.held.resident, be.held.staged = images, False, False


@pytest.mark.parametrize("hold", [_as_held, _as_staged])
def test_finished_batches_take_tensor_batches_as_numpy_ones(art, hold):
    """``BatchFinisher`` augments a held split's batches exactly as the numpy split's."""
    def run(be):
        finisher = BatchFinisher(torch.device("cpu"), TorchAugment(SPEC, 5), seed=5, batch_size=50, timings=Timings())
        return list(finisher.batches(be, order, 1, 0, False))
    be = _with_damage(art)
    order = np.random.default_rng(1).permutation(len(be.labels))
    ref = run(be)
    hold(be, be.held.images)
    for got, want in zip(run(be), ref, strict=True):
        for a, b in zip(got, want):
            assert torch.equal(a, b)


# ---- on CUDA ------------------------------------------------------------------------------

def _loader(art, device, **kw) -> Loader:
    return Loader(art, split="train", batch_size=32, backend="memory", workers=2, seed=2,
                  sampler=SamplerConfig(kind="shuffle", seed=3), device=device, **kw)


def _epochs(ld: Loader, epochs=(0, 1)) -> list:
    out = []
    for e in epochs:
        ld.set_epoch(e)
        out += [(e, b) for b in ld]
    return out


def _same(got, ref, atol=0.0):
    assert len(got) == len(ref)
    for (e, (x, y, i)), (re_, (rx, ry, ri)) in zip(got, ref):
        assert e == re_ and x.device.type == y.device.type == i.device.type == "cuda"
        assert torch.equal(i.cpu(), ri) and torch.equal(y.cpu(), ry)
        torch.testing.assert_close(x.cpu(), rx, atol=atol, rtol=atol)


@gpu
def test_small_split_stays_on_the_gpu_with_the_cpu_loaders_batches_and_resume(art):
    ld = _loader(art, "cuda:0")
    be = ld.backend()
    assert be.held.resident and be.held.images.device == torch.device("cuda", 0) and be.held.images.dtype == torch.uint8
    assert "held on cuda:0" in ld.backend_reason and "within" in ld.backend_reason
    ref = _epochs(_loader(art, "cpu"))
    _same(_epochs(ld), ref, atol=1e-6)
    # a state taken mid-way through epoch 1 resumes to the very same batches
    ld = _loader(art, "cuda:0")
    ld.set_epoch(1)
    it, first = iter(ld), []
    for _ in range(4):
        first.append((1, next(it)))
    state = ld.state_dict()
    again = _loader(art, "cuda:0")
    again.load_state_dict(state)
    rest = [(1, b) for b in again]
    epoch1 = [r for r in ref if r[0] == 1]
    _same(first + rest, epoch1, atol=1e-6)


@gpu
def test_gpu_batches_skip_damaged_samples_as_the_cpu_loader(art):
    def run(device):
        ld = _loader(art, device, on_corrupt="skip", max_corrupt_fraction=0.5)
        ld.backend().damaged[DAMAGED] = True
        return _epochs(ld), ld.profile()["corrupt_skipped"]
    (got, skipped), (ref, ref_skipped) = run("cuda:0"), run("cpu")
    _same(got, ref, atol=1e-6)
    assert skipped == ref_skipped > 0


@gpu
def test_augmented_gpu_batches_equal_the_cpu_torch_path(art):
    """Crop, flip and normalise on the GPU from the held split: the CPU torch path's pixels for
    the same (seed, epoch, batch) draws, within 1e-5."""
    images = MemoryBackend(art, "train", 1).held.images
    ld = _loader(art, "cuda:0", augment=SPEC)
    assert ld.backend().held.resident
    cpu_order = _epochs(_loader(art, "cpu"))
    got = _epochs(ld)
    assert [i.tolist() for _, (_, _, i) in got] == [i.tolist() for _, (_, _, i) in cpu_order]
    ta = TorchAugment(SPEC)  # the CPU reference: the torch path, not the OpenCV prefix
    b = 0
    for k, (e, (x, _, i)) in enumerate(got):
        b = 0 if k == 0 or got[k - 1][0] != e else b + 1
        ta.reseed(batch_seed(2, e, b))
        ref = ta(torch.from_numpy(images[i.cpu().numpy()]))
        torch.testing.assert_close(x.cpu(), ref, atol=1e-5, rtol=1e-5)


@gpu
def test_over_the_device_budget_the_split_is_pinned_in_host_ram(art):
    ld = _loader(art, "cuda:0", device_memory_budget_bytes=1)
    be = ld.backend()
    h = be.held
    assert h.staged and not h.resident and h.images.device.type == "cpu" and h.images.is_pinned()
    assert "pinned host RAM" in ld.backend_reason and "more than" in ld.backend_reason
    x, _, _ = next(be.epoch(np.arange(64), 32, False))
    assert x.dtype == torch.uint8 and x.is_pinned()  # uint8 gathered straight into pinned memory
    _same(_epochs(ld), _epochs(_loader(art, "cpu")), atol=1e-6)


@gpu
def test_bare_cuda_is_the_ranks_own_device(art):
    n = torch.cuda.device_count()
    target = n - 1  # another GPU than cuda:0 where there is one
    with torch.cuda.device(target):
        ld = _loader(art, "cuda")
        be = ld.backend()
        assert be.device == torch.device("cuda", target) and be.held.images.device.index == target
        x, y, i = next(iter(ld))
    assert x.device.index == y.device.index == i.device.index == target


def test_on_cpu_the_split_stays_a_numpy_array(art):
    ld = _loader(art, "cpu")
    reason = ld.backend_reason
    be = ld.backend()
    assert isinstance(be.held.images, np.ndarray) and not (be.held.resident or be.held.staged)
    assert be.placement == "" and ld.backend_reason == reason
