"""The train stage in-process (one rank): loader contract, budgets, resume, bad input."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from sluice.stages.load.arrays import ArrayLoader, fashion_mnist
from sluice.stages.host import HOST_DEFAULTS, cpu_class
from sluice.errors import CheckpointMismatch, ConfigError, NonFiniteLoss
from sluice.stages.contracts import SelectedBatch, SelectorHooks
from sluice.stages.load.specs import ArraysData
from sluice.stages.train import TrainConfig, TrainResult, train
from sluice.stages.train.schedule import lr_at
from sluice.storage.checkpoint import load_checkpoint

N = 512


@pytest.fixture(scope="module")
def fmnist() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    x, y = fashion_mnist("train")
    tx, ty = fashion_mnist("test")
    return x[:N], y[:N], tx[:256], ty[:256]


def cfg(**kw) -> TrainConfig:
    base = dict(model_kwargs={"width": 8}, max_steps=12, batch_size=32, lr=0.05,
                progress=False, torch_threads=1)
    base.update(kw)
    return TrainConfig(**base)


def loaders(data, bs: int = 32, seed: int = 0):
    x, y, tx, ty = data
    return (ArrayLoader(x, y, bs, seed=seed),
            ArrayLoader(tx, ty, 64, shuffle=False, drop_last=False, even=False))


# ---- loader contract ----------------------------------------------------------------------

def test_array_loader_shards_disjoint_equal_and_pads_without_dropping():
    x = np.zeros((103, 4, 4), np.uint8)
    y = np.arange(103)
    shards = [ArrayLoader(x, y, 8, seed=3, rank=r, world_size=2, drop_last=False)
              for r in range(2)]
    seen = [torch.cat([b.indices for b in s]) for s in shards]
    assert len(shards[0]) == len(shards[1]) and len(seen[0]) == len(seen[1]) == 52
    assert set(seen[0].tolist()) | set(seen[1].tolist()) == set(range(103))  # nothing dropped
    dl = [ArrayLoader(x, y, 8, seed=3, rank=r, world_size=2) for r in range(2)]
    a, b = (set(torch.cat([t.indices for t in s]).tolist()) for s in dl)
    assert not a & b and len(dl[0]) == len(dl[1]) == 6
    dl[0].set_epoch(1)
    img, lab, idx = next(iter(dl[0]))  # model-ready: normalised to [-1, 1] unless told otherwise
    assert img.shape == (8, 1, 4, 4) and img.dtype == torch.float32 and lab.dtype == torch.int64
    assert torch.equal(img, torch.full_like(img, -1.0))
    raw = next(iter(ArrayLoader(x, y, 8, seed=3, normalize=None)))
    assert raw.input.dtype == torch.uint8


def test_array_loader_resumes_at_exact_next_batch():
    x = np.random.default_rng(0).integers(0, 255, (64, 4, 4), dtype=np.uint8)
    y = np.arange(64)
    a = ArrayLoader(x, y, 8, seed=1)
    a.set_epoch(2)
    it = iter(a)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(a.state_dict()))  # JSON-safe
    rest = [b.indices for b in it]
    b = ArrayLoader(x, y, 8, seed=1)
    b.load_state_dict(state)
    assert [t.tolist() for t in (c.indices for c in b)] == [t.tolist() for t in rest]
    with pytest.raises(ValueError, match="seed"):  # another seed is another order
        ArrayLoader(x, y, 8, seed=2).load_state_dict(state)


def test_typed_data_spec_builds_a_rank_slice_and_refuses_unknown_kinds(tmp_path, fmnist):
    from sluice.stages.run.launch import make_job
    x, y, *_ = fmnist
    np.savez(tmp_path / "a.npz", images=x[:100], labels=y[:100])
    ld = ArraysData(path=str(tmp_path / "a.npz"), batch_size=10).build(rank=1, world_size=2)
    assert len(ld) == 5
    with pytest.raises(ConfigError, match="data"):  # a typo fails before anything is launched
        make_job(cfg(), {"kind": "nope", "path": "x"})


# ---- config ---------------------------------------------------------------------------------

def test_config_is_json_and_rejects_bad_input():
    c = cfg(comm={"mode": "powersgd", "params": {"rank": 2, "start_iter": 5}})
    assert TrainConfig.model_validate_json(c.model_dump_json()) == c
    with pytest.raises(ValidationError):
        TrainConfig(lr_typo=1)
    with pytest.raises(ValidationError, match="start_iter"):
        TrainConfig(comm={"mode": "powersgd", "params": {"start_iter": 1}})
    assert c.compat(2) == cfg(comm=c.comm, progress=True, halt_at_step=3).compat(2)
    assert c.compat(2) != cfg(comm=c.comm, lr=0.2).compat(2)


def test_lr_schedules_follow_the_budget():
    lin = TrainConfig(schedule="linear", warmup_fraction=0.0, lr=1.0)
    assert lr_at(lin, 0) == 1.0 and lr_at(lin, 0.5) == 0.5 and lr_at(lin, 1.0) == 0.0
    oc = TrainConfig(schedule="onecycle", warmup_fraction=0.2, lr=1.0)
    assert lr_at(oc, 0) < 0.1 and lr_at(oc, 0.2) == pytest.approx(1.0)
    assert lr_at(oc, 1.0) == pytest.approx(0.0, abs=1e-9)


# ---- training -------------------------------------------------------------------------------

@pytest.mark.slow  # ~2 s idle: 30 steps of 2 micro-batches and two evaluations
def test_train_in_process_reports_metrics_and_learns(tmp_path, fmnist):
    tr, ev = loaders(fmnist)
    c = cfg(max_steps=30, metrics_path=str(tmp_path / "m.jsonl"), checkpoint_dir=str(tmp_path / "ck"),
            ema_decay=0.9, clip_grad_norm=5.0, accum_steps=2, eval_every_steps=15)
    r = train(c, tr, ev)
    assert isinstance(r, TrainResult) and r.steps == 30 and r.final_acc is not None
    assert r.final_acc > 0.2  # above chance (0.1) after 30 tiny steps
    m = r.metrics[0]
    for k in ("loss", "samples_per_s", "data_wait_frac", "bytes_comm", "lr", "select_s"):
        assert k in m
    assert r.metrics[-1]["loss"] < r.metrics[0]["loss"]
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    assert len(lines) == 30 + 2  # steps + two evals
    assert r.metrics[-1]["lr"] < 0.01 * c.lr  # one-cycle ends near zero
    state = load_checkpoint(r.checkpoint)
    assert state["step"] == 30 and state["ema"] is not None
    json.dumps(r.to_dict())


def test_bf16_autocast_trains(fmnist):
    tr, ev = loaders(fmnist)
    r = train(cfg(amp="bf16", channels_last=True), tr, ev)
    assert np.isfinite(r.metrics[-1]["loss"]) and r.final_acc is not None


def test_auto_amp_picks_bf16_only_where_the_cpu_computes_it(fmnist):
    """The run resolves ``auto`` once, by its host class's measured setting, and records it."""
    tr, ev = loaders(fmnist)
    r = train(cfg(amp="auto", channels_last=True), tr, ev)
    assert r.summary["amp"] == HOST_DEFAULTS[cpu_class()].amp and r.final_acc is not None


