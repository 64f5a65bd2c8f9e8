"""The loader: exact order per rank, resume, curriculum, augmentation statistics, bad input."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT
from sluice.stages.load.augment import AugmentSpec, Flip, Normalize, RandomResizedCrop, TorchAugment
from sluice.stages.load import Loader, LoaderConfig, split_arrays
from sluice.stages.load.samplers import (CurriculumSampler, ResolutionSchedule, SamplerConfig, WeightedSampler,
                             pacing_fraction, partition)
from sluice.storage.artifact import open_artifact
from sluice.storage.manifest import ArtifactError

BACKENDS = ["memory", "ffcv", "webdataset", "dali"]


@pytest.fixture(scope="module")
def art(fmnist_artifact):
    return open_artifact(fmnist_artifact.root)


def _collect(loader):
    xs, ys, idx = [], [], []
    for x, y, i in loader:
        xs.append(x)
        ys.append(y)
        idx.append(i)
    return torch.cat(xs), torch.cat(ys), torch.cat(idx)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.slow
def test_each_rank_gets_its_slice_in_sampler_order(art, backend):
    labels = art.labels("train")
    per_rank = []
    for rank in range(2):
        L = Loader(art, split="train", batch_size=64, backend=backend, rank=rank, world_size=2, workers=1,
                   sampler=SamplerConfig(kind="shuffle", seed=3))
        L.set_epoch(1)
        x, y, idx = _collect(L)
        expected = L.epoch_indices(1)
        assert idx.tolist() == expected.tolist()          # the sampler's order, exactly
        assert (y.numpy() == labels[idx.numpy()]).all()   # labels travel with their samples
        assert x.shape == (len(expected), 1, 28, 28) and x.dtype == torch.float32
        assert len(L) == -(-len(expected) // 64)
        per_rank.append(idx.numpy())
    assert len(per_rank[0]) == len(per_rank[1])
    assert set(per_rank[0]).isdisjoint(per_rank[1])                  # an even split, no padding
    assert sorted(np.concatenate(per_rank)) == list(range(art.manifest.splits["train"].count))


def test_backends_agree_on_pixels(art):
    """Without augmentation every backend yields the stored pixels / 255."""
    outs = {}
    for backend in BACKENDS:
        L = Loader(art, split="val", batch_size=50, backend=backend, workers=1,
                   sampler=SamplerConfig(kind="sequential"))
        outs[backend] = _collect(L)
    from sluice.stages.load.sample_index import SampleIndex
    si = SampleIndex(art, "val")
    ref = torch.from_numpy(np.stack([si.pixels(i) for i in range(si.count)])).permute(0, 3, 1, 2).float() / 255
    for backend, (x, y, idx) in outs.items():
        assert torch.equal(x, ref), backend
        assert idx.tolist() == list(range(si.count))


def test_split_arrays_is_the_whole_split_index_aligned(art, fmnist_artifact):
    """What the irreducible-loss scorer trains on: every sample of a split, uint8 NHWC, labels
    aligned; from an artifact object or its path alike."""
    from sluice.stages.load.sample_index import SampleIndex
    si = SampleIndex(art, "val")
    for source in (art, fmnist_artifact.root):
        x, y = split_arrays(source, "val")
        assert x.dtype == np.uint8 and x.shape == (si.count, 28, 28, 1)
        assert (y == art.labels("val")).all()
        assert np.array_equal(x[7], si.pixels(7))


def test_partition_pad_and_drop_are_explicit():
    order = np.arange(10)
    pad = [partition(order, r, 3, "pad") for r in range(3)]
    assert [len(p) for p in pad] == [4, 4, 4]
    assert sorted(np.concatenate(pad).tolist()) == sorted(list(range(10)) + [0, 1])  # first two repeated
    drop = [partition(order, r, 3, "drop") for r in range(3)]
    assert [len(p) for p in drop] == [3, 3, 3] and 9 not in np.concatenate(drop)
    with pytest.raises(ValueError, match="rank 3 is outside"):
        partition(order, 3, 3)


@pytest.mark.parametrize("backend", ["memory", "webdataset", "dali"])
@pytest.mark.slow
def test_resume_mid_epoch_yields_the_same_remaining_batches(art, backend):
    cfg = LoaderConfig(split="train", batch_size=32, backend=backend, workers=1, augment=AugmentSpec.standard(),
                       sampler=SamplerConfig(kind="shuffle", seed=5))
    full = Loader(art, cfg)
    assert full.augment.fast is not None  # on CPU the OpenCV crop path runs, and resumes exactly too
    full.set_epoch(2)
    ref = list(full)
    part = Loader(art, cfg)
    part.set_epoch(2)
    it = iter(part)
    for _ in range(5):
        next(it)
    state = part.state_dict()
    it.close()
    resumed = Loader(art, cfg)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == len(ref) - 5
    for a, b in zip(rest, ref[5:]):
        assert torch.equal(a.indices, b.indices) and torch.equal(a.input, b.input)


def test_resume_refuses_state_of_another_dataset(art):
    """Mid-epoch, a state of another version is refused (an epoch finishes over the data it began
    with); at an epoch's boundary the loader's own version takes over."""
    L = Loader(art, split="train", batch_size=32, backend="memory")
    it = iter(L)
    next(it)
    state = L.state_dict()
    it.close()
    state["fingerprints"] = {name: "0" * 64 for name in state["fingerprints"]}
    with pytest.raises(ValueError, match="another dataset version"):
        Loader(art, split="train", batch_size=32, backend="memory").load_state_dict(state)
    fresh = {**Loader(art, split="train", batch_size=32, backend="memory").state_dict(),
             "fingerprints": state["fingerprints"]}
    Loader(art, split="train", batch_size=32, backend="memory").load_state_dict(fresh)


def test_curriculum_exposes_only_the_easiest_fraction_early():
    n, bs = 1000, 50
    difficulty = np.random.default_rng(0).random(n)
    s = CurriculumSampler(difficulty, batch_size=bs, ramp_steps=40, pacing="linear", start_fraction=0.2)
    order = s.epoch_order(0)
    easiest = set(np.argsort(difficulty)[:200].tolist())
    assert set(order[:bs].tolist()) <= easiest                 # step 0: the easiest 20% only
    rank_of = np.argsort(np.argsort(difficulty))
    for b in range(20):
        allowed = int(round(s.fraction(b) * n))
        assert rank_of[order[b * bs:(b + 1) * bs]].max() < max(allowed, bs)
    anti = CurriculumSampler(difficulty, batch_size=bs, ramp_steps=40, start_fraction=0.2, anti=True)
    assert set(anti.epoch_order(0)[:bs].tolist()) <= set(np.argsort(difficulty)[-200:].tolist())
    assert len(s.epoch_order(3)) == n  # constant epoch length, whatever the pacing


def test_pacing_functions():
    for kind in ("linear", "root", "geometric"):
        fr = [pacing_fraction(kind, t, 100, 0.1) for t in range(0, 120, 5)]
        assert fr[0] == pytest.approx(0.1) and fr[-1] == 1.0
        assert all(a <= b + 1e-12 for a, b in zip(fr, fr[1:]))
    assert pacing_fraction("root", 25, 100, 0.1) > pacing_fraction("linear", 25, 100, 0.1)


def test_weighted_sampler():
    w = np.array([1.0, 2.0, 7.0, 0.0])
    s = WeightedSampler(w, replacement=True, num_samples=20000, seed=1)
    freq = np.bincount(s.epoch_order(0), minlength=4) / 20000
    assert np.allclose(freq, w / w.sum(), atol=0.02)
    s2 = WeightedSampler(np.array([1.0, 1.0, 50.0, 1.0]), replacement=False, seed=1)
    o = s2.epoch_order(0)
    assert sorted(o.tolist()) == [0, 1, 2, 3]
    firsts = [WeightedSampler(np.array([1.0, 1.0, 50.0, 1.0]), replacement=False, seed=k).epoch_order(0)[0] for k in range(50)]
    assert np.mean(np.array(firsts) == 2) > 0.8
    with pytest.raises(ValueError, match="finite and non-negative"):
        WeightedSampler(np.array([1.0, np.nan]))


def test_weighted_loader_from_scores_array(art):
    n = art.manifest.splits["train"].count
    w = np.zeros(n)
    w[:10] = 1.0
    L = Loader(art, split="train", batch_size=64, backend="memory", scores=w,
               sampler=SamplerConfig(kind="weighted", num_samples=128))
    _, _, idx = _collect(L)
    assert len(idx) == 128 and set(idx.tolist()) <= set(range(10))
    with pytest.raises(ValueError, match=f"the split has {n} samples"):
        Loader(art, split="train", backend="memory", scores=np.ones(7), sampler=SamplerConfig(kind="weighted"))


def test_progressive_resizing(art):
    sched = ResolutionSchedule(start=16, end=28, start_epoch=0, end_epoch=3, multiple=4)
    assert [sched.at(e) for e in range(5)] == [16, 20, 24, 28, 28]
    L = Loader(art, split="val", batch_size=100, backend="memory", resolution=sched,
               augment=AugmentSpec.standard())
    for epoch, side in [(0, 16), (1, 20), (4, 28)]:
        L.set_epoch(epoch)
        assert next(iter(L)).input.shape[-2:] == (side, side)
    with pytest.raises(ValueError, match="above the stored 28×28"):
        Loader(art, split="val", backend="memory", resolution=ResolutionSchedule(start=16, end=32))


def test_bad_input_fails_before_the_first_batch(art, tmp_path):
    with pytest.raises(ArtifactError, match="manifest.json is missing"):
        Loader(tmp_path, split="train")
    with pytest.raises(ArtifactError, match="split 'nope' is not in"):
        Loader(art, split="nope")
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(art.root, copy)
    tar = copy / art.manifest.splits["train"].shards[1].tar.path
    data = bytearray(tar.read_bytes())
    data[5000] ^= 1
    tar.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        Loader(copy, split="train", verify="full")


def test_empty_split_is_refused(tmp_path):
    from sluice.stages.data.config import IngestConfig
    from sluice.stages.data.shard import ShardConfig, shard_dataset
    np.savez(tmp_path / "d.npz", images=np.zeros((20, 4, 4), np.uint8), labels=np.arange(20) % 2)
    s = shard_dataset(IngestConfig(source=str(tmp_path / "d.npz"), holdout_fraction=0.0),
                      tmp_path / "o", ShardConfig(formats=["webdataset", "dali"], progress=False, workers=1))
    with pytest.raises(ArtifactError, match="split 'holdout' .* is empty"):
        Loader(s.root, split="holdout")
    # the irreducible-loss scorer's whole-split read says so too (it raised an IndexError)
    with pytest.raises(ArtifactError, match="split 'holdout' .* is empty .*holdout_fraction > 0"):
        split_arrays(s.root, "holdout")


@pytest.mark.slow
def test_backends_import_lazily_and_name_their_package():
    code = ("import sys, sluice.stages.load.loader, sluice.stages.load.backends; "
            "print(any(m.split('.')[0] in ('ffcv', 'nvidia') for m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "False", r.stderr


@pytest.mark.slow
def test_missing_backend_names_pip_package(art):
    code = ("import sys; sys.modules['ffcv'] = None\n"
            "from sluice.stages.load import Loader\n"
            "from sluice.errors import MissingDependency\n"
            f"L = Loader({str(art.root)!r}, split='val', backend='ffcv', verify='none')\n"
            "try:\n    next(iter(L))\nexcept MissingDependency as e:\n    print('MISSING', e)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "MISSING" in r.stdout and "pip install 'sluice[ffcv]'" in r.stdout, r.stdout + r.stderr


def test_streaming_mode_covers_the_split_once(art):
    L = Loader(art, split="train", batch_size=64, backend="webdataset", workers=0,
               backend_params={"webdataset": {"streaming": True}})
    _, _, idx = _collect(L)
    assert sorted(idx.tolist()) == list(range(art.manifest.splits["train"].count))
    assert idx.tolist() != sorted(idx.tolist())  # shuffled, but not in any sampler's order


# ------------------------------------------------------------------ augmentation statistics

def _ramp_images(n=2000, h=28, w=28):
    """Pixel value = column index * 9: a crop's columns and any flip can be read off its values."""
    cols = (np.arange(w) * 9).astype(np.uint8)
    return torch.from_numpy(np.broadcast_to(cols, (n, h, w))[..., None].copy())


