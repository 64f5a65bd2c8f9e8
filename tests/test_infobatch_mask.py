"""InfoBatch's mask mode: the pruned candidates stay in the batch with weight 0, so a pruning step
keeps its size and never reads the device. Its loss equals drop mode's for the same dropped set,
its draws are seeded and resume, and training steps that prune read nothing back (the GPU twin
runs them under ``torch.cuda.set_sync_debug_mode("error")``)."""
from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
import torch

from sluice.stages.load.arrays import fashion_mnist
from sluice.stages.select import SelectionConfig, build_selector
from test_step_syncs import count_reads, strict_on_cuda, sync_free_run

N, STEPS, EVERY = 512, 10, 5
CAND = 40


def infobatch(n: int = 100, seed: int = 0, **params: Any):
    cfg = SelectionConfig(method="infobatch", seed=seed, params={"prune": 0.5, "sync_every": 1, **params})
    return build_selector(cfg, candidate_size=CAND, split_size=n)


def known_table(sel) -> torch.Tensor:
    """Losses 4.0 at every fourth index, 0.5 elsewhere: mean 1.375, 75% below it."""
    losses = torch.where(torch.arange(sel.n) % 4 == 0, 4.0, 0.5)
    sel.observe(torch.arange(sel.n), losses)
    return losses


def batch(n: int = CAND) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(n, 3), torch.zeros(n, dtype=torch.long)


@pytest.mark.parametrize("cand", [torch.arange(20, 60),                                   # 30 eligible
                                  torch.cat([torch.arange(0, 152, 4), torch.tensor([1, 2])])],  # 2
                         ids=["many-eligible", "two-eligible"])
