"""The token loader (``stages/load/tokens.py``): packing reproduces the epoch's stream, document
boundaries are right, the curriculum follows its schedule, and — the contract — a three-source
weighted mixture stopped mid-epoch at 4 ranks resumes at 1, 2, 3 and 6 ranks with no token
repeated or skipped, across the curriculum's length changes and changed weights."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from sluice.errors import LoaderError
from sluice.stages.contracts import ResumableLoader
from sluice.stages.load.mixture import MixtureConfig
from sluice.stages.load import token_rows
from sluice.stages.load.tokens import ArrayTokens, SeqLenSchedule, TokenLoader, cu_seqlens, pack_rows, source_losses

EOT = 0


def make_source(n_docs: int, base: int, seed: int, max_len: int = 40) -> ArrayTokens:
    """Documents of random lengths (some empty) whose tokens say which source they came from."""
    rng = np.random.default_rng(seed)
    docs = [base + rng.integers(1, 99, int(rng.integers(0, max_len))) for _ in range(n_docs)]
    return ArrayTokens.from_documents(docs, eot=EOT, vocab_size=1000)


SOURCES = [make_source(60, 100, 1), make_source(35, 300, 2), make_source(80, 500, 3, max_len=12)]


def mixture(w=(0.5, 0.3, 0.2), epoch_size=150, seed=7) -> MixtureConfig:
    return MixtureConfig(sources=[{"name": n, "weight": x} for n, x in zip("abc", w)],
                         epoch_size=epoch_size, seed=seed)


def loader(rank=0, world=1, sources=SOURCES, **kw) -> TokenLoader:
    kw = {"seq_len": 16, "batch_size": 2, "mixture": mixture(), "seed": 7, "prefetch": 0, **kw}
    return TokenLoader(sources, rank=rank, world_size=world, **kw)


def reference(ld: TokenLoader, epoch: int | None = None):
    """The epoch's packed stream, token by token, in plain Python: each document then EOT."""
    st = ld.stream(epoch)
    toks, seg, src = [], [], []
    for k, (s, d) in enumerate(zip(st.src, st.doc)):
        t = ld.tokens[s][ld.offsets[s][d]:ld.offsets[s][d + 1]]
        toks += [*t.tolist(), ld.eot]
        seg += [k] * (len(t) + 1)
        src += [int(s)] * (len(t) + 1)
    return np.array(toks), np.array(seg), np.array(src)


def consume_batches(batches, seen: np.ndarray, ref: np.ndarray) -> None:
    """Check batches already taken as ``consume`` does."""
    for b in batches:
        check_batch(b, seen, ref)


def check_batch(b, seen: np.ndarray, ref: np.ndarray) -> None:
    x, y, ids = (t.numpy() for t in b)
    for r, s0 in enumerate(ids):
        n = int((b.inputs["segment_ids"][r] >= 0).sum())
        if s0 < 0:
            assert n == 0 and (y[r] == -100).all()
            continue
        assert n > 0, "a row named by a start holds no input"
        assert (x[r, :n] == ref[s0:s0 + n]).all() and (y[r, :n] == ref[s0 + 1:s0 + 1 + n]).all()
        assert (y[r, n:] == -100).all()
        seen[s0:s0 + n] += 1


def consume(ld: TokenLoader, steps: int | None, seen: np.ndarray, ref: np.ndarray) -> int:
    """Iterate up to ``steps`` batches, checking each row against the stream and counting each
    input position it covers; returns the batches taken."""
    taken = 0
    it = iter(ld)
    for b in it:
        check_batch(b, seen, ref)
        taken += 1
        if steps is not None and taken == steps:
            it.close()
            break
    return taken


# ------------------------------------------------------------------ packing
def test_it_is_a_resumable_loader_and_unpacks_as_inputs_targets_ids():
    ld = loader()
    assert isinstance(ld, ResumableLoader)
    b = next(iter(ld))
    x, y, ids = b
    assert x.dtype == y.dtype == ids.dtype == torch.int64 and x.shape == y.shape == (2, 16)
    assert b.inputs["segment_ids"].dtype == torch.int32 and b.sources.dtype == torch.int16


@pytest.mark.parametrize("sources,mix", [(SOURCES[:1], None), (SOURCES, "weights")])
def test_packing_reproduces_the_stream_every_input_once(sources, mix):
    kw = {"mixture": mixture()} if mix else {"mixture": None}
    ld = loader(sources=sources, **kw)
    ref, _, _ = reference(ld)
    seen = np.zeros(len(ref), int)
    n = consume(ld, None, seen, ref)
    assert n == len(ld) > 1
    assert (seen[:-1] == 1).all() and seen[-1] == 0  # the last token is only a target


