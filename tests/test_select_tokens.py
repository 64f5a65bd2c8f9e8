"""InfoBatch on a language model: packed rows have no stable index (the token loader re-packs
every epoch), so the table is keyed by document (``TokenLoader(doc_keys=True)``). Each document
gets the mean loss of its tokens trained, padding and ignored targets counting for nothing; a
row's stale score is the token-weighted mean of its documents'; rows holding an unseen document
are kept; the pruned rows' weights keep the loss unbiased in drop and mask mode alike; the table
survives a checkpoint; and a real GPT run prunes rows from its second epoch."""
from __future__ import annotations

import io
import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sluice.errors import SelectionError
from sluice.stages.contracts import TokenInputs
from sluice.stages.load.tokens import ArrayTokens, TokenLoader
from sluice.stages.select import SelectionConfig, build_selector
from sluice.stages.select.infobatch_tokens import InfoBatchRows, token_row_selector
from sluice.stages.train import train
from sluice.stages.train.tasks import IGNORE, TokenTask
from test_gpt import V, cfg, docs

P = -1  # a token that counts for nothing


def rows_selector(n: int = 6, seed: int = 0, **params: Any) -> InfoBatchRows:
    c = SelectionConfig(method="infobatch", seed=seed, params={"prune": 0.5, "sync_every": 1, **params})
    return token_row_selector(build_selector(c, split_size=n))


def inputs(keys: torch.Tensor) -> TokenInputs:
    return TokenInputs(torch.zeros_like(keys))


def known_table(sel: InfoBatchRows) -> None:
    """Documents 0-3 seen with losses 1, 1, 1, 5 over 2, 2, 2, 2 tokens (mean 2.0); 4 and 5
    never seen."""
    sel.observe(torch.tensor([[0, 0, 1, 1], [2, 2, 3, 3]]), torch.tensor([[1., 1, 1, 1], [1, 1, 5, 5]]))


def test_each_document_gets_the_mean_loss_of_its_tokens():
    sel = rows_selector(sync_every=2)
    keys = torch.tensor([[0, 0, 0, 1, 1, P], [1, 2, 2, 2, P, P]])
    loss = torch.tensor([[1.0, 2.0, 6.0, 4.0, 8.0, 99.0], [0.0, 3.0, 3.0, 6.0, 77.0, 55.0]])
    sel.observe(keys, loss)
    assert not sel.seen.any()                                         # pending until the gather
    sel.observe(torch.tensor([[4, 4]]), torch.tensor([[float("nan"), 2.0]]))  # NaN counts for nothing
    assert sel.seen.tolist() == [True, True, True, False, True, False]
    assert sel.loss[:3].tolist() == pytest.approx([3.0, 4.0, 4.0])    # (1+2+6)/3, (4+8+0)/3, (3+3+6)/3
    assert sel.loss[4] == 2.0 and sel.tokens.tolist() == [3, 3, 3, 0, 1, 0]
    # the threshold is the token-weighted mean over seen documents: (9 + 12 + 12 + 2) / 10
    assert sel._mean == pytest.approx(3.5)
    # the next gather replaces a document's loss with its newer tokens' mean
    sel.observe(torch.tensor([[1, 1]]), torch.tensor([[0.5, 1.5]]))
    sel.observe(torch.tensor([[P]]), torch.tensor([[1.0]]))
    assert sel.loss[1] == 1.0 and sel.tokens[1] == 2 and sel.loss[0] == 3.0


def test_the_task_hands_document_keys_and_per_token_losses_ignoring_what_is_ignored():
    """Through the token task: keys are -1 where the target is ignored (a crossed document
    boundary, padding), so the table holds each document's mean over its counted tokens."""
    d = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11]]
    ld = TokenLoader([ArrayTokens.from_documents(d, eot=0, vocab_size=V)], seq_len=8, batch_size=2, prefetch=0,
                     doc_keys=True, ignore_cross_document=True)
    ld.set_epoch(0)
    batch = next(iter(ld))
    task = TokenTask(cfg(), torch.device("cpu"))
    x, y, keys = task.prep(batch)
    assert keys.shape == y.shape and ((keys == -1) == ((y == IGNORE) | (batch.doc_keys == -1))).all()
    assert (y == IGNORE).any()                                       # a boundary was ignored
    assert any(len(set(r[r >= 0].tolist())) > 1 for r in keys)         # a row holds two documents
    out = torch.randn(*y.shape, V)
    per, observed = task.losses(out, y)
    assert torch.allclose(per, task.per_sample(out, y)) and observed.shape == y.shape
    sel = rows_selector(n=3)
    sel.observe(keys, observed)
    for doc in range(3):
        m = keys == doc
        want = F.cross_entropy(out[m], y[m]).item()                   # its counted tokens only
        assert sel.loss[doc].item() == pytest.approx(want, rel=1e-5)
        assert sel.tokens[doc] == int(m.sum())


