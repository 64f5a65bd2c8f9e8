"""Sample selection: exact picks on hand-made losses, IL artifact reuse, unbiased importance
weights, fixed per-step counts, label noise, and clear errors for bad input."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from sluice.stages.select import (ILModelConfig, ImportanceSampler, SelectionConfig, SelectionError,
                           build_selector, compute_irreducible_loss, inject_label_noise,
                           irreducible_loss_scores, select_top)
from sluice.stages.precision import resolve_amp
from sluice.storage.scores import ScoresError, load_scores, save_scores

C = 10  # classes


def logits_with_loss_rank(a: list[float], labels: list[int]) -> torch.Tensor:
    """Logits 0 everywhere but ``a[j]`` at the label: CE = log(e^a + C - 1) - a, which falls as
    ``a`` rises, so a larger ``a`` means a smaller loss (the 'model' is nn.Identity)."""
    x = torch.zeros(len(a), C)
    x[torch.arange(len(a)), torch.tensor(labels)] = torch.tensor(a)
    return x


def hand_batch():
    a = [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]          # loss rises with position
    labels = [0, 1, 2, 3, 4, 5]
    x = logits_with_loss_rank(a, labels)
    y = torch.tensor(labels)
    idx = torch.tensor([10, 11, 12, 13, 14, 15])  # dataset indices differ from positions
    return x, y, idx


def test_select_top_exact():
    s = torch.tensor([0.3, 2.0, -1.0, 5.0, 1.9])
    assert set(select_top(s, 2).tolist()) == {1, 3}
    assert set(select_top(s, 5).tolist()) == set(range(5))


def test_loss_selection_picks_highest_loss():
    x, y, idx = hand_batch()
    sel = build_selector(SelectionConfig(method="loss", n_select=2), candidate_size=6)
    out = sel(nn.Identity(), x, y, idx)
    assert sorted(out.indices.tolist()) == [14, 15]
    assert out.inputs.shape == (2, C) and out.weights is None
    assert sorted(out.targets.tolist()) == [4, 5]


def test_rho_loss_picks_highest_reducible_loss_and_reports_stats():
    x, y, idx = hand_batch()
    il = np.zeros(20, dtype=np.float32)
    il[[14, 15]] = 10.0           # 'noisy' points: high loss, but irreducible
    noise = np.zeros(20, dtype=bool)
    noise[[14, 15]] = True
    sel = build_selector(SelectionConfig(method="rho_loss", ratio=2 / 6), il, candidate_size=6,
                         split_size=20, noise_mask=noise)
    out = sel(nn.Identity(), x, y, idx)
    assert sorted(out.indices.tolist()) == [12, 13]
    st = out.stats
    assert st["n_selected"] == 2 and st["n_candidates"] == 6
    assert st["cand_noisy"] == 2 and st["sel_noisy"] == 0
    assert st["sel_il_mean"] == 0 and st["cand_il_mean"] == pytest.approx(20 / 6)
    assert st["sel_reducible_mean"] > st["cand_reducible_mean"]
    # the loss rule on the same batch walks straight into the noisy points
    loss_sel = build_selector(SelectionConfig(method="loss", ratio=2 / 6), il, candidate_size=6,
                              noise_mask=noise)
    assert loss_sel(nn.Identity(), x, y, idx).stats["sel_noisy"] == 2


def test_scoring_restores_model_mode():
    x, y, idx = hand_batch()
    m = nn.Sequential(nn.Identity())
    m.eval()
    build_selector(SelectionConfig(method="loss", n_select=3))(m, x, y, idx)
    assert not m.training


def test_chunked_scoring_selects_the_same_samples():
    """Scoring in chunks is a speed knob: in eval mode the losses, and so the picks, are the same."""
    from sluice.stages.models import build_model
    torch.manual_seed(0)
    m = build_model("small_cnn", in_channels=1, num_classes=C, width=4).eval()
    x, y = torch.randn(50, 1, 28, 28), torch.randint(0, C, (50,))
    idx = torch.arange(100, 150)
    picks = [build_selector(SelectionConfig(method="loss", n_select=7, params={"score_mode": "eval", "score_chunk": chunk}))(m, x, y, idx)
             for chunk in (None, 16, 64)]
    assert all(torch.equal(p.indices.sort().values, picks[0].indices.sort().values) for p in picks)
    assert all(abs(p.stats["sel_loss_mean"] - picks[0].stats["sel_loss_mean"]) < 1e-5 for p in picks)


def test_label_noise_scoring_caps_mislabelled_reducible_loss():
    """Under a label-noise likelihood a confidently 'wrong' label costs at most -log(a/K), about
    what an IL model trained on noisy labels assigns it, so it stops winning rho_loss's top-k;
    the loss ranking itself is unchanged (loss / selective backprop pick the same samples)."""
    from sluice.stages.select import candidate_losses
    x = torch.zeros(3, C)
    x[0, 1] = 20.0          # sample 0: label 0, the model is sure it is class 1 (CE ~ 20)
    x[1, 1] = 1.0           # sample 1: label 1, learnable and not yet learnt (CE ~ 1.5)
    x[2, 2] = 6.0           # sample 2: label 2, learnt
    y, idx = torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2])
    il = torch.tensor([3.9, 0.3, 0.1])
    plain = candidate_losses(nn.Identity(), x, y)
    noisy = candidate_losses(nn.Identity(), x, y, label_noise=0.2)
    assert plain[0] > 19 and noisy[0] <= -math.log(0.2 / C) + 1e-5
    assert torch.equal(plain.argsort(), noisy.argsort())
    pick = {a: build_selector(SelectionConfig(method="rho_loss", n_select=1, params={"label_noise": a}),
                              il)(nn.Identity(), x, y, idx).indices.tolist() for a in (0.0, 0.2)}
    assert pick == {0.0: [0], 0.2: [1]}


def test_uniform_is_fixed_count_and_seeded():
    x, y, idx = hand_batch()
    a = build_selector(SelectionConfig(method="uniform", n_select=3, seed=7))
    b = build_selector(SelectionConfig(method="uniform", n_select=3, seed=7))
    ia, ib = a(None, x, y, idx).indices, b(None, x, y, idx).indices
    assert ia.tolist() == ib.tolist() and len(set(ia.tolist())) == 3


def test_selective_backprop_fixed_count_and_prefers_high_loss():
    torch.manual_seed(0)
    sel = build_selector(SelectionConfig(method="selective_backprop", n_select=16, seed=1, params={"beta": 2.0, "history_size": 512}), candidate_size=64)
    counts = torch.zeros(64)
    for _ in range(40):
        a = torch.linspace(6, -2, 64)             # candidate j has rank j in loss
        x = logits_with_loss_rank(a.tolist(), [0] * 64)
        idx = torch.arange(64)
        out = sel(nn.Identity(), x, torch.zeros(64, dtype=torch.long), idx)
        assert out.inputs.shape[0] == 16 and out.indices.shape[0] == 16
        counts += torch.bincount(out.indices, minlength=64)
    assert counts[48:].sum() > 4 * counts[:16].sum()


def test_importance_weights_are_unbiased():
    rng = np.random.default_rng(0)
    n = 50
    losses = rng.gamma(1.0, 1.0, size=n)
    s = ImportanceSampler(n, smoothing=0.2, seed=3)
    s.update(np.arange(n), losses)
    p, w = s.probabilities(), s.weights(np.arange(n))
    assert p.sum() == pytest.approx(1.0)
    assert np.sum(p * w * losses) == pytest.approx(losses.mean(), rel=1e-12)  # exact expectation
    assert w.max() <= 1 / 0.2 + 1e-9                                        # smoothing bounds w
    draws = s.sample(200_000)
    est = np.mean(s.weights(draws) * losses[draws])                         # Monte Carlo
    assert est == pytest.approx(losses.mean(), rel=0.02)
    # loss-proportional: the highest-loss sample is drawn most often
    assert np.bincount(draws, minlength=n).argmax() == losses.argmax()


def test_importance_selector_weights_and_observe():
    sel = build_selector(SelectionConfig(method="importance", params={"smoothing": 0.5}), split_size=8)
    x, y = torch.zeros(4, C), torch.zeros(4, dtype=torch.long)
    out = sel(None, x, y, torch.tensor([0, 1, 2, 3]))
    assert torch.allclose(out.weights, torch.ones(4))   # nothing observed yet: uniform
    sel.observe(torch.tensor([0, 1]), torch.tensor([3.0, 1.0]))
    w = sel(None, x, y, torch.tensor([0, 1, 2, 3])).weights
    assert w[0] < w[1] and w[2] == w[3]                  # unseen samples take the mean estimate
    before = sel.sampler.estimates.copy()
    sel.observe(torch.tensor([0, 2]), torch.tensor([float("nan"), 2.0]))  # NaN: left as it was
    assert sel.sampler.estimates[0] == before[0] and sel.sampler.estimates[2] == 2.0
    with pytest.raises(SelectionError, match="NaN"):     # the sampler itself still refuses them
        sel.sampler.update(np.array([0]), np.array([float("nan")]))


def test_importance_redraw_from_uniform_candidates_is_unbiased():
    """The training stage's mode: a uniform candidate batch, n_b redrawn in proportion to p."""
    rng = np.random.default_rng(1)
    n, n_cand, n_b = 200, 32, 8
    losses = rng.gamma(1.0, 1.0, size=n)
    sel = build_selector(SelectionConfig(method="importance", n_select=n_b, params={"smoothing": 0.2, "importance_draw": "candidates"}),
                         candidate_size=n_cand, split_size=n)
    sel.observe(torch.arange(n), torch.as_tensor(losses))
    cand = torch.as_tensor(rng.choice(n, n_cand, replace=False))
    x, y = torch.zeros(n_cand, C), torch.zeros(n_cand, dtype=torch.long)
    est, hits = [], torch.zeros(n)
    for _ in range(4000):
        b = sel(None, x, y, cand)
        assert b.inputs.shape[0] == b.indices.shape[0] == b.weights.shape[0] == n_b
        est.append(float((b.weights.double() * torch.as_tensor(losses)[b.indices]).mean()))
        hits += torch.bincount(b.indices, minlength=n)
    assert np.mean(est) == pytest.approx(losses[cand.numpy()].mean(), rel=0.02)
    # loss-proportional within the batch: the highest-loss candidate is redrawn most often
    assert int(hits.argmax()) == int(cand[losses[cand.numpy()].argmax()])
    assert b.stats["n_candidates"] == n_cand and b.stats["n_selected"] == n_b


