"""Every CUDA branch, one test each (marked ``gpu``; conftest skips them without CUDA):

1. device augmentation applies the CPU path's drawn parameters (equal up to float rounding), op by op;
2. the loader's pinned, non-blocking side-stream transfer overlaps compute, keeps exact order and resumes;
3. fp16 with a GradScaler (skipped steps counted) and bf16 autocast train to a sane accuracy;
4. DDP on NCCL at world size 1 with every compression hook, PowerSGD included, resumed from a checkpoint;
5. ``amp: auto`` resolves as documented on CUDA;
6. a GPU checkpoint is evaluated and promoted on CPU, then loaded back onto the GPU;
7. DALI's GPU operators, where DALI imports.

Where a test's harness also runs on CPU it has a CPU twin (not marked), so the comparison itself is
checked on every machine. ``make gpu-check`` runs these on a GPU machine (scripts/gpu_check.py).
"""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
import torch.distributed as dist

from conftest import FMNIST
from sluice.stages.load.augment import (AUGMENT_OPS, AugmentSpec, BrightnessContrast, CenterCrop, Cutout,
                                        Flip, Normalize, RandomResizedCrop, TorchAugment, Translate)

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
ON = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=gpu)]
OPS = {"random_resized_crop": [RandomResizedCrop(size=24, scale=(0.3, 1.0))], "flip": [Flip()],
       "center_crop": [CenterCrop(size=24, crop_fraction=0.875, antialias=True)],
       "center_crop_bilinear": [CenterCrop(size=24)],
       "translate": [Translate(pad=3)], "cutout": [Cutout(size=9, p=0.8)],
       "brightness_contrast": [BrightnessContrast(brightness=0.3, contrast=0.3)],
       "normalize": [Normalize(mean=[0.4, 0.5, 0.6], std=[0.2, 0.25, 0.3])],
       "all": [RandomResizedCrop(scale=(0.3, 1.0)), Flip(), Translate(pad=2), Cutout(size=6),
               BrightnessContrast(), Normalize(mean=[0.5], std=[0.25])]}