def test_without_a_mixture_every_document_comes_once_per_epoch():
    ld = loader(sources=SOURCES[:2], mixture=None)
    st = ld.stream()
    assert sorted(zip(st.src.tolist(), st.doc.tolist())) == [(0, i) for i in range(60)] + [(1, i) for i in range(35)]


def test_document_boundaries_positions_and_sources():
    ld = loader(seq_len=24, batch_size=5)
    ref, ref_seg, ref_src = reference(ld)
    starts = np.array([0, 7, 24 * 9 + 3, len(ref) - 10, -1])
    a = ld.rows(starts, 24)
    for r, s0 in enumerate(starts):
        if s0 < 0:
            assert (a["segment_ids"][r] == -1).all() and (a["sources"][r] == -1).all()
            continue
        n = min(24, len(ref) - 1 - s0)
        seg = ref_seg[s0:s0 + n]
        assert (a["segment_ids"][r, :n] == seg - seg[0]).all()  # 0, 1, ... within the row
        assert (a["sources"][r, :n] == ref_src[s0:s0 + n]).all()
        # position within the document's part of the row: restarts at each document
        starts_here = np.r_[True, seg[1:] != seg[:-1]]
        expect = np.arange(n) - np.maximum.accumulate(np.where(starts_here, np.arange(n), 0))
        assert (a["position_ids"][r, :n] == expect).all()
        # each document's last slot is the EOT
        last = np.r_[seg[1:] != seg[:-1], False]
        assert (a["input_ids"][r, :n][last] == EOT).all()


def test_doc_keys_name_each_tokens_document_over_all_sources():
    ld = loader(seq_len=24, batch_size=5, doc_keys=True)
    st = ld.stream()
    key = ld.doc_key_base[st.src] + st.doc  # each stream document's key
    ref_key = np.repeat(key, st.lens)
    assert ld.n_doc_keys == sum(len(s.offsets) - 1 for s in SOURCES)
    starts = np.array([0, 7, 24 * 9 + 3, len(ref_key) - 10, -1])
    a = ld.rows(starts, 24)
    for r, s0 in enumerate(starts):
        if s0 < 0:
            assert (a["doc_keys"][r] == -1).all()
            continue
        n = min(24, len(ref_key) - 1 - s0)
        assert (a["doc_keys"][r, :n] == ref_key[s0:s0 + n]).all()
        assert (a["doc_keys"][r, n:] == -1).all()
    batch = next(iter(ld))
    assert batch.doc_keys.shape == batch.inputs["input_ids"].shape and batch.doc_keys.dtype == torch.int64
    assert next(iter(loader())).doc_keys is None  # only on request


def test_cross_document_targets_can_be_ignored():
    ld = loader(seq_len=32, batch_size=4, ignore_cross_document=True)
    b = next(iter(ld))
    ref, ref_seg, _ = reference(ld)
    crossings = 0
    for r, s0 in enumerate(b.indices.tolist()):
        seg = ref_seg[s0:s0 + 33]
        cross = seg[1:] != seg[:-1]
        crossings += cross.sum()
        assert (b.targets[r].numpy()[cross] == -100).all()
        assert (b.targets[r].numpy()[~cross] == ref[s0 + 1:s0 + 33][~cross]).all()
    assert crossings > 0