def test_fp16_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(Exception, match="fp16.*CUDA"):
        train(cfg(amp="fp16"), ArrayLoader(np.zeros((64, 28, 28), np.uint8), np.zeros(64), 32))


@pytest.mark.parametrize("max_steps", [None, 10**9])
def test_time_budget_stops_and_decays_lr(fmnist, max_steps):
    """However fast the steps run (one or hundreds), the run ends by the clock, short of any step
    budget, and every step's lr is the schedule at the fraction of the time budget used."""
    tr, _ = loaders(fmnist)
    c = cfg(max_steps=max_steps, max_seconds=0.3, schedule="linear", warmup_fraction=0.0)
    r = train(c, tr)
    assert r.summary["stopped_by"] == "max_seconds"
    assert 1 <= r.steps < (max_steps or float("inf"))
    before = [0.0] + [m["elapsed_s"] for m in r.metrics[:-1]]  # the clock when each step began
    assert [m["lr"] for m in r.metrics] == [
        lr_at(c, max(i / max_steps if max_steps else 0.0, t / 0.3), max_steps)
        for i, t in enumerate(before)]


def test_resume_after_halt_equals_uninterrupted(tmp_path, fmnist):
    full = train(cfg(checkpoint_dir=str(tmp_path / "a"), ema_decay=0.8), *loaders(fmnist))
    c = cfg(checkpoint_dir=str(tmp_path / "b"), ema_decay=0.8)
    first = train(c.model_copy(update={"halt_at_step": 5}), *loaders(fmnist))
    assert first.halted and first.steps == 5 and first.final_acc is None
    second = train(c, *loaders(fmnist))  # fresh loader objects, state comes from the checkpoint
    assert second.resumed_from == 5 and second.steps == 12
    a, b = load_checkpoint(full.checkpoint), load_checkpoint(second.checkpoint)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert full.summary["param_digests"] == second.summary["param_digests"]
    assert second.final_acc == full.final_acc