def test_rows_with_an_unseen_document_or_no_document_are_kept():
    sel = rows_selector(anneal=1.0, prune=0.9, mode="drop")
    known_table(sel)
    assert sel._below == pytest.approx(6 / 8 * 4 / 6)                  # token share below x share seen
    keys = torch.tensor([[0, 0, 1, 1], [0, 0, 4, 4], [P, P, P, P], [5, 2, 2, 2], [1, 1, 2, 2]])
    for _ in range(50):
        b = sel(None, inputs(keys), torch.zeros_like(keys), keys)
        assert {1, 2, 3} <= {int(r) for r in _rows(b.indices, keys)}    # unseen, padding: always kept
        assert b.stats["n_candidates"] == 5 and b.stats["ib_eligible"] == 2


def _rows(kept: torch.Tensor, keys: torch.Tensor) -> list[int]:
    return [next(i for i in range(len(keys)) if torch.equal(k, keys[i])) for k in kept]


def test_a_rows_score_is_its_documents_token_weighted_mean():
    sel = rows_selector(anneal=1.0, mode="mask")
    known_table(sel)
    # by tokens, not by documents: 7 tokens of a loss-1 document and 1 of the loss-5 one score
    # 1.5, below the mean (2.0), though their documents' plain mean is 3; 6 and 2 score 2.0, not below
    keys = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 3], [0, 0, 0, 3, 3, 3, 3, 3], [0, 0, 0, 0, 0, 0, 3, 3],
                         [0, 1, 1, P, P, P, P, P]])
    assert sel._eligible(keys).tolist() == [True, False, False, True]


def test_the_threshold_is_the_tables_at_each_epochs_start():
    """As the paper prunes once per epoch: a gather within the epoch (lower losses, as the model
    learns) moves the table's mean but not the threshold, whose candidates are all one epoch stale."""
    sel = rows_selector(anneal=1.0)
    keys = torch.tensor([[0, 0, 1, 1], [3, 3, 3, 3]])
    sel.set_epoch(0)
    known_table(sel)                                                   # table mean 2.0; epoch 0's: none
    assert sel._mean == -math.inf and not sel._eligible(keys).any()
    sel.set_epoch(1)
    assert sel._mean == 2.0 and sel._eligible(keys).tolist() == [True, False]
    sel.observe(torch.tensor([[2, 2, 2, 2]]), torch.tensor([[0.0, 0.0, 0.0, 0.0]]))  # fresher, lower
    sel.set_epoch(1)
    assert sel._table[0] == pytest.approx(1.4) and sel._mean == 2.0   # the epoch keeps its threshold
    b = rows_selector(anneal=1.0)
    b.load_state_dict(sel.state_dict())                                # a resume mid-epoch keeps it too
    b.set_epoch(1)
    assert b._mean == 2.0 and b._below == sel._below
    sel.set_epoch(2)
    assert sel._mean == pytest.approx(1.4)


def test_pruned_rows_are_drawn_among_the_eligible_and_the_weighted_loss_is_unbiased():
    sel = rows_selector(anneal=1.0, mode="drop")
    known_table(sel)
    keys = torch.tensor([[0, 0, 1, 1], [1, 1, 2, 2], [2, 0, 1, 2], [3, 3, 3, 3],
                         [0, 1, 2, 4], [3, 3, 0, 0], [2, 2, 2, 2], [1, 0, 0, 1]])
    eligible = torch.tensor([1, 1, 1, 0, 0, 0, 1, 1], dtype=torch.bool)   # 5 rows; row 5 scores 3.0
    per = torch.tensor([0.3, 0.5, 0.7, 4.0, 2.0, 3.0, 0.2, 0.9], dtype=torch.float64)
    target = round(0.5 * sel._below * 8)
    n_drop = min(target, 5 - 1)
    assert n_drop == 2
    dropped, est = torch.zeros(8), []
    for _ in range(3000):
        b = sel(None, inputs(keys), keys.clone(), keys)
        kept = torch.tensor(sorted(_rows(b.indices, keys)))
        assert len(kept) == 8 - n_drop and (~eligible)[~torch.isin(torch.arange(8), kept)].sum() == 0
        base = torch.where(eligible[kept], 5 / (5 - n_drop), 1.0)
        assert torch.allclose(b.weights.double(), base.double() * len(kept) / 8)
        assert b.stats["ib_pruned"] == n_drop and b.stats["n_selected"] == 8 - n_drop
        dropped[~torch.isin(torch.arange(8), kept)] += 1
        est.append(float((per[kept] * b.weights.double()).mean()))
    assert np.mean(est) == pytest.approx(float(per.mean()), rel=0.01)   # unbiased for the whole batch
    assert dropped[~eligible].sum() == 0
    assert dropped[eligible].min() > 3000 * n_drop / 5 * 0.85          # uniform among the eligible