# ------------------------------------------------------------------ pack_rows against a plain reference
def plain_rows(ld: TokenLoader, starts, L: int, ignore_cross: bool) -> dict[str, np.ndarray]:
    """What pack_rows returns, token by token in plain Python from the stream: a row at s holds
    inputs stream[s:s+L] and targets stream[s+1:s+L+1] (end-of-text / -100 past the epoch);
    the per-token fields cover the inputs but the epoch's last token (only a target)."""
    st = ld.stream()
    toks, doc = reference(ld)[0].tolist(), np.repeat(np.arange(len(st.src)), st.lens).tolist()
    src, key = np.repeat(st.src, st.lens).tolist(), np.repeat(ld.doc_key_base[st.src] + st.doc, st.lens).tolist()
    T, m = len(toks), len(starts)
    out = {"input_ids": np.full((m, L), EOT), "targets": np.full((m, L), -100),
           "segment_ids": np.full((m, L), -1), "position_ids": np.zeros((m, L)), "sources": np.full((m, L), -1),
           "doc_keys": np.full((m, L), -1), "sample_ids": np.array([max(s, -1) for s in starts]),
           "source_tokens": np.zeros(len(ld.tokens))}
    for r, s in enumerate(starts):
        if s < 0:
            continue
        n = min(s + L + 1, T) - s  # stream tokens in the row's L + 1 slots
        for j in range(min(n, L)):
            out["input_ids"][r, j] = toks[s + j]
            if j + 1 < n:
                cross = ignore_cross and doc[s + j + 1] != doc[s + j]
                out["targets"][r, j] = -100 if cross else toks[s + j + 1]
        run = 0
        for j in range(min(n - 1, L)):
            run = j if j == 0 or doc[s + j] != doc[s + j - 1] else run
            out["segment_ids"][r, j] = doc[s + j] - doc[s]
            out["position_ids"][r, j] = j - run
            out["sources"][r, j], out["doc_keys"][r, j] = src[s + j], key[s + j]
            out["source_tokens"][src[s + j]] += 1
    return out


DTYPES = {"input_ids": np.int64, "targets": np.int64, "segment_ids": np.int32, "position_ids": np.int64,
          "sources": np.int16, "doc_keys": np.int64, "sample_ids": np.int64, "source_tokens": np.int64}


def random_loader(rng) -> TokenLoader:
    """1-3 sources of documents from empty to longer than a row, uint16 or uint32, sometimes a
    source whose documents are all empty (no tokens at all)."""
    srcs = []
    for k in range(int(rng.integers(1, 4))):
        top = int(rng.choice([3, 30, 400]))
        lens = rng.integers(0, top + 1, int(rng.integers(1, 25))) * (rng.random() > 0.1)
        docs = [rng.integers(1, 999, n) for n in lens]
        srcs.append(ArrayTokens.from_documents(docs, EOT, 1000, dtype=rng.choice([np.uint16, np.uint32])))
    return TokenLoader(srcs, seq_len=8, mixture=None, seed=int(rng.integers(0, 99)), prefetch=0)


def random_starts(rng, T: int, L: int) -> list[np.ndarray]:
    """Consecutive rows (as on one rank), strided (several ranks), anywhere, and the epoch's
    tail: its last short row and padding rows."""
    m = int(rng.integers(1, 7))
    last = max(T - 1, 1)
    out = [int(rng.integers(0, last)) + np.arange(m) * L * w for w in (1, 1, int(rng.integers(2, 4)))]
    out.append(rng.integers(-1, last, m))
    out.append(np.array([last - 1 - int(rng.integers(0, 2 * L)) - j * L for j in range(m)]))
    return [np.where((s >= last) | (s < 0), -1, s).astype(np.int64) for s in out]


@pytest.mark.parametrize("path", ["index", "slices", "indexed_minor"])
def test_pack_rows_matches_a_plain_reference(path, monkeypatch):
    """Every field of every case, bit for bit (dtype, shape, values), on each gather path."""
    if path == "slices":
        monkeypatch.setattr(token_rows, "SLICE_PIECES", 1)
    if path == "indexed_minor":
        monkeypatch.setattr(token_rows, "SLICE_FEW", 0)
    rng = np.random.default_rng(["index", "slices", "indexed_minor"].index(path))
    checked = 0
    for _ in range(25):
        ld = random_loader(rng)
        st = ld.stream()
        for L in rng.choice([1, 5, 16, 64], 2, replace=False).tolist():
            for starts in random_starts(rng, st.total, L):
                for cross in (False, True):
                    want = plain_rows(ld, starts.tolist(), L, cross)
                    for fields in (token_rows.ROW_FIELDS, (), ("position_ids",)):
                        for base in (None, ld.doc_key_base):
                            got = pack_rows(st, starts, L, ld.tokens, EOT, cross, -100, base, fields)
                            keys = {"input_ids", "targets", "sample_ids", "source_tokens", *fields}
                            assert set(got) == keys | ({"doc_keys"} if base is not None else set())
                            for k, v in got.items():
                                assert v.dtype == DTYPES[k] and v.shape == want[k].shape, k
                                assert np.array_equal(v, want[k]), (k, starts, L, cross, fields)
                            checked += 1
    assert checked > 1000