def test_checkpoints_in_object_storage_resume_as_local_ones(tmp_path, fmnist):
    """``checkpoint_dir`` as an fsspec URL (what nodes sharing no file system write to,
    ``launch.ray.storage``): the checkpoint is one object there, and halting and resuming from
    it trains the same bits as the uninterrupted run on a local path."""
    import fsspec
    full = train(cfg(checkpoint_dir=str(tmp_path / "a")), *loaders(fmnist))
    url = f"memory://sluice-test-{tmp_path.name}/run/checkpoints"
    c = cfg(checkpoint_dir=url)
    first = train(c.model_copy(update={"halt_at_step": 5}), *loaders(fmnist))
    assert first.halted and first.checkpoint == f"{url}/last.pt"
    assert load_checkpoint(first.checkpoint)["step"] == 5 and not (tmp_path / "run").exists()
    second = train(c, *loaders(fmnist))
    assert second.resumed_from == 5 and second.steps == 12
    assert full.summary["param_digests"] == second.summary["param_digests"]
    assert fsspec.filesystem("memory").ls(url.removeprefix("memory://"), detail=False) == \
        [f"/sluice-test-{tmp_path.name}/run/checkpoints/last.pt"]  # no temp objects left beside it


@pytest.mark.parametrize("method", ["infobatch", "importance"])
def test_resume_keeps_the_selectors_loss_table(tmp_path, fmnist, method):
    """Halting mid-run and resuming trains exactly as the uninterrupted run: the selector's
    state (InfoBatch's losses, importance estimates, RNG) travels in the checkpoint."""
    from sluice.stages.select import SelectionConfig, build_selector

    def sel():
        extra = {"n_select": 16, "params": {"importance_draw": "candidates"}} if method == "importance" else {}
        return build_selector(SelectionConfig(method=method, **extra), candidate_size=32,
                              split_size=len(fmnist[1]))
    c = dict(max_steps=30, eval_every_steps=None)
    full = train(cfg(checkpoint_dir=str(tmp_path / "a"), **c), *loaders(fmnist), selector=sel())
    halted = cfg(checkpoint_dir=str(tmp_path / "b"), halt_at_step=20, **c)
    train(halted, *loaders(fmnist), selector=sel())
    again = train(halted.model_copy(update={"halt_at_step": None}), *loaders(fmnist), selector=sel())
    assert again.resumed_from == 20
    assert [m["select/n_selected"] for m in again.metrics] == \
        [m["select/n_selected"] for m in full.metrics[20:]]
    assert full.summary["param_digests"] == again.summary["param_digests"]


def test_incompatible_checkpoint_is_refused(tmp_path, fmnist):
    train(cfg(max_steps=2, checkpoint_dir=str(tmp_path)), *loaders(fmnist))
    with pytest.raises(CheckpointMismatch, match="incompatible.*config_hash"):
        train(cfg(max_steps=2, checkpoint_dir=str(tmp_path), model_kwargs={"width": 16}),
              *loaders(fmnist))


