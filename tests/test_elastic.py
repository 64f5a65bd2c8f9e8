"""Resuming at another world size, sample-exact: the loaders' global epoch positions (every
world-size change 1 ↔ 2 ↔ 3 ↔ 4, keeping or scaling the global batch, with padding or
dropping, twice within one epoch), and the training state that crosses over (selector tables,
PowerSGD's residuals). The same under real torchrun is in test_elastic_dist.py."""
from __future__ import annotations

from collections import Counter
from fractions import Fraction

import numpy as np
import pytest
import torch

from sluice.errors import LoaderError, TrainError
from sluice.stages.load import Loader, SamplerConfig
from sluice.stages.load.arrays import ArrayLoader
from sluice.stages.load.epochs import EpochCursor
from sluice.stages.train.config import CommConfig, TrainConfig
from sluice.stages.train.checkpointer import rank_part
from sluice.stages.train.elastic import Resize

N = 103  # odd, so padding and dropping both matter
X = np.zeros((N, 2, 2), np.uint8)
Y = np.arange(N)


def arrays(world: int, batch: int, drop_last: bool = True, seed: int = 5) -> list[ArrayLoader]:
    return [ArrayLoader(X, Y, batch, seed=seed, rank=r, world_size=world, drop_last=drop_last)
            for r in range(world)]


def take(loaders, k: int | None = None) -> list[int]:
    """The indices every rank takes in its next ``k`` batches (all remaining when None)."""
    out: list[int] = []
    its = [iter(x) for x in loaders]
    steps = len(loaders[0]) - loaders[0].cursor.next_batch if k is None else k
    for _ in range(steps):
        batches = [next(it).indices for it in its]
        assert len({len(b) for b in batches} | {0}) <= 3  # per-rank sizes differ by at most one
        out += [int(i) for b in batches for i in b]
    return out


