"""``benchmarks.tokens --part loader``: tokens/s of packed (B, L) int64 inputs and targets on one core,
Sluice's ``TokenLoader`` (over the three sources, and as a weighted mixture) against nanoGPT's
memmap ``get_batch`` and LitData's ``TokensLoader``, in interleaved windows, the arm order rotated.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from benchmarks.tokens_common import CACHE, GOALS, SOURCES, _stats, _tag, debian_artifacts, log, open_train

# ------------------------------------------------------------------ settings per mode
LOADER = {"full": {"batch": 16, "seq_len": 1024, "window_s": 30.0, "warmup_s": 3.0, "repeats": 3},
          "quick": {"batch": 16, "seq_len": 1024, "window_s": 6.0, "warmup_s": 1.0, "repeats": 3},
          "tiny": {"batch": 4, "seq_len": 64, "window_s": 0.3, "warmup_s": 0.1, "repeats": 2}}
# the mixture arm's weights: a share of documents per source
LOADER_MIX = {"gcide": 0.6, "fortunes": 0.3, "pydocs": 0.1}


# ================================================================== part 1: loader
def stream_with_eot(splits: list[Any]) -> np.ndarray:
    """nanoGPT's prepare.py output: every document, each followed by the end-of-text id."""
    parts = []
    for sp in splits:
        toks = np.asarray(sp.tokens)
        parts.append(np.insert(toks, np.asarray(sp.offsets[1:], np.int64), sp.eot).astype(np.uint16))
    return np.concatenate(parts)


def arm_nanogpt(bin_path: Path, B: int, L: int, seed: int) -> Iterator[tuple[Any, Any]]:
    """nanoGPT's get_batch, strongest plain form (memmap opened once, one stack, one astype)."""
    import torch
    data = np.memmap(bin_path, dtype=np.uint16, mode="r")
    rng = np.random.default_rng(seed)
    hi = len(data) - L - 1
    while True:
        ix = rng.integers(0, hi, B)
        buf = torch.from_numpy(np.stack([data[i:i + L + 1] for i in ix]).astype(np.int64))
        yield buf[:, :-1], buf[:, 1:]


def litdata_optimize(bin_path: Path, out: Path, L: int) -> dict[str, Any]:
    """The nanoGPT stream in LitData's chunk format (LitData's documented TokensLoader recipe:
    each input yields a 1-D tensor of tokens; chunks hold a whole number of L+1 blocks)."""
    from litdata import TokensLoader, optimize
    if out.exists():
        shutil.rmtree(out)
    n = len(np.memmap(bin_path, dtype=np.uint16, mode="r"))
    step = 1 << 20
    inputs = [(str(bin_path), a, min(a + step, n)) for a in range(0, n, step)]
    t = time.perf_counter()
    optimize(fn=_litdata_piece, inputs=inputs, output_dir=str(out), chunk_size=(L + 1) * 2048,
             item_loader=TokensLoader(), num_workers=1, verbose=False, start_method="fork")
    return {"seconds": time.perf_counter() - t, "inputs": len(inputs), "tokens": n,
            "bytes": sum(f.stat().st_size for f in out.rglob("*") if f.is_file())}


def _litdata_piece(item: tuple[str, int, int]) -> Iterator[Any]:
    import torch
    path, a, b = item
    yield torch.from_numpy(np.array(np.memmap(path, dtype=np.uint16, mode="r")[a:b]).astype(np.int32))


def arm_litdata(out: Path, B: int, L: int, seed: int) -> Iterator[tuple[Any, Any]]:
    from litdata import StreamingDataLoader, StreamingDataset, TokensLoader
    ds = StreamingDataset(input_dir=str(out), item_loader=TokensLoader(block_size=L + 1), shuffle=True,
                          drop_last=True, seed=seed)
    dl = StreamingDataLoader(ds, batch_size=B, num_workers=0, drop_last=True)
    while True:
        for buf in dl:
            buf = buf.long()
            yield buf[:, :-1], buf[:, 1:]


def arm_sluice(splits: list[Any], B: int, L: int, seed: int, mixture: Any = None,
               fields: list[str] | None = None) -> Iterator[tuple[Any, Any]]:
    """``fields``: the per-token fields besides inputs and targets (None: the loader's default)."""
    from sluice.stages.load.tokens import TokenLoader
    kw = {"mixture": mixture} if mixture is not None else {}
    if fields is not None:
        kw["fields"] = fields
    loader = TokenLoader(splits, seq_len=L, batch_size=B, prefetch=0, seed=seed, **kw)
    while True:
        for b in loader:  # a finished epoch starts the next one
            yield b.inputs["input_ids"], b.targets