def test_mask_mode_weights_equal_drop_modes_loss_on_the_same_dropped_set(cand):
    sel = infobatch(n=160, mode="mask")
    losses = known_table(sel)
    b = sel(None, *batch(), cand)
    eligible = losses[cand] < 1.375
    n_elig = int(eligible.sum())
    target = round(0.5 * 0.75 * CAND)
    n_drop = min(target, n_elig - 1)
    assert b.inputs.shape[0] == CAND and torch.equal(b.indices, cand)   # the batch keeps its size
    w = b.weights
    dropped = w == 0
    assert int(dropped.sum()) == n_drop and eligible[dropped].all()
    kept_elig = eligible & ~dropped
    assert torch.allclose(w[kept_elig], torch.tensor(n_elig / (n_elig - n_drop)))
    assert (w[~eligible] == 1).all()
    assert b.stats["ib_pruned"] == n_drop and b.stats["ib_eligible"] == n_elig
    assert b.stats["n_selected"] == CAND - n_drop and b.stats["n_candidates"] == CAND
    # drop mode on the same dropped set: kept weights scaled by n_kept / n_cand, mean over n_kept
    per = torch.rand(CAND, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3
    kept = ~dropped
    base = torch.where(eligible, n_elig / (n_elig - n_drop), 1.0).double()
    drop_loss = (per[kept] * base[kept] * (int(kept.sum()) / CAND)).mean()
    assert float((per * w.double()).mean()) == pytest.approx(float(drop_loss), abs=1e-6)
    # only the kept samples' losses reach the table: the dropped keep their last one
    sel.observe(b.indices, torch.full((CAND,), 9.0))
    assert (sel.loss[cand[kept]] == 9.0).all() and (sel.loss[cand[dropped]] == 0.5).all()


def test_mask_mode_draws_uniformly_among_eligible_and_is_unbiased():
    sel = infobatch(mode="mask")
    losses = known_table(sel).double()
    cand = torch.arange(20, 60)
    hits, est = torch.zeros(CAND), []
    for _ in range(2000):
        w = sel(None, *batch(), cand).weights
        hits += (w > 0).float()
        est.append(float((w.double() * losses[cand]).mean()))
    assert len(sel._masks) == 256                                      # never observed: bounded
    assert np.mean(est) == pytest.approx(float(losses[cand].mean()), rel=0.01)
    high = cand % 4 == 0
    assert (hits[high] == 2000).all()
    assert hits[~high].mean() == pytest.approx(2000 * 15 / 30, rel=0.05)
    assert hits[~high].min() > 2000 * 0.5 * 0.8                        # each one, not a favourite few


def test_mask_draws_are_seeded_and_resume_from_the_state_dict():
    cand = torch.arange(20, 60)
    a, b = infobatch(mode="mask", seed=3), infobatch(mode="mask", seed=3)
    for s in (a, b):
        known_table(s)
    first = [a(None, *batch(), cand).weights for _ in range(3)]
    assert all(torch.equal(x, b(None, *batch(), cand).weights) for x in first)
    assert not torch.equal(first[0], first[1])
    other = infobatch(mode="mask", seed=4)
    known_table(other)
    assert not torch.equal(first[0], other(None, *batch(), cand).weights)
    state = a.state_dict()
    assert state["mask_generator"].dtype == torch.uint8 and state["mask_generator"].device.type == "cpu"
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    fresh = infobatch(mode="mask", seed=3)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    for _ in range(3):
        assert torch.equal(fresh(None, *batch(), cand).weights, a(None, *batch(), cand).weights)
    again = infobatch(mode="mask", seed=3)                 # a state saved before any draw
    again.load_state_dict(infobatch(mode="mask", seed=3).state_dict())
    known_table(again)
    assert torch.equal(again(None, *batch(), cand).weights, first[0])


def test_auto_is_drop_on_the_cpu():
    """The CPU keeps today's path: the pruned batch is smaller, drawn by the CPU generator."""
    cand = torch.arange(20, 60)
    auto, drop = infobatch(), infobatch(mode="drop")
    for s in (auto, drop):
        known_table(s)
    for _ in range(3):
        x, y = auto(None, *batch(), cand), drop(None, *batch(), cand)
        assert x.inputs.shape[0] == CAND - 15 and torch.equal(x.indices, y.indices)
        assert torch.equal(x.weights, y.weights)


# ---------------------------------------------------------------- no reads in training

@pytest.fixture(scope="module")
def fmnist() -> tuple[np.ndarray, np.ndarray]:
    x, y = fashion_mnist("train")
    return x[:N], y[:N]


def pruning_params(mode: str) -> dict[str, Any]:
    """InfoBatch gathering on log steps (``sync_every`` = the micro-batches of a log window) and
    pruning to the end, so from step ``EVERY + 1`` on every step prunes."""
    return {"sync_every": 2 * EVERY, "anneal": 1.0, "prune": 0.5, "mode": mode}


@pytest.mark.parametrize("mode", ["mask", "drop"])
def test_pruning_steps_read_nothing_back_in_mask_mode(fmnist, monkeypatch, mode):
    """Mask mode's pruning steps between logs read nothing; drop mode's do (the check sees it)."""
    reads: dict[int, list[str]] = {}
    r = sync_free_run(fmnist, "cpu", count_reads(reads), monkeypatch, pruning_params(mode))
    last = r.metrics[-1]
    assert last["step"] == STEPS and last["select/ib_pruned"] > 0     # step 10 pruned
    pruning = {s: reads[s] for s in range(EVERY + 1, STEPS) if s % EVERY}
    if mode == "mask":
        assert pruning == {s: [] for s in pruning}, pruning
        assert last["select/n_candidates"] == 32 and last["select/n_selected"] < 32
    else:
        assert all(pruning.values()), pruning
    unlogged_before = {s: reads[s] for s in range(1, EVERY)}
    assert unlogged_before == {s: [] for s in unlogged_before}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pruning_steps_never_synchronize(fmnist, monkeypatch):
    """``mode: auto`` is mask on CUDA: steps between logs, pruning ones included, run under
    ``torch.cuda.set_sync_debug_mode("error")`` (step 1 exempt: it moves the table to the GPU)."""
    strict_steps: list[int] = []
    r = sync_free_run(fmnist, "cuda", strict_on_cuda(strict_steps), monkeypatch, pruning_params("auto"),
                      amp="bf16")
    assert strict_steps == [s for s in range(2, STEPS + 1) if s % EVERY]
    last = r.metrics[-1]
    assert last["select/ib_pruned"] > 0 and last["select/n_candidates"] == 32   # masked, not dropped
    assert all(np.isfinite(m["loss"]) for m in r.metrics)