def test_drop_and_mask_modes_give_the_same_loss_for_the_same_dropped_rows():
    keys = torch.tensor([[0, 0, 1, 1], [1, 1, 2, 2], [2, 0, 1, 2], [3, 3, 3, 3],
                         [0, 1, 2, 4], [3, 3, 0, 0], [2, 2, 2, 2], [1, 0, 0, 1]])
    sel = rows_selector(anneal=1.0, mode="mask")
    known_table(sel)
    b = sel(None, inputs(keys), keys.clone(), keys)
    w = b.weights
    assert len(b.inputs) == 8 and b.indices is keys                    # the batch keeps its size
    dropped = w == 0
    assert int(dropped.sum()) == 2 and b.stats["ib_pruned"] == 2 and b.stats["n_selected"] == 6
    per = torch.rand(8, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3
    drop = rows_selector(anneal=1.0, mode="drop")
    known_table(drop)
    pos = (~dropped).nonzero().squeeze(1)                              # drop mode's kept rows, same set
    eligible = drop._eligible(keys)
    base = torch.where(eligible, 5 / 3, 1.0).double()[pos] * (len(pos) / 8)
    assert float((per * w.double()).mean()) == pytest.approx(float((per[pos] * base).mean()), abs=1e-9)
    # only the kept rows' tokens reach the table, as drop mode never trains the dropped ones
    sel.observe(b.indices, torch.full(keys.shape, 9.0))
    for doc in range(5):
        n_kept = int((keys[~dropped] == doc).sum())
        assert sel.tokens[doc] == (n_kept or 2) and sel.loss[doc] == (9.0 if n_kept else [1, 1, 1, 5][doc])


def test_the_table_and_pending_sums_round_trip_through_a_checkpoint():
    a = rows_selector(sync_every=3, mode="mask", anneal=1.0, seed=2)
    known_table(a)
    a.flush()
    keys = torch.tensor([[0, 0, 1, 1], [1, 1, 2, 2], [2, 0, 1, 2], [3, 3, 5, 5]])
    a(None, inputs(keys), keys, keys)                                  # a mask draw: its generator moves
    a.observe(torch.tensor([[5, 5, 0]]), torch.tensor([[2.0, 4.0, 7.0]]))  # pending, not gathered
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = rows_selector(sync_every=3, mode="mask", anneal=1.0, seed=2)
    b.load_state_dict(torch.load(buf, weights_only=True))
    for t in ("loss", "seen", "tokens"):
        assert torch.equal(getattr(a, t), getattr(b, t))
    assert torch.equal(a(None, inputs(keys), keys, keys).weights, b(None, inputs(keys), keys, keys).weights)
    for s in (a, b):
        for _ in range(2):                                             # the third observe gathers
            s.observe(torch.tensor([[P]]), torch.tensor([[0.0]]))
    assert b.seen[5] and b.loss[5] == 3.0 and b.loss[0] == 7.0 and torch.equal(a.loss, b.loss)
    assert a._mean == b._mean and a._below == b._below
    image = build_selector(SelectionConfig(method="infobatch"), split_size=6)
    with pytest.raises(SelectionError, match="keys samples, not documents"):
        b.load_state_dict(image.state_dict())
    with pytest.raises(SelectionError, match="for 6 documents"):
        rows_selector(n=7).load_state_dict(a.state_dict())


@pytest.mark.parametrize("method", ["uniform", "loss", "selective_backprop", "rho_loss"])
def test_methods_that_cannot_select_rows_say_so(method):
    c = SelectionConfig(method=method, n_select=2)
    sel = build_selector(c, np.zeros(6, np.float32) if c.needs_il else None, split_size=6)
    with pytest.raises(SelectionError, match=f"'{method}' cannot select packed token rows"):
        TokenTask(cfg(), torch.device("cpu")).selector_for(sel)


def test_a_token_run_refuses_a_loader_without_document_keys_or_a_table_short_of_its_documents():
    tr, _ = _loaders(doc_keys=False)
    with pytest.raises(SelectionError, match="doc_keys=True"):
        train(cfg(max_steps=2), tr, None, _infobatch(tr.n_doc_keys))
    tr, _ = _loaders()
    with pytest.raises(SelectionError, match="outside"):  # a table short of the loader's documents
        train(cfg(max_steps=3), tr, None, _infobatch(tr.n_doc_keys // 4))
    with pytest.raises(SelectionError, match="'uniform' cannot select packed token rows"):
        train(cfg(max_steps=2), tr, None, build_selector(SelectionConfig(method="uniform", n_select=2)))


def _loaders(doc_keys: bool = True) -> tuple[TokenLoader, TokenLoader]:
    d = docs(120)
    tr = TokenLoader([ArrayTokens.from_documents(d[30:], eot=0, vocab_size=V)], seq_len=32, batch_size=4,
                     seed=1, prefetch=0, doc_keys=doc_keys)
    ev = TokenLoader([ArrayTokens.from_documents(d[:30], eot=0, vocab_size=V)], seq_len=32, batch_size=8,
                     seed=1, prefetch=0)
    return tr, ev


def _infobatch(n: int, **params: Any):
    return build_selector(SelectionConfig(method="infobatch", params={"sync_every": 2, **params}), split_size=n)


def test_a_gpt_run_with_infobatch_prunes_rows_from_its_second_epoch(tmp_path):
    """Three epochs of a tiny GPT: the first trains every row (no document seen yet), the second
    prunes (the metrics say so), every document ends in the table; halted and resumed, the run
    ends as the uninterrupted one did (the table travels in the checkpoint)."""
    tr, ev = _loaders()
    n_batches = len(tr)
    sel = token_row_selector(_infobatch(tr.n_doc_keys))
    c = cfg(max_steps=3 * n_batches, eval_every_steps=None, checkpoint_dir=str(tmp_path / "a"))
    r = train(c, tr, ev, sel)
    first = [m for m in r.metrics if m["epoch"] == 0]
    later = [m for m in r.metrics if m["epoch"] >= 1 and m["step"] <= 0.875 * c.max_steps]
    assert first and all(m["select/ib_pruned"] == 0 and m["select/n_selected"] == 4 for m in first[:-1])
    assert sum(m["select/ib_pruned"] for m in later) >= 4
    # the threshold is the table's at each epoch's start: none in the first, one value per epoch after
    assert {m["select/ib_mean_loss"] for m in first} == {0.0}
    assert len({m["select/ib_mean_loss"] for m in r.metrics if m["epoch"] == 1}) == 1
    assert any(m["select/n_selected"] < m["select/n_candidates"] == 4 for m in later)
    assert r.summary["selection_trained_fraction"] < 0.99
    assert sel.seen.all() and torch.isfinite(sel.loss).all() and (sel.tokens > 0).all()
    assert np.isfinite(r.evals[-1]["loss"])
    halt = 2 * n_batches - 3
    train(c.model_copy(update={"checkpoint_dir": str(tmp_path / "b"), "halt_at_step": halt}), *_loaders(),
          _infobatch(tr.n_doc_keys))
    rest = train(c.model_copy(update={"checkpoint_dir": str(tmp_path / "b")}), *_loaders(), _infobatch(tr.n_doc_keys))
    assert rest.resumed_from == halt
    assert rest.summary["param_digests"] == r.summary["param_digests"]


def test_a_token_job_selects_by_document_through_the_rank_entry(tmp_path):
    """A job assembled once (the kind's data specs, the selection spec) and launched: the table is
    sized by the train documents, and the token loader yields ``doc_keys`` because a method selects."""
    from sluice.stages.data.text import TextShardConfig, shard_text
    from sluice.stages.kinds.tokens import TokenData, TokenKind
    from sluice.stages.run.assemble import assemble_job
    from sluice.stages.run.launch import launch
    from sluice.stages.run.warm import Start
    src = tmp_path / "text"
    src.mkdir()
    rng = np.random.default_rng(0)
    for i in range(40):
        (src / f"doc{i:03d}.txt").write_text(" ".join(rng.choice(["ab", "cd", "ef", "gh"], int(rng.integers(3, 12)))))
    root = shard_text(TextShardConfig(tokenizer="byte", val_fraction=0.2, progress=False), src, tmp_path / "art").root
    kind = TokenKind()
    version = kind.version_of([root], names=["notes"])
    data = TokenData(sources=[{"name": "notes", "source": str(src)}], seq_len=32, prefetch=0)
    method = SelectionConfig(method="infobatch", params={"sync_every": 1})
    job = assemble_job(kind, cfg(max_steps=4, eval_every_steps=None), data, method, "val", version, None,
                       Start(why="scratch"))
    assert job.selection.split_size == version.counts["train"] and job.selection.candidate_size == 4
    assert job.config.num_classes == version.vocab_size and job.data.loader.doc_keys
    r = launch(job, nproc=1, out_dir=tmp_path / "run", on_line=lambda s: None)
    assert r.steps == 4 and all(m["select/n_candidates"] == 4 for m in r.metrics)
    plain = assemble_job(kind, cfg(max_steps=4), data, SelectionConfig(), "val", version, None, Start(why="scratch"))
    assert plain.selection is None and not plain.data.loader.doc_keys
    assert "'loss' cannot select packed token rows" in kind.selection_refusal("loss", data)