def test_batches_carry_the_fields_asked_for():
    """``fields`` lists the per-token fields a batch carries (default: all three); none gives
    nanoGPT's batch, whose inputs and targets may be one buffer seen one token apart."""
    full = next(iter(loader(seq_len=24, batch_size=3)))
    lean = next(iter(loader(seq_len=24, batch_size=3, fields=[])))
    assert "segment_ids" in full.inputs and "position_ids" in full.inputs and full.sources is not None
    assert set(lean.inputs) == {"input_ids"} and lean.sources is None
    assert torch.equal(full.inputs["input_ids"], lean.inputs["input_ids"]) and torch.equal(full.targets, lean.targets)
    assert torch.equal(lean.targets[:, :-1], lean.inputs["input_ids"][:, 1:])
    assert torch.equal(full.source_counts, lean.source_counts)
    with pytest.raises(LoaderError, match="segment_ids"):
        cu_seqlens(lean)
    only = next(iter(loader(fields=["sources"])))
    assert only.sources is not None and "segment_ids" not in only.inputs
    with pytest.raises(ValueError, match="twice"):
        loader(fields=["sources", "sources"])
    with pytest.raises(ValueError):
        loader(fields=["tokens"])


def test_cu_seqlens_follow_the_segments():
    b = next(iter(loader(seq_len=32, batch_size=3)))
    cu = cu_seqlens(b).tolist()
    assert cu[0] == 0 and cu[-1] == 3 * 32 and cu == sorted(set(cu))
    flat = b.inputs["segment_ids"].reshape(-1).tolist()
    for a, z in zip(cu, cu[1:]):
        assert len(set(flat[a:z])) == 1 and (a % 32 == 0 or flat[a - 1] != flat[a])


def test_per_source_token_counts_and_losses():
    ld = loader()
    ref, _, ref_src = reference(ld)
    for _ in ld:
        pass
    assert ld.served.tolist() == np.bincount(ref_src[:-1], minlength=3).tolist()
    b = next(iter(loader()))
    loss = torch.arange(b.inputs["input_ids"].numel(), dtype=torch.float32).reshape(b.inputs["input_ids"].shape)
    sums, counts = source_losses(loss, b.sources, 3)
    for k in range(3):
        m = b.sources == k
        assert counts[k] == m.sum() and sums[k] == loss[m].sum()


def test_the_order_is_deterministic_per_seed_and_epoch():
    a, b = loader(), loader()
    assert all(torch.equal(x.inputs["input_ids"], y.inputs["input_ids"]) for x, y in zip(a, b))
    e0 = reference(loader())[0]
    ld = loader()
    ld.set_epoch(1)
    assert not np.array_equal(reference(ld)[0][:200], e0[:200])
    assert not np.array_equal(reference(loader(mixture=mixture(seed=8), seed=8))[0][:200], e0[:200])


def test_ranks_take_strided_rows_of_each_global_step():
    steps = [list(loader(r, 3, seq_len=16, batch_size=2, row_order="consecutive")) for r in range(3)]
    for r in range(3):
        for k, b in enumerate(steps[r][:-1]):
            assert b.indices.tolist() == [k * 96 + (r + 3 * j) * 16 for j in range(2)]


