"""A training step never waits on the host: between two logged steps nothing is read back from
a tensor (loss, statistics, selection, EMA), so a GPU is never drained mid-run.

On CPU a read costs nothing, so it is counted instead: every call of ``Tensor.item``, ``tolist``,
``cpu``, ``numpy``, ``__bool__``, ``__float__``, ``__int__`` and ``__index__`` made inside
``train_step`` (the loader's own work excepted: its batches come from host memory). The GPU twin
in ``test_gpu_paths.py`` runs the same steps under ``torch.cuda.set_sync_debug_mode("error")``.
"""
from __future__ import annotations

import contextlib
import traceback
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import torch

from sluice.stages import contracts
from torch.overrides import TorchFunctionMode

from sluice.errors import NonFiniteLoss
from sluice.stages.load.arrays import ArrayLoader, fashion_mnist
from sluice.stages.select import SelectionConfig, build_selector
from sluice.stages.train import TrainConfig, rank, train
from sluice.stages.train.ema import build_ema, ema_decay_at
from sluice.storage.checkpoint import load_checkpoint

N, STEPS, EVERY = 512, 10, 5
T = torch.Tensor
READS = {T.item, T.tolist, T.cpu, T.numpy, T.__bool__, T.__float__, T.__int__, T.__index__}


class HostReads(TorchFunctionMode):
    """Counts reads of tensor values on the host, with where each happened."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.paused = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS and not self.paused:
            where = traceback.extract_stack(limit=2)[0]
            self.calls.append(f"{func.__name__} at {where.filename.rsplit('/', 2)[-1]}:{where.lineno}")
        return func(*args, **(kwargs or {}))


class Paused:
    """The loader's batches, taken with ``pause`` entered (host data: not the step's reads)."""

    def __init__(self, batches: Iterator[Any], pause: Callable[[], contextlib.AbstractContextManager]):
        self.batches, self.pause = batches, pause

    def __iter__(self) -> "Paused":
        return self

    def __next__(self) -> Any:
        with self.pause():
            return next(self.batches)


@pytest.fixture(scope="module")
def fmnist() -> tuple[np.ndarray, np.ndarray]:
    x, y = fashion_mnist("train")
    return x[:N], y[:N]


def sync_free_run(data, device: str, watch: Callable[[int, Callable[[], Any]], Any], monkeypatch,
                  params: dict[str, Any] | None = None, **kw) -> Any:
    """Train ``STEPS`` steps logging every ``EVERY`` with InfoBatch (``params``; by default gathering
    on log steps, as ``sync_every`` = accumulated micro-batches per log window makes it), the EMA,
    clipping and accumulation on; ``watch(step, run)`` runs each ``train_step``."""
    real = rank.train_step

    def watched(parts, state, batches, *args, **kwargs):
        return watch(state.step + 1, lambda pause: real(parts, state, Paused(batches, pause), *args, **kwargs))
    monkeypatch.setattr(rank, "train_step", watched)
    x, y = data
    # by default anneal 0.5: InfoBatch prunes only before its first gather (step 5); pruning steps
    # are tests/test_infobatch_mask.py's (mask mode reads nothing, drop mode reads a pruned size)
    sel = build_selector(SelectionConfig(method="infobatch", params=params or {"sync_every": 2 * EVERY, "anneal": 0.5}),
                         candidate_size=32, split_size=N)
    cfg = dict(model_kwargs={"width": 8}, max_steps=STEPS, batch_size=32, lr=0.05, progress=False,
               torch_threads=1, log_every_steps=EVERY, ema_decay=0.9, clip_grad_norm=5.0,
               accum_steps=2, device=device)
    cfg.update(kw)
    return train(TrainConfig(**cfg), ArrayLoader(x, y, 32, seed=0), selector=sel)


def count_reads(reads: dict[int, list[str]]) -> Callable[[int, Callable], Any]:
    """A ``watch`` that records each step's host reads in ``reads`` (the loader's own work paused)."""
    def count(step: int, run: Callable) -> Any:
        mode = HostReads()

        @contextlib.contextmanager
        def pause():
            mode.paused = True
            try:
                yield
            finally:
                mode.paused = False
        with mode:
            out = run(pause)
        reads[step] = mode.calls
        return out
    return count


def strict_on_cuda(strict_steps: list[int]) -> Callable[[int, Callable], Any]:
    """A ``watch`` that runs every step but the first and the logged ones under
    ``torch.cuda.set_sync_debug_mode("error")`` (the loader's host-memory batches exempt), and
    appends each such step to ``strict_steps``."""
    def strict(step: int, run: Callable) -> Any:
        if step == 1 or step % EVERY == 0:
            return run(contextlib.nullcontext)

        @contextlib.contextmanager
        def pause():  # the loader's batches come from host memory
            torch.cuda.set_sync_debug_mode(0)
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode("error")
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = run(pause)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        strict_steps.append(step)
        return out
    return strict


def test_steps_between_logs_read_nothing_back(fmnist, monkeypatch):
    reads: dict[int, list[str]] = {}
    r = sync_free_run(fmnist, "cpu", count_reads(reads), monkeypatch)
    assert sorted(reads) == list(range(1, STEPS + 1))
    unlogged = {s: calls for s, calls in reads.items() if s % EVERY}
    assert unlogged == {s: [] for s in unlogged}, unlogged
    assert reads[EVERY]  # the gather on a log step does read (the table's mean): the count sees it
    assert [m["step"] for m in r.metrics] == [5, 10]


def test_log_every_steps_writes_every_nth_record_with_window_clocks(fmnist, tmp_path):
    """With log_every_steps=N only every Nth step's record is written: its own loss, lr and
    selection statistics (as the every-step run has them), clocks averaged over its window."""
    x, y = fmnist
    base = dict(model_kwargs={"width": 8}, max_steps=12, batch_size=32, lr=0.05, progress=False,
                torch_threads=1, ema_decay=0.9)
    every = train(TrainConfig(**base), ArrayLoader(x, y, 32, seed=0))
    path = tmp_path / "m.jsonl"
    fourth = train(TrainConfig(**base, log_every_steps=4, metrics_path=str(path)), ArrayLoader(x, y, 32, seed=0))
    assert [m["step"] for m in fourth.metrics] == [4, 8, 12]
    assert list(fourth.metrics[0]) == list(every.metrics[0])
    for m in fourth.metrics:
        same = every.metrics[m["step"] - 1]
        assert (m["loss"], m["lr"], m["epoch"]) == (same["loss"], same["lr"], same["epoch"])
        assert m["samples_per_s"] == pytest.approx(32 / m["step_s"])  # 4 steps of 32 in 4 step_s
        assert m["data_wait_frac"] == pytest.approx(m["data_s"] / m["step_s"])
    assert every.summary["param_digests"] == fourth.summary["param_digests"]
    assert len(path.read_text().splitlines()) == 3


class PoisonAt(contracts.SelectorHooks):
    """Keeps every candidate; from call ``at`` on, the first weight is NaN (the loss diverges)."""

    def __init__(self, at: int):
        self.at, self.calls = at, 0

    def __call__(self, model, images, labels, indices):
        from sluice.stages.contracts import SelectedBatch
        self.calls += 1
        w = torch.ones(len(labels))
        if self.calls >= self.at:
            w[0] = float("nan")
        return SelectedBatch(images, labels, indices, w, {"calls": torch.tensor(float(self.calls))})


def test_a_nan_loss_is_found_at_the_next_read_and_never_saved(fmnist, tmp_path):
    """bf16/fp32: a NaN at step 7 is found at the next read (the log step 10 here, or a
    checkpoint save before it), and the error names step 7; no checkpoint holds its weights."""
    x, y = fmnist
    base = dict(model_kwargs={"width": 8}, max_steps=20, batch_size=32, lr=0.05, progress=False,
                torch_threads=1, log_every_steps=5, checkpoint_dir=str(tmp_path / "a"))
    with pytest.raises(NonFiniteLoss, match="step 7 .*last good checkpoint"):
        train(TrainConfig(**base, checkpoint_every_steps=4), ArrayLoader(x, y, 32, seed=0), selector=PoisonAt(7))
    state = load_checkpoint(tmp_path / "a" / "last.pt")
    assert state["step"] == 4  # step 8's save read the steps first and refused
    assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())
    base["checkpoint_dir"] = str(tmp_path / "b")
    with pytest.raises(NonFiniteLoss, match="step 7 .*no checkpoint was written"):
        train(TrainConfig(**base), ArrayLoader(x, y, 32, seed=0), selector=PoisonAt(7))
    assert not (tmp_path / "b" / "last.pt").exists()


def test_ema_update_reads_nothing_and_matches_the_host_schedule():
    """The warm-up weight computed on the device gives bitwise the weights that lerping by the
    host's ``1 - ema_decay_at(decay, n)`` gives, update after update, and reads nothing."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 3))
    for decay in (0.9, 0.995):
        ema = build_ema(model, decay)
        ref = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
        for n in range(40):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p))
                model(torch.randn(8, 7))  # BN statistics (and num_batches_tracked) move
            with HostReads() as mode:
                ema.update_parameters(model)
            assert mode.calls == []
            now = [t.detach() for t in (*model.parameters(), *model.buffers())]
            if n == 0:
                ref = [t.clone() for t in now]
            else:
                fl = [(r, t) for r, t in zip(ref, now) if r.is_floating_point()]
                torch._foreach_lerp_([r for r, _ in fl], [t for _, t in fl], 1.0 - ema_decay_at(decay, n))
                for r, t in zip(ref, now):
                    if not r.is_floating_point():
                        r.copy_(t)
            got = [t.detach() for t in (*ema.module.parameters(), *ema.module.buffers())]
            assert all(torch.equal(a, b) for a, b in zip(got, ref)), (decay, n)
        assert int(ema.n_averaged) == 40
        again = build_ema(model, decay)
        again.load_state_dict(ema.state_dict())  # resumed: the next update averages, not copies
        ema.update_parameters(model)
        again.update_parameters(model)
        assert all(torch.equal(a, b) for a, b in zip(ema.state_dict().values(), again.state_dict().values()))