def test_flip_rate_and_crop_scale():
    x = _ramp_images()
    out = TorchAugment(AugmentSpec(ops=[Flip(p=0.3)]), seed=0)(x)
    flipped = (out[:, 0, 0, 0] > out[:, 0, 0, -1]).float().mean().item()
    assert abs(flipped - 0.3) < 0.04
    spec = AugmentSpec(ops=[RandomResizedCrop(size=28, scale=(0.25, 0.5), ratio=(1.0, 1.0))])
    out = TorchAugment(spec, seed=1)(x) * 255 / 9   # back to source column coordinates
    width = (out[:, 0, 0, -1] - out[:, 0, 0, 0] + 1).numpy()  # columns spanned by the crop
    frac_w = width / 28
    area = frac_w ** 2  # square crops (ratio 1)
    assert area.min() > 0.25 * 0.8 and area.max() < 0.5 * 1.2
    assert 0.3 < np.median(area) < 0.45


def test_augment_output_contract():
    x = torch.randint(0, 256, (64, 32, 32, 3), dtype=torch.uint8)
    spec = AugmentSpec(ops=[RandomResizedCrop(size=24), Flip(), Normalize(mean=[0.5, 0.4, 0.3], std=[0.2, 0.2, 0.2])],
                       channels_last=True)
    y = TorchAugment(spec)(x)
    assert y.shape == (64, 3, 24, 24) and y.dtype == torch.float32
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert y.min() >= (0 - 0.5) / 0.2 - 1e-4 and y.max() <= (1 - 0.3) / 0.2 + 1e-4
    plain = TorchAugment(None)(x)
    assert plain.min() >= 0 and plain.max() <= 1 and plain.shape == (64, 3, 32, 32)
    with pytest.raises(ValueError, match="2 values for 3 channels"):
        TorchAugment(AugmentSpec(ops=[Normalize(mean=[0.1, 0.2])]))(x)


def test_a_batch_spanning_more_shards_than_stay_open_reads_every_sample_right(tmp_path):
    """read_batch over more shards than MAX_OPEN file descriptors: each read from its own file
    (an evicted, closed descriptor must never be read from), the same bytes as one by one."""
    from conftest import FMNIST_INGEST
    from sluice.stages.data.config import IngestConfig
    from sluice.stages.data.shard import ShardConfig, shard_dataset
    from sluice.stages.load.sample_index import MAX_OPEN, SampleIndex
    s = shard_dataset(IngestConfig(**FMNIST_INGEST), tmp_path,
                      ShardConfig(shard_samples=16, formats=["webdataset", "dali"], workers=1, progress=False))
    art = open_artifact(s.root)
    si = SampleIndex(art, "train", sums=art.sums("train")["tar"])
    assert len(si.tars) > MAX_OPEN
    order = np.random.default_rng(0).permutation(si.count)
    datas, damage = si.read_batch(order)
    assert not damage
    one_by_one = SampleIndex(art, "train")
    assert all(d == one_by_one.read(int(i)) for d, i in zip(datas, order))
    assert all(np.array_equal(si.decode(d), one_by_one.pixels(int(i))) for d, i in zip(datas[:50], order[:50]))