class FixedCountSelector(SelectorHooks):
    """Keeps the k highest-loss samples; poisons the weights after ``nan_after`` calls."""

    def __init__(self, k: int, nan_after: int | None = None):
        self.k, self.calls, self.nan_after = k, 0, nan_after

    def __call__(self, model, images, labels, indices) -> SelectedBatch:
        self.calls += 1
        with torch.no_grad():
            was = model.training
            model.eval()
            loss = torch.nn.functional.cross_entropy(model(images), labels, reduction="none")
            model.train(was)
        top = loss.topk(self.k).indices
        w = torch.ones(self.k)
        if self.nan_after is not None and self.calls > self.nan_after:
            w[0] = float("nan")
        return SelectedBatch(images[top], labels[top], indices[top], w,
                             {"kept_frac": self.k / len(labels), "mean_loss": loss.mean().item()})


def test_selector_trains_on_selected_batch_and_reports(fmnist):
    tr, ev = loaders(fmnist)
    r = train(cfg(max_steps=6), tr, ev, selector=FixedCountSelector(8))
    m = r.metrics[-1]
    assert m["select/kept_frac"] == 0.25 and m["select_s"] > 0
    assert m["samples_per_s"] > 0


def test_importance_sampling_in_the_training_stage_redraws_from_uniform_candidates(fmnist):
    """The pipeline's importance mode (what training_job asks for): the loader's shuffled batch
    of 32 are candidates; 16 are redrawn by loss-proportional p with weights 1/(n_B q)."""
    from sluice.stages.select import SelectionConfig, build_selector
    tr, ev = loaders(fmnist)
    sel = build_selector(SelectionConfig(method="importance", n_select=16, params={"smoothing": 0.5, "importance_draw": "candidates"}),
                         candidate_size=32, split_size=len(fmnist[1]))
    r = train(cfg(max_steps=8), tr, ev, selector=sel)
    assert all(m["select/n_candidates"] == 32 and m["select/n_selected"] == 16 for m in r.metrics)
    assert sel.sampler.seen.sum() > 16                  # losses observed across steps
    assert all(m["select/weight_mean"] > 0 for m in r.metrics)


def test_infobatch_in_the_training_stage_prunes_then_anneals(fmnist):
    """Pruning starts once the first epoch's losses are known (16 steps of 32 on 512 samples),
    every pruned step trains fewer samples, and the last quarter (anneal) trains every one."""
    from sluice.stages.select import SelectionConfig, build_selector
    tr, ev = loaders(fmnist)
    sel = build_selector(SelectionConfig(method="infobatch", params={"prune": 0.5, "anneal": 0.75}),
                         candidate_size=32, split_size=len(fmnist[1]))
    r = train(cfg(max_steps=40), tr, ev, selector=sel)
    sizes = [m["select/n_selected"] for m in r.metrics]
    assert sizes[:16] == [32] * 16 and all(s < 32 for s in sizes[17:30])
    assert sizes[30:] == [32] * 10
    assert 0.7 < r.summary["selection_trained_fraction"] < 0.95
    assert sel.seen.all()


def test_nan_loss_stops_with_clear_error_and_keeps_last_good_checkpoint(tmp_path, fmnist):
    tr, _ = loaders(fmnist)
    c = cfg(max_steps=20, checkpoint_dir=str(tmp_path), checkpoint_every_steps=3)
    with pytest.raises(NonFiniteLoss, match="step 8.*last good checkpoint"):
        train(c, tr, selector=FixedCountSelector(16, nan_after=7))
    state = load_checkpoint(tmp_path / "last.pt")
    assert state["step"] == 6
    assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())


def test_bad_loader_is_refused():
    with pytest.raises(Exception, match="loader must be"):
        train(cfg(), [(torch.zeros(1), torch.zeros(1), torch.zeros(1))])


