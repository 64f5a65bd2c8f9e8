"""A language model trained by the same trainer as the image models: the ``gpt`` model keeps
attention within a document, the token task's loss counts only real targets, and a GPT job runs
through the same rank entry (checkpoint, exact resume, the typed job) on a token artifact."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from sluice.stages.contracts import TokenInputs
from sluice.stages.load.tokens import ArrayTokens, TokenLoader
from sluice.stages.models import build_model
from sluice.stages.train import TrainConfig, train
from sluice.stages.train.tasks import IGNORE, TokenTask, build_task

V = 48


def docs(n: int = 240, seed: int = 0) -> list[list[int]]:
    """Learnable documents: arithmetic progressions over ids 1..V-1 (0 is the end-of-text)."""
    rng = np.random.default_rng(seed)
    return [[int((s + k * d) % (V - 1) + 1) for k in range(int(rng.integers(6, 40)))]
            for s, d in zip(rng.integers(0, V - 1, n), rng.integers(1, 4, n))]


def cfg(**kw) -> TrainConfig:
    base = dict(model="gpt", num_classes=V, model_kwargs={"n_layer": 2, "n_head": 2, "d_model": 32, "max_len": 32},
                optimizer="adamw", lr=3e-3, max_steps=16, batch_size=4, progress=False, torch_threads=1,
                log_every_steps=1, eval_every_steps=8)
    return TrainConfig(**{**base, **kw})


def loaders(seed: int = 1) -> tuple[TokenLoader, TokenLoader]:
    d = docs()
    tr = TokenLoader([ArrayTokens.from_documents(d[40:], eot=0, vocab_size=V)], seq_len=32, batch_size=4,
                     seed=seed, prefetch=0)
    ev = TokenLoader([ArrayTokens.from_documents(d[:40], eot=0, vocab_size=V)], seq_len=32, batch_size=8,
                     seed=seed, prefetch=0)
    return tr, ev


def test_a_packed_document_sees_only_itself():
    """Logits of a document packed after another equal its logits alone (positions restart, and
    attention never crosses the boundary); without segments they differ."""
    torch.manual_seed(0)
    model = build_model("gpt", 1, V, n_layer=2, n_head=2, d_model=32, max_len=32).eval()
    a, b = torch.tensor([[5, 6, 7, 8, 0]]), torch.tensor([[9, 10, 11]])
    row = torch.cat([a, b], 1)
    seg = torch.tensor([[0] * 5 + [1] * 3])
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]])
    with torch.no_grad():
        packed = model(TokenInputs(row, seg, pos))
        alone = model(b)
        naive = model(row)
    assert torch.allclose(packed[:, 5:], alone, atol=1e-5)
    assert torch.allclose(packed[:, :5], model(a), atol=1e-5)
    assert not torch.allclose(naive[:, 5:], alone, atol=1e-3)


def test_the_token_loss_counts_only_real_targets():
    task = TokenTask(cfg(), torch.device("cpu"))
    out = torch.randn(2, 4, V)
    y = torch.tensor([[1, 2, IGNORE, IGNORE], [3, 4, 5, 6]])
    per = task.per_sample(out, y)
    ref0 = torch.nn.functional.cross_entropy(out[0, :2], y[0, :2])
    assert torch.allclose(per[0], ref0) and per.shape == (2,)
    correct, loss_sum, count = task.eval_sums(out, y).tolist()
    assert count == 6 and loss_sum == pytest.approx(float(task.per_token(out, y).sum()), rel=1e-6)


def test_the_model_says_its_task():
    assert build_task(cfg(), torch.device("cpu")).name == "language_model"
    assert build_task(TrainConfig(), torch.device("cpu")).name == "classify"


def test_gpt_learns_through_the_trainer_and_resumes_exactly(tmp_path):
    """The loss falls and evaluation is per token; halted and resumed, the run ends with the
    uninterrupted run's weights, bit for bit (the token loader's position is in the checkpoint)."""
    whole = train(cfg(checkpoint_dir=str(tmp_path / "a")), *loaders())
    assert whole.metrics[-1]["loss"] < whole.metrics[0]["loss"] - 0.3
    assert whole.evals[-1]["n"] > 0 and whole.evals[-1]["loss"] < whole.evals[0]["loss"] + 0.5
    first = train(cfg(checkpoint_dir=str(tmp_path / "b"), halt_at_step=7), *loaders())
    assert first.halted
    rest = train(cfg(checkpoint_dir=str(tmp_path / "b")), *loaders())
    assert rest.resumed_from == 7
    assert rest.summary["param_digests"] == whole.summary["param_digests"]
    assert [m["loss"] for m in rest.metrics] == [m["loss"] for m in whole.metrics][7:]


def test_a_gpt_job_trains_on_a_token_artifact_through_the_rank_entry(tmp_path):
    """``launch`` with a ``tokens`` data spec: the rank builds the TokenLoader from the artifact."""
    from sluice.stages.data.text import TextShardConfig, shard_text
    from sluice.stages.run.launch import launch, make_job
    src = tmp_path / "text"
    src.mkdir()
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "sluice", "token"]
    for i in range(60):
        (src / f"doc{i:03d}.txt").write_text(" ".join(rng.choice(words, int(rng.integers(5, 30)))) + "\n")
    s = shard_text(TextShardConfig(tokenizer="byte", val_fraction=0.2, progress=False), src, tmp_path / "art")
    root = str(s.info()["root"])
    mixture = {"sources": [{"path": root, "weight": 1.0}]}
    data = {"kind": "tokens", "loader": {"split": "train", "seq_len": 32, "batch_size": 4, "mixture": mixture,
                                         "prefetch": 0}}
    ev = {"kind": "tokens", "loader": {"split": "val", "seq_len": 32, "batch_size": 4, "mixture": mixture,
                                       "prefetch": 0}}
    job = make_job(cfg(num_classes=257, max_steps=6, eval_every_steps=None).model_dump(), data, ev)
    r = launch(job, nproc=1, out_dir=tmp_path / "run", on_line=lambda s: None)
    assert r.steps == 6 and r.checkpoint and r.evals and r.evals[-1]["n"] > 0


def test_evaluation_gives_each_mixture_source_its_loss():
    """Two sources, one the other's ids shifted: the per-source losses are each source's own, and
    their token-weighted mean is the overall loss."""
    from sluice.stages.load.mixture import MixtureConfig
    d = docs()
    a = ArrayTokens.from_documents(d[:30], eot=0, vocab_size=V)
    b = ArrayTokens.from_documents([[(t * 7) % (V - 1) + 1 for t in doc] for doc in d[30:60]], eot=0, vocab_size=V)
    mix = MixtureConfig(sources=[{"name": "a", "weight": 1.0}, {"name": "b", "weight": 1.0}])
    ev = TokenLoader([a, b], seq_len=32, batch_size=8, seed=1, prefetch=0, mixture=mix)
    tr, _ = loaders()
    r = train(cfg(max_steps=8), tr, ev)
    e = r.evals[-1]
    assert set(e["loss_by_source"]) == {"a", "b"} and e["loss_by_source"]["a"] != e["loss_by_source"]["b"]
    lo, hi = sorted(e["loss_by_source"].values())
    assert lo <= e["loss"] <= hi


def test_every_evaluation_reads_the_same_rows():
    """An evaluation loader read to its end and set to epoch 0 again yields epoch 0's rows again,
    not the next epoch's packing: two evaluations of the same weights agree exactly."""
    from sluice.stages.train.dist import dist_context
    from sluice.stages.train.evaluate import evaluate
    _, ev = loaders()
    torch.manual_seed(0)
    model = build_model("gpt", 1, V, n_layer=1, n_head=2, d_model=32, max_len=32)
    c = cfg()
    task, d = build_task(c, torch.device("cpu")), dist_context(c)
    first, second = (evaluate(model, ev, task, "none", d) for _ in range(2))
    assert first == second and first["n"] > 0