def _importance_rank(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    sel = build_selector(SelectionConfig(method="importance", n_select=4, params={"smoothing": 0.1, "importance_draw": "candidates"}),
                         candidate_size=8, split_size=16)
    mine = torch.arange(8) + 8 * rank                  # each rank trained different samples
    b = sel(None, torch.zeros(8, C), torch.zeros(8, dtype=torch.long), mine)
    sel.observe(mine, (mine.float() + 1.0))            # loss of sample i is i + 1
    np.save(f"{out}/rank{rank}.npy", np.stack([sel.sampler.estimates, sel.sampler.probabilities(),
                                               np.full(16, b.inputs.shape[0])]))
    dist.destroy_process_group()


@pytest.mark.slow
def test_importance_estimates_are_gathered_from_every_rank(tmp_path):
    """Under DDP each rank observes its own samples; all-gather gives every rank every loss,
    so the ranks keep identical probabilities (and train the same n_b)."""
    import torch.multiprocessing as mp
    mp.start_processes(_importance_rank, args=(2, f"file://{tmp_path}/rdzv", str(tmp_path)),
                       nprocs=2, start_method="spawn")
    r0, r1 = np.load(tmp_path / "rank0.npy"), np.load(tmp_path / "rank1.npy")
    np.testing.assert_array_equal(r0, r1)
    np.testing.assert_allclose(r0[0], np.arange(16) + 1.0)   # both ranks' losses, in place
    assert r0[1].sum() == pytest.approx(1.0) and (r0[2] == 4).all()


def test_label_noise_deterministic_and_recorded():
    y = np.arange(1000) % C
    a = inject_label_noise(y, 0.2, C, seed=5)
    b = inject_label_noise(y, 0.2, C, seed=5)
    assert np.array_equal(a.labels, b.labels) and np.array_equal(a.flipped, b.flipped)
    assert a.flipped.size == 200
    assert np.array_equal(np.flatnonzero(a.labels != y), a.flipped)   # every flip is a change
    assert not np.array_equal(inject_label_noise(y, 0.2, C, seed=6).flipped, a.flipped)
    assert json.loads(json.dumps(a.record()))["flipped"] == a.flipped.tolist()


def test_config_round_trip_and_forbids_extra():
    cfg = SelectionConfig(method="rho_loss", ratio=0.2, il=ILModelConfig(epochs=2))
    assert SelectionConfig.model_validate_json(cfg.model_dump_json()) == cfg
    with pytest.raises(ValueError):
        SelectionConfig(method="rho_loss", ratoi=0.2)
    with pytest.raises(ValueError):
        SelectionConfig(method="best")


# ---------------------------------------------------------------- bad input

def test_bad_sizes_are_refused_before_training():
    with pytest.raises(SelectionError, match="n_b = 70 > n_B = 64"):
        build_selector(SelectionConfig(method="loss", n_select=70), candidate_size=64)
    with pytest.raises(SelectionError, match="< 1"):
        build_selector(SelectionConfig(method="loss", ratio=0.001), candidate_size=64)
    with pytest.raises(SelectionError, match="rho_loss needs"):
        build_selector(SelectionConfig(method="rho_loss"), candidate_size=64)
    with pytest.raises(SelectionError, match="has 5 values but the split has 20"):
        build_selector(SelectionConfig(method="rho_loss"), np.zeros(5), split_size=20)
    with pytest.raises(SelectionError, match="NaN"):
        build_selector(SelectionConfig(method="rho_loss"), np.array([0.0, np.nan]))
    with pytest.raises(ValueError):
        SelectionConfig(ratio=0)


def test_nan_losses_and_wrong_batch_size_raise():
    x, y, idx = hand_batch()
    sel = build_selector(SelectionConfig(method="loss", n_select=2), candidate_size=6)
    x[3, 0] = float("nan")
    with pytest.raises(SelectionError, match=r"NaN/inf.*\[13\]"):
        sel(nn.Identity(), x, y, idx)
    with pytest.raises(SelectionError, match="built for n_b = 2"):
        build_selector(SelectionConfig(method="loss", ratio=0.5), candidate_size=4)(
            nn.Identity(), *hand_batch())


def test_index_outside_scored_split_raises():
    x, y, idx = hand_batch()
    sel = build_selector(SelectionConfig(method="rho_loss", n_select=2), np.zeros(12))
    with pytest.raises(SelectionError, match="outside the scored split"):
        sel(nn.Identity(), x, y, idx)


# ---------------------------------------------------------------- IL scores artifact

def tiny_data(n: int, seed: int):
    """8x8 images whose class sets the brightness of one row: learnable in a few steps."""
    g = np.random.default_rng(seed)
    y = g.integers(0, 4, size=n)
    x = g.integers(0, 60, size=(n, 8, 8)).astype(np.uint8)
    x[np.arange(n), y * 2, :] = 250
    return x, y


IL_CFG = ILModelConfig(epochs=2, batch_size=16, model_kwargs={"width": 4})
FP = "a" * 64


def test_il_artifact_reused_when_keys_match_recomputed_when_not(tmp_path):
    hx, hy = tiny_data(64, 0)
    tx, ty = tiny_data(48, 1)
    first = irreducible_loss_scores(IL_CFG, hx, hy, tx, ty, FP, tmp_path)
    assert not first.extra["reused"] and first.values.shape == (48,)
    assert np.isfinite(first.values).all() and first.values.dtype == np.float32
    again = irreducible_loss_scores(IL_CFG, hx, hy, tx, ty, FP, tmp_path)
    assert again.extra["reused"] and np.array_equal(again.values, first.values)
    assert again.path == first.path
    # another config or another dataset: a new artifact, trained afresh
    other_cfg = irreducible_loss_scores(IL_CFG.model_copy(update={"epochs": 1}), hx, hy, tx, ty,
                                        FP, tmp_path)
    other_fp = irreducible_loss_scores(IL_CFG, hx, hy, tx, ty, "b" * 64, tmp_path)
    assert not other_cfg.extra["reused"] and not other_fp.extra["reused"]
    assert len({first.path, other_cfg.path, other_fp.path}) == 3
    # the scoring batch size does not change values, so it does not change the key
    bs = irreducible_loss_scores(IL_CFG.model_copy(update={"score_batch_size": 7}), hx, hy, tx, ty,
                                 FP, tmp_path)
    assert bs.extra["reused"]
    # "auto" precision (the default) is keyed as what it resolves to on this machine, so the
    # explicit mode finds the same artifact
    resolved = resolve_amp("auto", "cpu")
    assert IL_CFG.amp == "auto" and first.config["amp"] == resolved
    explicit = irreducible_loss_scores(IL_CFG.model_copy(update={"amp": resolved}), hx, hy, tx, ty,
                                       FP, tmp_path)
    assert explicit.extra["reused"]
    # plain-array API returns the same values
    arr = compute_irreducible_loss(IL_CFG, hx, hy, tx, ty, FP, tmp_path)
    assert np.array_equal(arr, first.values)
    # label_noise="auto" reads the rate off the IL model's holdout accuracy in the record
    auto_cfg = SelectionConfig(method="rho_loss", n_select=2, params={"label_noise": "auto"})
    sel = build_selector(auto_cfg, first, split_size=48, dataset_fingerprint=FP)
    assert sel.params.label_noise == pytest.approx(1 - first.extra["holdout_accuracy"], abs=1e-4)
    with pytest.raises(SelectionError, match="holdout accuracy"):
        build_selector(auto_cfg, first.values)
    with pytest.raises(ValueError, match="label_noise"):
        SelectionConfig(method="rho_loss", params={"label_noise": 1.5})
    # a selector refuses the scores for another dataset or another split length
    with pytest.raises(SelectionError, match="belong to dataset"):
        build_selector(SelectionConfig(method="rho_loss"), first, dataset_fingerprint="c" * 64)
    with pytest.raises(SelectionError, match="have 48 values"):
        build_selector(SelectionConfig(method="rho_loss"), first, split_size=50)


def test_il_rejects_empty_holdout_and_bad_labels(tmp_path):
    tx, ty = tiny_data(8, 1)
    with pytest.raises(SelectionError, match="holdout split is empty"):
        compute_irreducible_loss(IL_CFG, tx[:0], ty[:0], tx, ty, FP, tmp_path)
    with pytest.raises(SelectionError, match="labels must lie"):
        compute_irreducible_loss(IL_CFG, tx, ty - 1, tx, ty, FP, tmp_path, num_classes=4)


def test_scores_store_checks_fingerprint_length_and_corruption(tmp_path):
    cfg = {"k": 1}
    s = save_scores(tmp_path, np.arange(5, dtype=np.float32), fingerprint=FP, kind="difficulty",
                    split="train", config=cfg)
    assert s.path.startswith(str(tmp_path / FP[:16]))
    assert np.array_equal(load_scores(tmp_path, fingerprint=FP, kind="difficulty", split="train",
                                      config=cfg).values, np.arange(5))
    with pytest.raises(ScoresError, match="5 values but split 'train' has 6"):
        load_scores(tmp_path, fingerprint=FP, kind="difficulty", split="train", config=cfg,
                    length=6)
    with pytest.raises(ScoresError, match="no difficulty scores"):
        load_scores(tmp_path, fingerprint="b" * 64, kind="difficulty", split="train", config=cfg)
    with pytest.raises(ScoresError, match="belong to dataset"):
        s.check(fingerprint="b" * 64)
    with pytest.raises(ScoresError, match="NaN"):
        save_scores(tmp_path, np.array([1.0, math.inf]), fingerprint=FP, kind="difficulty",
                    split="train", config=cfg)
    with open(s.path, "r+b") as f:   # flip the last byte of the array
        f.seek(-1, 2)
        f.write(b"\x01")
    with pytest.raises(ScoresError, match="sha256"):
        load_scores(tmp_path, fingerprint=FP, kind="difficulty", split="train", config=cfg)


# ---------------------------------------------------------------- in a plain training loop

@pytest.mark.parametrize("method", ["rho_loss", "selective_backprop", "importance"])
def test_plain_training_loop(method, tmp_path):
    torch.manual_seed(0)
    hx, hy = tiny_data(64, 0)
    tx, ty = tiny_data(96, 1)
    cfg = SelectionConfig(method=method, ratio=0.5, il=IL_CFG)
    il = irreducible_loss_scores(cfg.il, hx, hy, tx, ty, FP, tmp_path)
    sel = build_selector(cfg, il, candidate_size=16, split_size=96, dataset_fingerprint=FP)
    from sluice.stages.models import build_model
    model = build_model("small_cnn", in_channels=1, num_classes=4, width=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = (torch.as_tensor(tx).float().unsqueeze(1) / 255 - 0.286) / 0.353
    y = torch.as_tensor(ty).long()
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        idx = (torch.as_tensor(sel.sampler.sample(16)) if method == "importance"
               else torch.randperm(96, generator=g)[:16])
        b = sel(model, x[idx], y[idx], idx)
        assert b.inputs.shape[0] == (16 if method == "importance" else 8)
        per = nn.functional.cross_entropy(model(b.inputs), b.targets, reduction="none")
        loss = (per * b.weights).mean() if b.weights is not None else per.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sel.observe(b.indices, per.detach())
        assert all(math.isfinite(v) for v in b.stats.values())


def test_none_means_no_selector_and_helpers():
    from sluice.stages.select import candidate_size_for
    assert build_selector(SelectionConfig(method="none")) is None
    assert candidate_size_for(SelectionConfig(method="loss", ratio=0.2), 64) == 320
    assert candidate_size_for(SelectionConfig(method="infobatch", ratio=0.2), 64) == 64  # prunes the batch


# ---------------------------------------------------------------- InfoBatch

def test_infobatch_prunes_only_well_learnt_samples_with_unbiased_weights():
    """No pruning before any loss is known; then only below-mean samples are skipped, the same
    count every call, and (loss * w).mean() over the kept ones is unbiased for the whole batch."""
    n, n_cand = 100, 40
    sel = build_selector(SelectionConfig(method="infobatch", params={"prune": 0.5, "sync_every": 1}),
                         candidate_size=n_cand, split_size=n)
    x, y = torch.zeros(n_cand, C), torch.zeros(n_cand, dtype=torch.long)
    cand = torch.arange(20, 60)
    first = sel(None, x, y, cand)
    assert first.inputs.shape[0] == n_cand and first.weights is None   # nothing observed yet
    losses = torch.where(torch.arange(n) % 4 == 0, 4.0, 0.5).double()  # mean 1.375: 75% below
    sel.observe(torch.arange(n), losses)
    est, sizes, hits = [], set(), torch.zeros(n)
    for _ in range(3000):
        b = sel(None, x, y, cand)
        sizes.add(b.inputs.shape[0])
        est.append(float((b.weights.double() * losses[b.indices]).mean()))
        hits += torch.bincount(b.indices, minlength=n)
    assert sizes == {n_cand - round(0.5 * 0.75 * n_cand)}               # 40 - 15, every call
    assert np.mean(est) == pytest.approx(float(losses[cand].mean()), rel=0.01)
    high = cand[cand % 4 == 0]
    assert (hits[high] == 3000).all()                                   # never pruned
    low = cand[cand % 4 != 0]
    assert hits[low].float().mean() == pytest.approx(3000 * 15 / 30, rel=0.05)
    assert b.stats["ib_pruned"] == 15 and b.stats["n_candidates"] == n_cand


def test_infobatch_anneal_trains_everything_and_unseen_are_kept():
    sel = build_selector(SelectionConfig(method="infobatch", params={"prune": 0.9, "anneal": 0.5, "sync_every": 1}),
                         candidate_size=8, split_size=16)
    sel.observe(torch.arange(8), torch.tensor([0.1] * 7 + [5.0]))
    x, y = torch.zeros(8, C), torch.zeros(8, dtype=torch.long)
    b = sel(None, x, y, torch.arange(8, 16))                  # never trained: all kept
    assert b.inputs.shape[0] == 8 and b.weights is None
    assert sel(None, x, y, torch.arange(8)).inputs.shape[0] < 8
    sel.set_progress(0.5)
    b = sel(None, x, y, torch.arange(8))                      # annealed: every sample again
    assert b.inputs.shape[0] == 8 and b.weights is None
    with pytest.raises(SelectionError, match="split_size"):
        build_selector(SelectionConfig(method="infobatch"), candidate_size=8)
    with pytest.raises(SelectionError, match="outside the split"):  # pruning: checked at once
        sel.set_progress(0.0)
        sel(None, x, y, torch.tensor([0, 99]))
    sel.set_progress(0.5)
    sel(None, x, y, torch.tensor([0, 99]))                     # not pruning: flagged on the device,
    with pytest.raises(SelectionError, match="outside the split"):  # raised at the next gather
        sel.flush()


def test_infobatch_observing_nan_leaves_the_entries_unchanged():
    """A NaN/inf loss (a step that diverged on some rank hands over NaN for all) is dropped on the
    device when gathered: those samples keep their last finite loss, the others update."""
    sel = build_selector(SelectionConfig(method="infobatch", params={"sync_every": 2}), candidate_size=4,
                         split_size=6)
    sel.observe(torch.arange(4), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    sel.observe(torch.tensor([4]), torch.tensor([5.0]))
    sel.observe(torch.arange(3), torch.tensor([float("nan"), 9.0, float("inf")]))
    assert sel.state_dict()["pending_index"].tolist() == [1]   # a checkpoint keeps the finite ones
    sel.observe(torch.tensor([5]), torch.tensor([float("nan")]))
    assert sel.loss[:5].tolist() == [1.0, 9.0, 3.0, 4.0, 5.0]
    assert sel.seen.tolist() == [True] * 5 + [False]
    assert sel._mean == pytest.approx(22 / 5)


def test_infobatch_gathers_observed_losses_every_sync_every_calls():
    """Observed losses wait until ``sync_every`` observe calls (one collective for all of them);
    a checkpoint's state keeps what is pending, so a resumed selector gathers it on time."""
    sel = build_selector(SelectionConfig(method="infobatch", params={"sync_every": 3}), candidate_size=4,
                         split_size=12)
    sel.observe(torch.arange(4), torch.full((4,), 1.0))
    sel.observe(torch.arange(4, 8), torch.full((4,), 2.0))
    assert not sel.seen.any()                                  # pending, not yet in the table
    sel.observe(torch.arange(8, 10), torch.full((2,), 3.0))
    assert sel.seen[:10].all() and not sel.seen[10:].any()
    assert sel.loss[:10].tolist() == [1.0] * 4 + [2.0] * 4 + [3.0] * 2
    sel.observe(torch.tensor([10, 11]), torch.tensor([4.0, 5.0]))
    state = sel.state_dict()
    assert not state["seen"][10:].any() and state["pending_index"].tolist() == [10, 11]
    again = build_selector(SelectionConfig(method="infobatch", params={"sync_every": 3}), candidate_size=4,
                           split_size=12)
    again.load_state_dict(state)
    for s in (sel, again):                                     # the third call gathers, resumed or not
        s.observe(torch.tensor([0]), torch.tensor([6.0]))
        assert not s.seen[10:].any()
        s.observe(torch.tensor([1]), torch.tensor([7.0]))
    assert torch.equal(again.loss, sel.loss) and again.seen.all()
    assert sel.loss[[0, 1, 10, 11]].tolist() == [6.0, 7.0, 4.0, 5.0]


def _infobatch_rank(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    sel = build_selector(SelectionConfig(method="infobatch", params={"prune": 0.5, "sync_every": 2}),
                         candidate_size=8, split_size=16)
    mine = torch.arange(8) + 8 * rank
    sel.observe(mine[:4], mine[:4].float() + 1.0)              # pending: gathered with the next
    sel.observe(mine[4:], mine[4:].float() + 1.0)              # losses 1..16, mean 8.5
    # rank 0's candidates are all below the mean, rank 1's all above: rank 1 can prune none,
    # so the ranks observe batches of different sizes (the ragged all-gather)
    b = sel(None, torch.zeros(8, C), torch.zeros(8, dtype=torch.long), mine)
    sel.observe(b.indices, torch.full((b.indices.numel(),), 2.0))
    sel.flush()
    np.save(f"{out}/rank{rank}.npy", np.stack([sel.loss.numpy(), sel.seen.numpy().astype(np.float32),
                                               np.full(16, b.inputs.shape[0])]))
    dist.destroy_process_group()


@pytest.mark.slow
def test_infobatch_loss_table_is_gathered_from_every_rank(tmp_path):
    import torch.multiprocessing as mp
    mp.start_processes(_infobatch_rank, args=(2, f"file://{tmp_path}/rdzv", str(tmp_path)),
                       nprocs=2, start_method="spawn")
    r0, r1 = np.load(tmp_path / "rank0.npy"), np.load(tmp_path / "rank1.npy")
    np.testing.assert_array_equal(r0[:2], r1[:2])               # identical tables on both ranks
    assert r0[2][0] == 8 - 2 and r1[2][0] == 8                  # round(0.5 * 0.5 * 8) = 2 pruned
    assert (r0[1] == 1).all()
    trained = r0[0] == 2.0
    assert trained[8:].all() and trained[:8].sum() == 6         # rank 0's two pruned kept 1..8
