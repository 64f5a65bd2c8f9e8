"""Weighted mixtures of sources (``stages/load/mixture.py``): exact per-epoch counts, draws
without repeats, a deterministic order per (seed, epoch), weights that change between runs, and
exact resume at another world size through the image loader's cursor."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from pydantic import ValidationError

from sluice.errors import LoaderError
from sluice.stages.load.epochs import EpochCursor
from sluice.stages.load.mixture import (MixtureConfig, MixturePlan, MixtureSampler, epoch_counts,
                                        largest_remainder, mixture_order)


def cfg(*rules, **kw) -> MixtureConfig:
    return MixtureConfig(sources=[{"name": f"s{i}", **r} for i, r in enumerate(rules)], **kw)


# ------------------------------------------------------------------ counts
@pytest.mark.parametrize("weights,total", [([1, 1, 1], 100), ([0.7, 0.2, 0.1], 7), ([1e-3, 1, 3.3], 1001),
                                           ([0.5, 0.25, 0.125, 0.125], 9), ([2, 3], 1)])
def test_proportion_counts_are_exact_and_within_one_of_the_quota(weights, total):
    c = largest_remainder(weights, total)
    assert c.sum() == total
    s = sum(Fraction(w) for w in weights)
    for ci, w in zip(c, weights):
        assert abs(ci - Fraction(w) * total / s) < 1


def test_proportion_counts_equal_rounding_whenever_rounding_sums_right():
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(500):
        w = rng.random(rng.integers(2, 6)) + 0.01
        total = int(rng.integers(1, 500))
        q = w / w.sum() * total
        r = np.floor(q + 0.5).astype(int)
        if r.sum() == total and not np.any(np.isclose(q % 1, 0.5)):
            assert np.array_equal(largest_remainder(w.tolist(), total), r)
            checked += 1
    assert checked > 100


def test_awkward_thirds():
    assert largest_remainder([1, 1, 1], 100).tolist() == [34, 33, 33]
    assert largest_remainder([1, 1, 1], 2).tolist() == [1, 1, 0]


def test_epoch_size_defaults_to_the_sources_and_repeat_choose_are_absolute():
    assert epoch_counts(cfg({"weight": 1}, {"weight": 3}), [10, 30]).tolist() == [10, 30]
    assert epoch_counts(cfg({"weight": 1}, {"weight": 3}, epoch_size=9), [10, 30]).tolist() == [2, 7]
    # repeat 1.5 of 7 = 10.5 -> 11 (half up); choose is the count itself, even above the size
    assert epoch_counts(cfg({"repeat": 1.5}, {"choose": 5}, {"repeat": 2}, {"choose": 12}),
                        [7, 100, 3, 4]).tolist() == [11, 5, 6, 12]


def test_weights_in_tokens_count_documents_by_their_sources_mean_length():
    # a: 100 documents of 10 tokens; b: 10 documents of 100 tokens. Equal weights in tokens: 1,000
    # tokens each of the default 2,000, so 100 of a's documents and 10 of b's (in samples: 55 / 55)
    c = cfg({"weight": 1}, {"weight": 1}, weight_unit="tokens")
    assert epoch_counts(c, [100, 10], [1000, 1000]).tolist() == [100, 10]
    assert epoch_counts(cfg({"weight": 1}, {"weight": 1}), [100, 10], [1000, 1000]).tolist() == [55, 55]
    # 3:1 of 800 tokens: quotas 600 and 200 -> 60 documents of a, 2 of b
    c = cfg({"weight": 3}, {"weight": 1}, weight_unit="tokens", epoch_size=800)
    assert epoch_counts(c, [100, 10], [1000, 1000]).tolist() == [60, 2]
    # a quota past a source's tokens repeats its documents; half a document rounds up
    c = cfg({"weight": 1}, {"weight": 1}, weight_unit="tokens", epoch_size=3000)
    assert epoch_counts(c, [100, 10], [1000, 1000]).tolist() == [150, 15]
    assert epoch_counts(cfg({"weight": 1}, {"weight": 1}, weight_unit="tokens", epoch_size=100),
                        [100, 10], [1000, 1000]).tolist() == [5, 1]  # 50 tokens: half of b's one
    with pytest.raises(LoaderError, match="only a token loader"):
        epoch_counts(cfg({"weight": 1}, {"weight": 1}, weight_unit="tokens"), [100, 10])
    with pytest.raises(ValidationError, match="weight_unit tokens applies to weights"):
        cfg({"repeat": 1}, {"choose": 3}, weight_unit="tokens")


def test_a_token_loader_draws_each_sources_share_of_tokens():
    from sluice.stages.load.tokens import ArrayTokens, TokenLoader
    short = ArrayTokens.from_documents([[1] * 4] * 300, eot=0, vocab_size=10)  # 300 x (4 + eot)
    long = ArrayTokens.from_documents([[2] * 99] * 30, eot=0, vocab_size=10)  # 30 x (99 + eot)
    mix = cfg({"weight": 1}, {"weight": 1}, weight_unit="tokens", epoch_size=2000)
    ld = TokenLoader([short, long], seq_len=16, batch_size=4, mixture=mix, prefetch=0)
    assert ld.plan.counts.tolist() == [200, 10]  # 1,000 tokens each
    for _ in ld:
        pass
    # 1,000 tokens from each (the epoch's very last token is only a target: one source served 999)
    assert sorted(ld.served.tolist()) == [999, 1000]


@pytest.mark.parametrize("bad,match", [
    ([{"name": "a", "weight": 1, "repeat": 1}], "exactly one"),
    ([{"name": "a"}], "exactly one"),
    ([{"name": "a", "weight": 0}], "greater than 0"),
    ([{"name": "a", "weight": -1}], "greater than 0"),
    ([{"name": "a", "weight": 1}, {"name": "a", "weight": 2}], "unique"),
    ([{"path": "/x/web", "weight": 1}, {"path": "/y/web", "weight": 2}], "unique"),
    ([{"name": "a", "weight": 1}, {"name": "b", "repeat": 1}], "all proportions"),
])
def test_config_is_validated(bad, match):
    with pytest.raises(ValidationError, match=match):
        MixtureConfig(sources=bad)
    with pytest.raises(ValidationError, match="epoch_size"):
        MixtureConfig(sources=[{"name": "a", "choose": 3}], epoch_size=3)


def test_names_default_to_the_path():
    c = MixtureConfig(sources=[{"path": "/data/web", "weight": 1}, {"weight": 1}])
    assert c.names == ["web", "source1"]


# ------------------------------------------------------------------ order
def _by_source(src, idx, k):
    return idx[src == k]


def test_order_holds_exact_counts_without_repeats_within_a_source():
    sizes, counts = [50, 20, 7], np.array([30, 20, 7])
    src, idx = mixture_order(counts, sizes, ["a", "b", "c"], seed=1, epoch=0)
    assert np.bincount(src, minlength=3).tolist() == counts.tolist()
    for k, (n, c) in enumerate(zip(sizes, counts)):
        got = _by_source(src, idx, k)
        assert len(np.unique(got)) == c and got.min() >= 0 and got.max() < n


def test_counts_above_the_size_cycle_whole_passes():
    src, idx = mixture_order(np.array([25]), [10], ["a"], seed=0, epoch=3)
    per = np.bincount(idx, minlength=10)
    assert sorted(per.tolist()) == [2] * 5 + [3] * 5
    # a whole number of passes: each sample exactly that often
    _, idx2 = mixture_order(np.array([30]), [10], ["a"], seed=0, epoch=3)
    assert np.bincount(idx2).tolist() == [3] * 10


def test_order_is_a_pure_function_of_seed_and_epoch():
    args = (np.array([40, 30, 10]), [100, 30, 50], ["a", "b", "c"])
    a = mixture_order(*args, seed=3, epoch=2)
    b = mixture_order(*args, seed=3, epoch=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    for other in (mixture_order(*args, seed=3, epoch=3), mixture_order(*args, seed=4, epoch=2)):
        assert not np.array_equal(a[1], other[1])


def test_a_partial_source_gives_another_subset_each_epoch():
    picks = [set(mixture_order(np.array([10]), [100], ["a"], seed=0, epoch=e)[1].tolist()) for e in range(3)]
    assert picks[0] != picks[1] and picks[1] != picks[2]
    # a whole source comes in another order each epoch (the interleave keeps it within a source)
    e0, e1 = (mixture_order(np.array([100]), [100], ["a"], seed=0, epoch=e)[1] for e in (0, 1))
    assert not np.array_equal(e0, e1)


def test_a_source_draw_does_not_depend_on_its_place_in_the_list():
    src, idx = mixture_order(np.array([5, 9]), [20, 30], ["a", "b"], seed=0, epoch=1)
    src2, idx2 = mixture_order(np.array([9, 5]), [30, 20], ["b", "a"], seed=0, epoch=1)
    assert set(_by_source(src, idx, 1)) == set(_by_source(src2, idx2, 0))
    assert set(_by_source(src, idx, 0)) == set(_by_source(src2, idx2, 1))


def test_stratified_interleave_keeps_every_prefix_near_the_mixture():
    counts = np.array([500, 300, 200])
    src, _ = mixture_order(counts, [1000, 1000, 1000], ["a", "b", "c"], seed=0, epoch=0)
    seen = np.cumsum(np.eye(3, dtype=int)[src], axis=0)
    expect = np.arange(1, len(src) + 1)[:, None] * counts / counts.sum()
    assert np.abs(seen - expect).max() <= 2
    shuf, _ = mixture_order(counts, [1000] * 3, ["a", "b", "c"], seed=0, epoch=0, interleave="shuffle")
    assert np.bincount(shuf).tolist() == counts.tolist()


# ------------------------------------------------------------------ changes between runs
def test_new_weights_mid_epoch_finish_the_epoch_with_the_old_counts_and_are_recorded():
    old = MixturePlan(cfg({"weight": 1}, {"weight": 1}, epoch_size=40), [30, 30])
    state = old.state_dict(epoch=2)
    new = MixturePlan(cfg({"weight": 3}, {"weight": 1}, epoch_size=40), [30, 30])
    new.load_state_dict(state, begun=True)
    assert new.counts_for(2).tolist() == [20, 20]  # the epoch in progress keeps its counts
    assert np.array_equal(new.order(2)[1], old.order(2)[1])
    assert new.counts_for(3).tolist() == [30, 10]
    assert np.bincount(new.order(3)[0]).tolist() == [30, 10]
    (ch,) = new.changes
    assert ch["epoch"] == 3 and ch["old"]["s0"]["count"] == 20 and ch["new"]["s0"] == \
        {"weight": 3.0, "count": 30, "size": 30}
    # the log travels from run to run; a state taken at an epoch's start switches at once
    later = MixturePlan(cfg({"weight": 1}, {"weight": 1}, epoch_size=40), [30, 30])
    later.load_state_dict(new.state_dict(epoch=4), begun=False)
    assert later.counts_for(4).tolist() == [20, 20]
    assert [c["epoch"] for c in later.changes] == [3, 4]


def test_sources_changed_mid_epoch_are_refused():
    state = MixturePlan(cfg({"weight": 1}, {"weight": 1}), [30, 30]).state_dict(0)
    grown = MixturePlan(cfg({"weight": 1}, {"weight": 1}), [30, 31])
    with pytest.raises(LoaderError, match="epoch boundary"):
        grown.load_state_dict(state, begun=True)
    assert grown.changes == []  # refused before anything changed
    grown.load_state_dict(state, begun=False)  # at a boundary: fine, and recorded
    assert grown.counts_for(0).tolist() == [31, 30]  # 61 halves: the tie goes to the first
    assert grown.changes[0]["new"]["s1"]["size"] == 31


def test_another_seed_is_refused():
    state = MixturePlan(cfg({"weight": 1}), [5]).state_dict(0)
    with pytest.raises(LoaderError, match="seed"):
        MixturePlan(cfg({"weight": 1}, seed=1), [5]).load_state_dict(state, begun=True)


# ------------------------------------------------------------------ images: the index cursor
@pytest.mark.parametrize("world_to", [1, 2, 3, 6])
def test_mixture_sampler_resumes_exactly_at_another_world_size(world_to):
    plan = MixturePlan(cfg({"weight": 0.5}, {"weight": 0.3}, {"weight": 0.2}, epoch_size=240), [100, 60, 500])
    sampler = MixtureSampler(plan)

    def cursor(rank, world, batch):
        return EpochCursor(lambda e, _g: sampler.epoch_order(e), len(sampler), rank=rank, world=world,
                           batch=batch, drop_last=False)
    full = sampler.epoch_order(1)
    seen = []
    first = [cursor(r, 4, 5) for r in range(4)]
    for c in first:
        c.set_epoch(1)
        order, _ = c.rank_order()
        seen.append(order[:3 * 5])  # three batches each
        for _ in range(3):
            c.advance()
    state = first[0].state_dict()
    for r in range(world_to):
        c = cursor(r, world_to, 4)
        c.load_state_dict(state, world=4, batch=5)
        seen.append(c.rank_order()[0])
    got = np.sort(np.concatenate(seen))
    assert np.array_equal(got, np.sort(full))
    assert np.bincount(sampler.sources(full), minlength=3).tolist() == [120, 72, 48]