def _window(it: Iterator[tuple[Any, Any]], seconds: float, warmup_s: float) -> dict[str, float]:
    t_end = time.perf_counter() + warmup_s
    while time.perf_counter() < t_end:
        next(it)
    n_tok, batches = 0, 0
    c0, t0 = time.process_time(), time.perf_counter()
    while True:
        x, y = next(it)
        n_tok += x.shape[0] * x.shape[1]
        batches += 1
        t = time.perf_counter() - t0
        if t >= seconds:
            break
    return {"tokens_per_s": n_tok / t, "batches": batches, "seconds": t,
            "cores_busy": (time.process_time() - c0) / t}


def part_loader(mode: str, limit: dict[str, int] | None) -> dict[str, Any]:
    import torch
    torch.set_num_threads(1)
    s = LOADER[mode]
    B, L = s["batch"], s["seq_len"]
    t = time.perf_counter()
    roots = debian_artifacts(limit)
    shard_s = time.perf_counter() - t
    splits = open_train(roots)
    tag = _tag(limit)
    bin_path = CACHE / f"nanogpt-{tag}.bin"
    t = time.perf_counter()
    stream = stream_with_eot(splits)
    tmp = bin_path.with_suffix(".tmp")
    stream.tofile(tmp)
    os.replace(tmp, bin_path)
    prep_s = time.perf_counter() - t
    arms: dict[str, Callable[[], Iterator[tuple[Any, Any]]]] = {
        "nanogpt_memmap": lambda: arm_nanogpt(bin_path, B, L, 0),
        "sluice": lambda: arm_sluice(splits, B, L, 0, fields=[]),
        "sluice_all_fields": lambda: arm_sluice(splits, B, L, 0),
    }
    from sluice.stages.load.mixture import MixtureConfig, SourceSpec
    n_docs = sum(len(sp) for sp in splits)
    mix = MixtureConfig(sources=[SourceSpec(name=n, weight=LOADER_MIX[n]) for n in SOURCES], epoch_size=n_docs)
    arms["sluice_mixture"] = lambda: arm_sluice(splits, B, L, 0, mix, fields=[])
    skipped, litdata_prep = {}, None
    try:
        import litdata  # noqa: F401
        lit_dir = CACHE / f"litdata-{tag}-L{L}"
        litdata_prep = litdata_optimize(bin_path, lit_dir, L)
        arms["litdata_tokens"] = lambda: arm_litdata(lit_dir, B, L, 0)
    except ImportError as e:
        skipped["litdata_tokens"] = f"litdata is not installed ({e})"
    names = list(arms)
    its = {n: arms[n]() for n in names}
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for r in range(s["repeats"]):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            w = _window(its[n], s["window_s"], s["warmup_s"])
            w["repeat"] = r
            runs[n].append(w)
            log(f"loader repeat {r} {n}: {w['tokens_per_s']:,.0f} tokens/s ({w['cores_busy']:.2f} cores busy)")
    summary = {n: {"tokens_per_s": _stats([w["tokens_per_s"] for w in runs[n]]),
                   "cores_busy": _stats([w["cores_busy"] for w in runs[n]])} for n in names}
    med = {n: summary[n]["tokens_per_s"]["median"] for n in names}
    goals = {"vs_nanogpt": {"wanted": GOALS["vs_nanogpt"], "value": med["sluice"] / med["nanogpt_memmap"]},
             "mixture_vs_nanogpt": {"wanted": GOALS["vs_nanogpt"],
                                    "value": med["sluice_mixture"] / med["nanogpt_memmap"]}}
    if "litdata_tokens" in med:
        goals["vs_litdata"] = {"wanted": GOALS["vs_litdata"], "value": med["sluice"] / med["litdata_tokens"]}
        goals["mixture_vs_litdata"] = {"wanted": GOALS["vs_litdata"],
                                       "value": med["sluice_mixture"] / med["litdata_tokens"]}
    for g in goals.values():
        g["met"] = g["value"] >= g["wanted"]
    return {"batch": B, "seq_len": L, "window_s": s["window_s"], "warmup_s": s["warmup_s"],
            "repeats": s["repeats"], "threads": 1,
            "corpus": {"sources": {n: {"docs": len(sp), "tokens": int(sp.record.tokens)}
                                   for n, sp in zip(SOURCES, splits)},
                       "stream_tokens": int(len(stream)), "vocab_size": int(splits[0].vocab_size),
                       "limit_per_source": limit},
            "prep": {"sluice_shard_s (cached after the first run)": shard_s, "nanogpt_bin_s": prep_s,
                     "litdata_optimize": litdata_prep},
            "mixture_weights": LOADER_MIX, "runs": runs, "summary": summary, "goals": goals,
            "skipped": skipped}