def rgb_classes(n: int, size: int = 32, classes: int = 4, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """uint8 NHWC images a small CNN learns: noise plus a bright band whose row says the class."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    x = rng.integers(0, 96, (n, size, size, 3), dtype=np.uint8)
    band = size // classes
    for k in range(classes):
        x[y == k, k * band:(k + 1) * band, :, k % 3] = 230
    return x, y.astype(np.int64)


@pytest.fixture(scope="module")
def rgb_artifact(tmp_path_factory):
    """A 600-sample RGB artifact (npy, every format, small shards), made before any test runs
    DALI (sharding forks; forking beside DALI's threads can deadlock)."""
    return make_rgb_artifact(tmp_path_factory.mktemp("rgb"), test=200)


def make_rgb_artifact(d, n: int = 600, test: int = 200):
    """``n`` RGB training samples and ``test`` test ones of ``rgb_classes``, sharded under ``d``
    (val 20%, 64 per shard)."""
    from sluice.stages.data.config import IngestConfig
    from sluice.stages.data.shard import ShardConfig, shard_dataset
    from sluice.storage.artifact import open_artifact
    x, y = rgb_classes(n)
    tx, ty = rgb_classes(test, seed=1)
    np.savez(d / "src.npz", images=x, labels=y, test_images=tx, test_labels=ty)
    s = shard_dataset(IngestConfig(source=str(d / "src.npz"), holdout_fraction=0, val_fraction=0.2, seed=1),
                      d / "out", ShardConfig(shard_samples=64, workers=1, progress=False))
    return open_artifact(s.root)


# ---- 1. device augmentation = the CPU path's draws, op by op -----------------------------------

def test_every_registered_op_is_compared():
    # Sluice's own ops; a test plugin registered by another test (test_extending) is not one.
    built_in = {n for n in AUGMENT_OPS.names() if AUGMENT_OPS.get(n).__module__.startswith("sluice.")}
    assert built_in and built_in <= set(OPS), "a new augmentation op needs its case in OPS"


@pytest.mark.parametrize("device", ON)
@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("resolution", [None, 20])
def test_device_augment_applies_the_cpu_draws(device, name, resolution):
    """TorchAugment on ``device`` against the CPU reference (no OpenCV fast path): same seed, so
    the same parameters; the pixels agree up to float rounding (in 0..1 units, or normalised)."""
    x, _ = rgb_classes(24, size=36)
    spec = AugmentSpec(ops=OPS[name])
    for seed in (0, 7):
        ref = TorchAugment(spec, seed=seed)(torch.from_numpy(x), resolution)
        out = TorchAugment(spec, seed=seed)(torch.from_numpy(x).to(device), resolution)
        assert out.device.type == device and out.dtype == torch.float32 and out.shape == ref.shape
        torch.testing.assert_close(out.cpu(), ref, atol=2e-3, rtol=1e-4)


# ---- 2. the loader on CUDA: side-stream transfer, exact order, resume ------------------------

def _loader(art, device, **kw):
    from sluice.stages.load import Loader, SamplerConfig
    spec = AugmentSpec(ops=[Flip(), Translate(pad=2), Normalize(mean=[0.3], std=[0.3])])
    return Loader(art, split="train", batch_size=32, device=device, augment=spec, workers=2,
                  sampler=SamplerConfig(kind="shuffle", seed=3), **kw)


@pytest.mark.parametrize("device", ON)
@pytest.mark.parametrize("backend", ["memory", "webdataset", "ffcv"])
@pytest.mark.slow
def test_loader_device_order_and_resume(rgb_artifact, device, backend):
    """Batches on ``device`` carry exactly the CPU loader's samples in its order, with the same
    pixels up to float rounding; a state taken mid-epoch resumes to the very same batches."""
    if backend == "ffcv":
        pytest.importorskip("ffcv", reason="the ffcv backend needs the ffcv package")
    ref = list(_loader(rgb_artifact, "cpu", backend=backend))
    ld = _loader(rgb_artifact, device, backend=backend)
    got = []
    for k, b in enumerate(ld):
        got.append(b)
        if k == 3:
            state = ld.state_dict()
            break
    got += list(ld)  # the rest of the epoch
    assert len(got) == len(ref)
    for (x, y, i), (rx, ry, ri) in zip(got, ref):
        assert x.device.type == y.device.type == i.device.type == device
        assert torch.equal(i.cpu(), ri) and torch.equal(y.cpu(), ry)
        torch.testing.assert_close(x.cpu(), rx, atol=2e-3, rtol=1e-4)
    again = _loader(rgb_artifact, device, backend=backend)
    again.load_state_dict(state)
    rest = list(again)
    assert len(rest) == len(got) - 4
    for (x, y, i), (gx, gy, gi) in zip(rest, got[4:]):
        assert torch.equal(i, gi) and torch.equal(y, gy) and torch.equal(x, gx)


@gpu
def test_loader_transfer_overlaps_compute(rgb_artifact):
    """While the caller's stream is busy (a long kernel), the loader's thread keeps copying and
    augmenting on its side stream: the prefetch queue fills before the caller's kernel ends, and
    the batch handed over is complete once the caller's stream reaches it."""
    import time
    ld = _loader(rgb_artifact, "cuda", backend="memory", prefetch=3)
    be = ld.backend()
    made, original = [], be.epoch

    def counting(*a, **kw):
        for b in original(*a, **kw):
            made.append(time.perf_counter())
            yield b
    be.epoch = counting
    it = iter(ld)
    first = next(it)
    torch.cuda.synchronize()
    n_before = len(made)
    torch.cuda._sleep(int(3e9))  # ~2 s of GPU time on the caller's (default) stream
    deadline = time.perf_counter() + 30
    while len(made) < n_before + 2 and time.perf_counter() < deadline:
        time.sleep(0.01)
    busy = not torch.cuda.current_stream().query()
    assert len(made) >= n_before + 2, "the loader's thread stalled behind the caller's kernel"
    assert busy, "the caller's kernel finished first: nothing was shown to overlap"
    x, y, i = next(it)  # handed over: the caller's stream waits for the side stream's event
    assert torch.isfinite(x).all() and x.shape[0] == 32 and first.inputs["images"].shape == x.shape
    torch.cuda.synchronize()


# ---- 3. fp16 with a GradScaler and bf16 autocast train --------------------------------------

@gpu
@pytest.mark.parametrize("amp", ["fp16", "bf16"])
def test_mixed_precision_trains_to_a_sane_accuracy(tmp_path, amp):
    from sluice.stages.load import ArrayLoader
    from sluice.stages.load.arrays import fashion_mnist
    from sluice.stages.train import train
    from sluice.storage.checkpoint import load_checkpoint
    if not FMNIST.is_dir():
        pytest.skip(f"needs Fashion-MNIST at {FMNIST} (SLUICE_FASHION_MNIST; make wheelhouse carries it)")
    if amp == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    x, y = fashion_mnist("train")
    tx, ty = fashion_mnist("test")
    cfg = dict(model="bn_cnn", max_steps=300, batch_size=128, lr=0.2, lr_reference_batch=256,
               amp=amp, device="cuda", channels_last=True, progress=False, checkpoint_dir=str(tmp_path),
               normalize_mean=[0.286], normalize_std=[0.353])
    r = train(cfg, ArrayLoader(x[:20000], y[:20000], 128),
              ArrayLoader(tx[:2000], ty[:2000], 500, shuffle=False, drop_last=False, even=False))
    assert r.steps == 300 and r.summary["amp"] == amp and np.isfinite(r.metrics[-1]["loss"])
    assert r.final_acc >= 0.80, f"{amp}: {r.final_acc:.3f} after 300 steps"
    if amp == "fp16":  # every step the scaler skipped is counted: a drop of the scale
        drops = sum(b["grad_scale"] > a["grad_scale"] for b, a in zip(r.metrics, r.metrics[1:]))
        assert r.summary["skipped_steps"] == r.metrics[-1]["skipped_steps"] >= drops
        assert load_checkpoint(r.checkpoint)["scaler"]["scale"] > 0
    else:
        assert r.summary["skipped_steps"] == 0 and "grad_scale" not in r.metrics[-1]


# ---- 4. DDP at world size 1, every compression hook, a checkpoint resumed -------------------

def _ddp_run(device, mode, steps, state=None, save_at=None, ckpt=None):
    """Train a small CNN in DDP with hook ``mode`` for ``steps`` steps (from ``state``); save a
    checkpoint after ``save_at`` steps; return the final weights."""
    from sluice.stages.train.comm import build_hook
    from sluice.stages.train.config import CommConfig
    from sluice.storage.checkpoint import load_checkpoint, save_checkpoint
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(),
                                torch.nn.Linear(512, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[0] if device == "cuda" else None, bucket_cap_mb=0.02)  # several buckets
    hook = build_hook(CommConfig(mode=mode, params={"start_iter": 2, "rank": 2} if mode == "powersgd" else {}), seed=0)
    hook.register(ddp)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    first = 0
    if state is not None:
        s = load_checkpoint(state, compat={"mode": mode})
        model.load_state_dict(s["model"])
        opt.load_state_dict(s["optimizer"])
        hook.load_state_dict(s["comm"], device)
        first = s["step"]
    x, y = rgb_classes(64 * steps, size=16, seed=5)
    sent = 0
    for step in range(first, steps):
        xb = torch.from_numpy(x[step * 64:(step + 1) * 64]).permute(0, 3, 1, 2).float().div(255).to(device)
        yb = torch.from_numpy(y[step * 64:(step + 1) * 64]).to(device)
        loss = torch.nn.functional.cross_entropy(ddp(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sent += hook.take_bytes()
        assert torch.isfinite(loss)
        if save_at == step + 1:
            save_checkpoint(ckpt, {"compat": {"mode": mode}, "step": step + 1, "model": model.state_dict(),
                                   "optimizer": opt.state_dict(), "comm": hook.state_dict()})
    assert sent > 0, f"hook {mode} counted no bytes"
    if mode == "powersgd":
        st = hook.state_dict()
        assert st["iter"] == steps and st["qs"] and st["errors"]
        assert all(t.device.type == "cpu" for t in st["qs"].values())  # weights_only-safe, any device
    return [p.detach().cpu().clone() for p in model.parameters()]


@pytest.mark.parametrize("device", ON)
@pytest.mark.parametrize("mode", ["none", "fp16", "bf16", "powersgd"])
def test_ddp_world_one_every_hook_resumes(tmp_path, device, mode):
    """NCCL on CUDA (gloo on CPU), one rank: each hook trains, counts its bytes, and a run
    resumed from a mid-run checkpoint (a fresh DDP and hook) ends with the uninterrupted weights."""
    from sluice.stages.train.comm import COMM_HOOKS
    assert set(COMM_HOOKS.names()) >= {"none", "fp16", "bf16", "powersgd"}
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ckpt = tmp_path / "mid.pt"
        whole = _ddp_run(device, mode, 8, save_at=4, ckpt=ckpt)
        resumed = _ddp_run(device, mode, 8, state=ckpt)
        for a, b in zip(whole, resumed):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    finally:
        dist.destroy_process_group()


# ---- 5. amp: auto on CUDA --------------------------------------------------------------------

@gpu
def test_amp_auto_resolves_as_documented():
    """docs/training.md "Host classes": cuda → bf16, or fp16 with a GradScaler on GPUs without bf16; an
    explicit setting wins; the run reports what it resolved."""
    from sluice.stages.precision import resolve_amp
    from sluice.stages.host import HOST_DEFAULTS, host_class
    from sluice.stages.load import ArrayLoader
    from sluice.stages.train import train
    want = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    assert host_class("cuda") == "cuda" and resolve_amp("auto", "cuda") == want
    assert HOST_DEFAULTS["cuda"].amp == "bf16" and resolve_amp("none", "cuda") == "none"
    x, y = rgb_classes(256, size=28)
    for amp, resolved in (("auto", want), ("none", "none")):
        r = train(dict(model="small_cnn", model_kwargs={"width": 8}, in_channels=3, max_steps=4,
                       batch_size=32, amp=amp, device="cuda", progress=False), ArrayLoader(x, y, 32))
        assert r.summary["amp"] == resolved
        host = r.summary["host"]  # "cuda: 1 × H200, bf16, 1 rank x 1 thread, ..."
        assert host.startswith("cuda: ") and f", {'fp32' if resolved == 'none' else resolved}, " in host, host
        assert ("grad_scale" in r.metrics[-1]) == (resolved == "fp16")


# ---- 6. a GPU checkpoint: evaluated and promoted on CPU, then back on the GPU -----------------

@gpu
def test_gpu_checkpoint_evaluates_and_promotes_on_cpu_and_back(tmp_path, rgb_artifact):
    from sluice.stages.load import Loader, SamplerConfig
    from sluice.stages.train import train
    from sluice.stages.train.evaluate import evaluate_checkpoint, model_from_checkpoint, predict
    from sluice.storage.checkpoint import load_checkpoint
    from sluice.storage.registry import Candidate, Registry
    norm = AugmentSpec(ops=[Normalize(mean=[0.5], std=[0.5])])
    cfg = dict(model="small_cnn", model_kwargs={"width": 16}, in_channels=3, num_classes=4, max_steps=70,
               batch_size=32, lr=0.05, amp="auto", device="cuda", ema_decay=0.9, progress=False,
               checkpoint_dir=str(tmp_path / "run"), normalize_mean=[0.5], normalize_std=[0.5])
    r = train({**cfg, "halt_at_step": 60}, Loader(rgb_artifact, split="train", batch_size=32, device="cuda",
                                                  workers=2, augment=norm))
    assert r.halted and r.steps == 60
    state = load_checkpoint(r.checkpoint)  # map_location cpu, weights_only
    assert all(t.device.type == "cpu" for t in state["model"].values())
    on_cpu = evaluate_checkpoint(r.checkpoint, rgb_artifact.root, "val", batch_size=50, backend="memory")
    assert on_cpu["n"] == rgb_artifact.manifest.split("val").count and on_cpu["acc"] > 0.5
    reg = Registry(tmp_path / "registry")
    rec = reg.register(Candidate(r.checkpoint, dataset_fingerprint=rgb_artifact.fingerprint,
                                 eval_split=f"{rgb_artifact.fingerprint[:16]}/val", metric="val_acc",
                                 value=on_cpu["acc"], metrics={"val": on_cpu}, config=cfg))
    assert reg.promote_if_better(rec).promoted and reg.champion().model_id == rec.model_id
    model, _ = model_from_checkpoint(reg.checkpoint_path(rec))  # back onto the GPU
    model = model.cuda()
    hits = n = 0
    with torch.no_grad():
        for x, y, _ in Loader(rgb_artifact, split="val", batch_size=50, device="cuda", augment=norm,
                              sampler=SamplerConfig(kind="sequential")):
            hits += int((predict(model, x).argmax(1) == y).sum())
            n += len(y)
    assert n == on_cpu["n"] and abs(hits / n - on_cpu["acc"]) <= 2 / n  # float rounding may flip one
    resumed = train(cfg, Loader(rgb_artifact, split="train", batch_size=32, device="cuda", workers=2,
                                augment=norm))  # the GPU run goes on from the checkpoint it wrote
    assert resumed.resumed_from == 60 and resumed.steps == 70


# ---- 7. DALI's GPU operators -------------------------------------------------------------------

@gpu
def test_dali_gpu_operators_apply_the_torch_draws(rgb_artifact):
    """The dali backend on CUDA ("mixed"/GPU operators) yields batches on the GPU, in order, with
    TorchAugment's pixels for the same (seed, epoch, batch) up to float rounding."""
    pytest.importorskip("nvidia.dali", reason="DALI is not installed here (too large for the wheelhouse)")
    from sluice.stages.load.augment import batch_seed
    from sluice.stages.load.backends.dali import DaliBackend
    from sluice.stages.load.sample_index import SampleIndex
    spec = AugmentSpec(ops=[RandomResizedCrop(size=24, scale=(0.4, 1.0)), Flip(), Cutout(size=5),
                            Normalize(mean=[0.5], std=[0.25])])
    be = DaliBackend(rgb_artifact, "train", spec, torch.device("cuda"), workers=2, seed=4)
    si = SampleIndex(rgb_artifact, "train")
    order = np.random.default_rng(0).permutation(rgb_artifact.manifest.split("train").count)[:200]
    ta = TorchAugment(spec)
    try:
        for b, (x, _, i) in enumerate(be.epoch(order, 64, False, epoch=2)):
            assert x.device.type == "cuda" and np.array_equal(i.numpy(), order[b * 64:(b + 1) * 64])
            ta.reseed(batch_seed(4, 2, b))
            ref = ta(torch.from_numpy(np.stack([si.pixels(int(k)) for k in i])))
            torch.testing.assert_close(x.cpu(), ref, atol=1e-3, rtol=0)
    finally:
        be.close()
        gc.collect()


# ---- 8. a training step never waits on the host ------------------------------------------------

@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_steps_between_logs_never_synchronize(monkeypatch):
    """test_step_syncs.py's steps on CUDA (bf16, InfoBatch, EMA, clipping, accumulation), each
    step that is not logged under ``torch.cuda.set_sync_debug_mode("error")``: any host sync in
    it raises. The first step is exempt (it moves InfoBatch's table to the GPU and warms up)."""
    from sluice.stages.load.arrays import fashion_mnist
    from test_step_syncs import EVERY, N, STEPS, strict_on_cuda, sync_free_run

    strict_steps: list[int] = []
    x, y = fashion_mnist("train")
    r = sync_free_run((x[:N], y[:N]), "cuda", strict_on_cuda(strict_steps), monkeypatch, amp="bf16")
    assert strict_steps == [s for s in range(2, STEPS + 1) if s % EVERY]
    assert [m["step"] for m in r.metrics] == [EVERY, 2 * EVERY]
    assert all(np.isfinite(m["loss"]) for m in r.metrics)