def test_adam_betas_and_the_decay_split_reach_the_optimizer():
    """``betas`` are AdamW's (a language model's recipe: 0.95 for the squared gradient), torch's
    defaults otherwise; matrices (the tied embedding included) decay, norms and biases do not;
    betas outside [0, 1) are refused by the config."""
    from sluice.stages.optimizer import build_optimizer
    model = build_model("gpt", 1, V, n_layer=1, n_head=2, d_model=32, max_len=32)
    opt = build_optimizer("adamw", model, 1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    assert [g["betas"] for g in opt.param_groups] == [(0.9, 0.95)] * 2
    decayed, kept = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and kept["weight_decay"] == 0.0
    assert {p.ndim for p in decayed["params"]} == {2} and {p.ndim for p in kept["params"]} == {1}
    assert any(p is model.tok.weight for p in decayed["params"])
    assert build_optimizer("adam", model, 1e-3).param_groups[0]["betas"] == (0.9, 0.999)
    assert cfg(betas=(0.9, 0.95)).betas == (0.9, 0.95) and cfg().betas == (0.9, 0.999)
    with pytest.raises(ValueError, match="betas"):
        cfg(betas=(0.9, 1.0))


def test_the_trainer_builds_adamw_with_the_configs_betas():
    """``train.betas`` reaches the optimizer the trainer steps (the recipe's 0.95 is no dead field)."""
    from sluice.stages.train.components import Components
    from sluice.stages.train.dist import dist_context
    for betas in [(0.9, 0.95), (0.8, 0.99)]:
        c = cfg(optimizer="adamw", betas=betas)
        assert [g["betas"] for g in Components.build(c, dist_context(c)).opt.param_groups] == [betas] * 2