def test_checkpoint_every_seconds(tmp_path, fmnist):
    """The loss diverges at step 5, before the run would write its final checkpoint: only the
    every-seconds saves can have left one, after step 4 when the interval is tiny, none when it
    is an hour."""
    c = cfg(max_steps=20, checkpoint_dir=str(tmp_path / "often"), checkpoint_every_seconds=1e-6)
    with pytest.raises(NonFiniteLoss, match="step 5.*last good checkpoint"):
        train(c, loaders(fmnist)[0], selector=FixedCountSelector(16, nan_after=4))
    assert load_checkpoint(tmp_path / "often" / "last.pt")["step"] == 4
    c = c.model_copy(update={"checkpoint_dir": str(tmp_path / "hourly"), "checkpoint_every_seconds": 3600.0})
    with pytest.raises(NonFiniteLoss, match="step 5.*no checkpoint was written"):
        train(c, loaders(fmnist)[0], selector=FixedCountSelector(16, nan_after=4))
    assert not (tmp_path / "hourly" / "last.pt").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("amp", ["fp16", "bf16"])
def test_cuda_mixed_precision_trains(tmp_path, fmnist, amp):
    tr, ev = loaders(fmnist)
    r = train(cfg(amp=amp, device="cuda", channels_last=True, checkpoint_dir=str(tmp_path)), tr, ev)
    assert np.isfinite(r.metrics[-1]["loss"]) and r.final_acc is not None
    if amp == "fp16":
        assert "grad_scale" in r.metrics[-1]
        assert load_checkpoint(r.checkpoint)["scaler"]  # GradScaler state is checkpointed


@pytest.mark.parametrize("model", ["resnet_small", "small_cnn"])
def test_resnet_and_small_cnn_on_32px_rgb(model):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 255, (64, 32, 32, 3), dtype=np.uint8)
    y = rng.integers(0, 10, 64)
    c = cfg(model=model, model_kwargs={"width": 4}, in_channels=3, max_steps=2,
            normalize_mean=[0.5, 0.5, 0.5], normalize_std=[0.25, 0.25, 0.25])
    r = train(c, ArrayLoader(x, y, 16))
    assert r.steps == 2 and np.isfinite(r.metrics[-1]["loss"])
    with pytest.raises(Exception, match="channels"):
        train(cfg(max_steps=1), ArrayLoader(x, y, 16))  # RGB data into a 1-channel config


# ---- recipe parts: momentum cycling, lr scaling, flip TTA, the BN CNN -----------------------

def test_momentum_cycles_against_the_one_cycle_lr():
    from sluice.stages.train.schedule import momentum_at
    c = TrainConfig(schedule="onecycle", warmup_fraction=0.25, lr=1.0, momentum_cycle=(0.85, 0.95))
    assert momentum_at(c, 0.25) == pytest.approx(0.85)            # lr at its peak, momentum lowest
    assert momentum_at(c, 1.0) == pytest.approx(0.95, abs=1e-6)    # lr near zero, momentum highest
    assert momentum_at(c, 0.0) > momentum_at(c, 0.1) > momentum_at(c, 0.25)
    assert momentum_at(TrainConfig(momentum=0.9), 0.5) == 0.9      # no cycle: the fixed momentum
    with pytest.raises(ValidationError):
        TrainConfig(momentum_cycle=(0.95, 0.85))


def test_lr_scales_with_the_global_batch_and_momentum_reaches_the_optimizer(fmnist):
    tr, _ = loaders(fmnist)
    r = train(cfg(max_steps=4, schedule="constant", lr=0.05, lr_reference_batch=64,
                  momentum_cycle=(0.8, 0.9)), tr)
    assert all(m["lr"] == pytest.approx(0.025) for m in r.metrics)  # 32 of 64: half the lr


def test_flip_tta_evaluates_the_mean_of_both_views(fmnist):
    from sluice.stages.train.evaluate import predict
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(28 * 28, 10))
    x = torch.randn(4, 1, 28, 28)
    both = (model(x) + model(x.flip(-1))) / 2
    assert torch.allclose(predict(model, x, "flip"), both) and torch.allclose(predict(model, x), model(x))
    tr, ev = loaders(fmnist)
    r = train(cfg(model="bn_cnn", model_kwargs={"width": 4}, eval_tta="flip", ema_decay=0.9), tr, ev)
    assert r.final_acc is not None and r.evals[-1]["wall_time"] > 0