def epoch_multiset(world: int, batch: int, drop_last: bool) -> Counter:
    return Counter(take(arrays(world, batch, drop_last)))


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("w, w2", [(1, 2), (2, 1), (2, 3), (3, 2), (3, 4), (4, 3), (1, 4), (4, 1)])
def test_keeping_the_global_batch_every_world_change_continues_the_epoch_exactly(w, w2, drop_last):
    g = 12  # divides by 1, 2, 3 and 4: the per-rank batch becomes g / w2
    before = arrays(w, g // w, drop_last)
    seen = take(before, 3)
    state = before[0].state_dict()
    after = arrays(w2, g // w2, drop_last)
    for a in after:
        a.load_state_dict(state)
    assert len(after[0]) == len(before[0]) - 3  # the same global batches, split otherwise
    assert Counter(seen + take(after)) == epoch_multiset(w, g // w, drop_last)  # none twice, none skipped
    fresh = arrays(w2, g // w2, drop_last)
    for a in (*after, *fresh):  # the next epoch is the new world size's own
        a.set_epoch(1)
    assert take(after) == take(fresh)


@pytest.mark.parametrize("w, w2", [(2, 3), (3, 2), (1, 4), (4, 1), (2, 4)])
def test_scaling_the_global_batch_cuts_the_rest_of_the_epoch_into_new_batches(w, w2):
    b = 5  # per rank, kept: the global batch goes from 5w to 5w2
    before = arrays(w, b)
    seen = take(before, 2)
    after = arrays(w2, b)
    for a in after:
        a.load_state_dict(before[0].state_dict())
    assert Counter(seen + take(after)) == epoch_multiset(w, b, True)


def test_two_resizes_inside_one_epoch():
    a = arrays(2, 6)
    seen = take(a, 2)
    b = arrays(3, 4)
    for x in b:
        x.load_state_dict(a[0].state_dict())
    seen += take(b, 3)
    c = arrays(4, 3)
    for x in c:
        x.load_state_dict(b[1].state_dict())  # any rank's state says where the epoch is
    assert Counter(seen + take(c)) == epoch_multiset(2, 6, True)


def test_a_tail_too_small_for_the_ranks_is_refused_with_the_reason():
    cur = EpochCursor(lambda e, g: np.arange(10), 10, rank=0, world=1, batch=4, drop_last=False)
    state = cur.state_dict() | {"next_batch": 2, "consumed": 8}
    with pytest.raises(LoaderError, match="last 2 samples of epoch 0 cannot be split over 3 ranks"):
        EpochCursor(lambda e, g: np.arange(10), 10, rank=0, world=3, batch=4,
                    drop_last=False).load_state_dict(state, world=1, batch=4)
    old = {"epoch": 0, "next_batch": 1}  # a state from before this existed: same world only
    with pytest.raises(LoaderError, match="predates"):
        EpochCursor(lambda e, g: np.arange(10), 10, rank=0, world=2, batch=4,
                    drop_last=False).load_state_dict(old, world=1, batch=4)


@pytest.mark.parametrize("kind", ["curriculum", "shuffle"])
def test_the_artifact_loader_resumes_a_curriculum_epoch_at_another_world_size(fmnist_artifact, kind):
    """The curriculum paces each global batch, so its order depends on the global batch: the
    epoch in progress keeps the order it was begun with, whatever the new world size."""
    root = fmnist_artifact.root
    n = fmnist_artifact.manifest.split("train").count
    difficulty = np.random.default_rng(0).random(n)
    sampler = SamplerConfig(kind=kind, seed=3, ramp_epochs=2)

    def loaders(world: int, batch: int) -> list[Loader]:
        return [Loader(root, split="train", batch_size=batch, backend="memory", sampler=sampler,
                       scores=difficulty, rank=r, world_size=world, drop_last=True, prefetch=0,
                       workers=1) for r in range(world)]
    full = Counter(take(loaders(2, 8)))
    before = loaders(2, 8)
    seen = take(before, 5)
    after = loaders(3, 8)  # the global batch grows from 16 to 24
    for x in after:
        x.load_state_dict(before[1].state_dict())
    assert Counter(seen + take(after)) == full


# ---- the training state that crosses over ------------------------------------------------

def test_powersgd_residuals_are_averaged_and_the_rest_is_shared():
    from sluice.stages.train.comm import build_hook
    hook = build_hook(CommConfig(mode="powersgd", params={"start_iter": 3}))
    states = [{"mode": "powersgd", "iter": 9, "errors": {0: torch.full((2, 2), float(r))},
               "qs": {0: torch.ones(2, 1)}} for r in range(3)]
    merged = hook.merge_rank_states(states)
    assert torch.equal(merged["errors"][0], torch.full((2, 2), 1.0)) and merged["iter"] == 9
    ranks = [{"rng": {"torch": torch.get_rng_state()}, "loader": {"epoch": 0, "r": r},
              "comm": states[r], "selector": {"table": torch.arange(4), "r": r}} for r in range(3)]
    new = [rank_part(ranks, r, step=7, seed=0, hook=hook) for r in range(5)]
    assert all(p["loader"] == ranks[0]["loader"] for p in new)  # global position: any rank's
    assert [p["selector"]["r"] for p in new] == [0, 1, 2, 0, 1]  # identical tables carry over
    assert torch.equal(new[1]["rng"]["torch"], ranks[1]["rng"]["torch"])  # an old rank keeps its RNG
    assert not torch.equal(new[3]["rng"]["torch"], new[4]["rng"]["torch"])  # new ranks get their own


def test_resize_policies_scale_the_lr_and_budget_or_refuse():
    state = {"ranks": [{}, {}], "step": 10, "elastic": {"world_origin": 2, "batch_scale": [1, 1],
                                                        "total_steps": 40, "units": 10.0}}
    keep = Resize.resumed(TrainConfig(), state, 4, Fraction(1, 2))
    assert (keep.step_weight, keep.lr_scale) == (1.0, 1.0)
    scale = Resize.resumed(TrainConfig(resize="scale_global_batch"), state, 4, Fraction(1))
    assert (scale.step_weight, scale.lr_scale) == (2.0, 2.0)
    assert Resize.resumed(TrainConfig(resize="scale_global_batch", resize_lr="sqrt"), state, 1,
                          Fraction(1)).lr_scale == pytest.approx(0.5 ** 0.5)
    with pytest.raises(TrainError, match="refuse"):
        Resize.resumed(TrainConfig(resize="refuse"), state, 3, Fraction(1))
    with pytest.raises(TrainError, match="scaled by 2/3"):  # the loaders were not rescaled
        Resize.resumed(TrainConfig(), state, 3, Fraction(1))


def test_keeping_the_global_batch_rescales_every_per_rank_size_or_says_why_not(fmnist_artifact):
    """The job stays as assembled; its specs build each rank's loader and selector at the scaled
    sizes (or say why they cannot)."""
    from sluice.stages.load.specs import ImagesData
    from sluice.stages.select.spec import SelectionSpec
    data = ImagesData(root=str(fmnist_artifact.root), loader={"batch_size": 64, "workers": 0})
    sel = SelectionSpec.model_validate({"config": {"method": "uniform", "n_select": 32}, "candidate_size": 64,
                                        "split_size": 1000})
    with pytest.raises(TrainError, match="world size that divides"):  # 2 ranks -> 3: 128 / 3
        data.build(rank=0, world_size=3, batch_scale=Fraction(2, 3))
    with pytest.raises(TrainError, match="world size that divides"):
        sel.build(Fraction(2, 3))
    loader, selector = data.build(rank=0, world_size=4, batch_scale=Fraction(1, 2)), sel.build(Fraction(1, 2))
    assert (loader.config.batch_size, selector.n_select) == (32, 16)  # 2 ranks -> 4
    assert data.loader.batch_size == 64 and sel.candidate_size == 64  # the specs themselves unchanged