def test_lanes_give_a_step_one_row_from_each_lane_and_cover_the_epoch_once():
    lds = [loader(r, 3, seq_len=16, batch_size=2) for r in range(3)]
    ref = reference(lds[0])[0]
    end = len(ref) - 1
    span = -(-end // 6)  # six lanes: the global batch's rows
    seen = np.zeros(len(ref), int)
    steps = [list(ld) for ld in lds]
    assert len({len(x) for x in steps}) == 1 == len({len(ld) for ld in lds}) and len(steps[0]) == -(-span // 16)
    for r in range(3):
        for k, b in enumerate(steps[r]):
            lanes = [r, r + 3]
            want = [j * span + k * 16 if k * 16 < min(span, end - j * span) else -1 for j in lanes]
            assert b.indices.tolist() == want
        consume_batches(steps[r], seen, ref)
    assert (seen[:-1] == 1).all() and seen[-1] == 0  # every input once; the last token only a target
    assert all(ld.position == end for ld in lds)


# ------------------------------------------------------------------ curriculum
def test_curriculum_lengths_follow_the_schedule():
    sch = SeqLenSchedule(start=8, end=32, warmup_tokens=600, step=8)
    ld = loader(seq_len_schedule=sch, batch_size=2)
    lens, trained = [], 0
    for b in ld:
        assert b.input.shape[1] == sch.at(0, trained) and b.inputs["input_ids"].shape[1] == b.input.shape[1]
        lens.append(b.input.shape[1])
        trained += 2 * b.input.shape[1]
    assert lens[0] == 8 and lens[-1] == 32 and lens == sorted(lens) and all(L % 8 == 0 for L in lens)
    assert {8, 16, 24, 32} <= set(lens)
    steps = SeqLenSchedule(start=64, end=1024, warmup_steps=100, step=8)
    assert [steps.at(s, 0) for s in (0, 50, 99, 100, 10_000)] == [64, 544, 1008, 1024, 1024]
    assert SeqLenSchedule(start=64, end=1024, warmup_steps=100, kind="root").at(25, 0) == 544


def test_a_step_curriculum_continues_its_schedule_after_a_resume():
    sch = SeqLenSchedule(start=8, end=32, warmup_steps=12, step=8)
    whole = [b.input.shape[1] for b in loader(seq_len_schedule=sch)]
    first = loader(seq_len_schedule=sch)
    it = iter(first)
    head = [next(it).input.shape[1] for _ in range(5)]
    it.close()
    again = loader(seq_len_schedule=sch)
    again.load_state_dict(first.state_dict())
    assert head + [b.input.shape[1] for b in again] == whole


def test_curriculum_reaches_all_tokens_too():
    ld = loader(seq_len_schedule=SeqLenSchedule(start=8, end=40, warmup_steps=10, step=8))
    ref, _, _ = reference(ld)
    seen = np.zeros(len(ref), int)
    assert consume(ld, None, seen, ref) == len(ld)
    assert (seen[:-1] == 1).all()


# ------------------------------------------------------------------ the resume contract
def run_ranks(make, world: int, steps: int | None, seen: np.ndarray, ref: np.ndarray, state=None) -> list:
    """Every rank of a world, each from ``state``; returns their loaders."""
    lds = [make(r, world) for r in range(world)]
    counts = set()
    for ld in lds:
        if state is not None:
            ld.load_state_dict(state)
        counts.add(len(ld))
        consume(ld, steps, seen, ref)
    assert len(counts) == 1  # every rank takes the same number of steps
    return lds


CURRICULUM = SeqLenSchedule(start=8, end=32, warmup_tokens=1500, step=8)


@pytest.mark.parametrize("world_to", [1, 2, 3, 6])
@pytest.mark.parametrize("curriculum", [None, CURRICULUM], ids=["fixed", "curriculum"])
@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("order", ["lanes", "consecutive"])
def test_a_three_source_mixture_resumes_from_4_ranks_at_any_world_size(world_to, curriculum, prefetch, order):
    def make(rank, world, batch=2):
        return loader(rank, world, seq_len_schedule=curriculum, batch_size=batch, prefetch=prefetch,
                      row_order=order)
    probe = make(0, 1)
    ref, _, ref_src = reference(probe)
    full = np.zeros(len(ref), int)
    run_ranks(make, 4, None, full, ref)  # the uninterrupted run at 4 ranks
    assert (full[:-1] == 1).all()

    seen = np.zeros(len(ref), int)
    four = run_ranks(make, 4, 3, seen, ref)  # stopped after three steps
    state = four[0].state_dict()
    assert state["position"] == 3 * 4 * 2 * 16 if curriculum is None else 0 < state["position"]
    per_rank = ("rank", "served")
    assert all({k: v for k, v in ld.state_dict().items() if k not in per_rank} ==
               {k: v for k, v in state.items() if k not in per_rank} for ld in four)  # global
    lens_before = {ld.seq_len_at(ld.step, ld.position) for ld in four}
    resumed = run_ranks(lambda r, w: make(r, w, batch=3), world_to, None, seen, ref, state)
    assert (seen == full).all(), "a token repeated or skipped"
    assert all(ld.position == ld.stream().end for ld in resumed)
    if curriculum is not None:  # the length changed across the resume
        assert lens_before == {8} and resumed[0].seq_len_at(resumed[0].step, resumed[0].position) == 32
    # the epoch's documents per source are the exact counts
    assert np.bincount(probe.stream().src).tolist() == [75, 45, 30]


def test_resume_twice_and_then_the_next_epoch():
    ref, _, _ = reference(loader())
    seen = np.zeros(len(ref), int)
    a = run_ranks(lambda r, w: loader(r, w), 4, 2, seen, ref)
    b = run_ranks(lambda r, w: loader(r, w), 3, 2, seen, ref, a[0].state_dict())
    c = run_ranks(lambda r, w: loader(r, w), 6, None, seen, ref, b[2].state_dict())
    assert (seen[:-1] == 1).all()
    ld = c[0]
    ld.set_epoch(1)
    assert ld.position == 0 and ld.cursor.tokens_before == len(ref) - 1
    nxt = reference(ld)[0]
    seen1 = np.zeros(len(nxt), int)
    consume(ld, None, seen1, nxt)
    # a state saved at an epoch's end resumes into the next epoch
    done = loader()
    for _ in done:
        pass
    again = loader(world=1)
    again.load_state_dict(done.state_dict())
    assert len(list(again)) > 0 and again.epoch == 1


def test_new_weights_finish_the_epoch_in_progress_then_take_over_and_are_recorded():
    ref, _, _ = reference(loader())
    seen = np.zeros(len(ref), int)
    state = run_ranks(lambda r, w: loader(r, w), 2, 2, seen, ref)[0].state_dict()
    ranks = run_ranks(lambda r, w: loader(r, w, mixture=mixture(w=(0.2, 0.2, 0.6))), 3, None, seen, ref, state)
    assert (seen[:-1] == 1).all()  # the old epoch, finished over its own stream
    new = ranks[0]
    assert np.bincount(new.stream().src).tolist() == [75, 45, 30]  # the old counts, to the end
    new.set_epoch(new.epoch + 1)
    assert np.bincount(new.stream().src).tolist() == [30, 30, 90]
    (ch,) = new.mixture_changes
    assert ch["epoch"] == 1 and ch["old"]["c"]["count"] == 30 and ch["new"]["c"]["count"] == 90
    assert new.state_dict()["mixture"]["changes"] == [ch]  # carried to the next run


def test_states_that_cannot_continue_are_refused():
    ld = loader()
    next(iter(ld))
    state = ld.state_dict()
    with pytest.raises(LoaderError, match="seed"):
        loader(seed=8, mixture=mixture(seed=8)).load_state_dict(state)
    other = [SOURCES[0], SOURCES[1], make_source(81, 500, 3)]
    with pytest.raises(LoaderError, match="began"):
        loader(sources=other).load_state_dict(state)
    with pytest.raises(LoaderError, match="not a token loader"):
        loader().load_state_dict({"epoch": 0})
    with pytest.raises(LoaderError, match="row_order 'lanes'"):
        loader(row_order="consecutive").load_state_dict(state)
    bad = ArrayTokens(SOURCES[1].tokens, SOURCES[1].offsets, eot=1, vocab_size=1000)
    with pytest.raises(LoaderError, match="end-of-text"):
        loader(sources=[SOURCES[0], bad, SOURCES[2]])


# ------------------------------------------------------------------ a real token artifact
def test_a_mixture_of_token_artifacts_on_disk(tmp_path):
    """Three token artifacts written by the text shard stage, opened through their paths (the
    memory-mapped ``storage.tokens`` reader), packed: every row is the stream of their documents."""
    pytest.importorskip("sluice.storage.tokens")
    text = pytest.importorskip("sluice.stages.data.text.shard")
    from sluice.stages.data.text.config import TextShardConfig
    import json
    paths = []
    for k, name in enumerate(("web", "code", "books")):
        src = tmp_path / f"{name}.jsonl"
        src.write_text("".join(json.dumps({"id": f"{name}{i}", "text": f"{name} document {i} " * (1 + i % 7)}) + "\n"
                               for i in range(20 + 10 * k)))
        cfg = TextShardConfig(tokenizer="byte", dedup=False, val_fraction=0.0, progress=False)
        text.shard_text(cfg, src, tmp_path / name)
        paths.append(str(tmp_path / name))
    mix = MixtureConfig(sources=[{"path": p, "weight": w} for p, w in zip(paths, (0.5, 0.3, 0.2))], seed=7)
    ld = TokenLoader(None, seq_len=32, batch_size=2, mixture=mix, seed=7, prefetch=0)
    assert ld.names == ["web", "code", "books"] and isinstance(ld.tokens[0], np.ndarray)
    ref, _, _ = reference(ld)
    seen = np.zeros(len(ref), int)
    consume(ld, None, seen, ref)
    assert (seen[:-1] == 1).all()
    assert np.bincount(ld.stream().src).tolist() == [45, 27, 18]  # of 90 documents
