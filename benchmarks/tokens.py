"""Token pipeline benchmarks (issue #41): the packed-row loader against nanoGPT's memmap loader and
LitData's ``TokensLoader``; exact mid-epoch resume of a weighted three-source mixture at another
world size; and a small GPT trained to a fixed validation loss, Sluice's recipe against a plain
nanoGPT-style loop, tokenizer training and sharding counted.

    python -m benchmarks.tokens                   # all three parts: benchmarks/results/tokens-<class>.json
    python -m benchmarks.tokens --quick           # minutes: tokens-<class>_quick.json
    python -m benchmarks.tokens --part loader     # one part (loader | resume | e2e); others kept from the file
    python -m benchmarks.tokens --part e2e --calibrate   # the sweep the e2e target was read from

Data: three real text sources shipped as Debian packages (``sluice.stages.data.text.debian``:
dict-gcide, fortunes, python3.11-doc), cached under ``benchmarks/.cache/tokens/``.

**loader**: tokens/s of packed (B, L) int64 inputs and targets on one core
(``torch.set_num_threads(1)``; no arm has a helper thread or worker process: Sluice ``prefetch=0``,
LitData ``num_workers=0``, nanoGPT has none). Arms over the same tokens (the three train splits):
``nanogpt_memmap`` (nanoGPT's ``get_batch``, its strongest form: one ``np.memmap`` of the whole
stream opened once, B random offsets, one ``np.stack`` of the L+1 windows, one ``astype``, x/y as
views), ``litdata_tokens`` (the stream ``litdata.optimize``d into LitData chunks, timed apart,
then ``StreamingDataset(TokensLoader(block_size=L+1), shuffle=True)`` + ``StreamingDataLoader``),
``sluice`` (``TokenLoader`` over the three splits, every document once) and ``sluice_mixture``
(the same three as a weighted mixture), both yielding what nanoGPT's does (inputs, targets and
row ids: ``fields=[]``), and ``sluice_all_fields`` (``sluice`` with the per-token fields a packed
GPT trains on by default: segment ids, positions, sources). Interleaved windows, the arm order
rotated.

**resume**: a weighted three-source mixture (awkward weights, a prime epoch size, a sequence-length
curriculum) packed at 4 ranks, stopped mid-epoch, its state resumed at 1, 2, 3 and 6 ranks, run
through the end of a second epoch; every epoch's rows are checked against an uninterrupted
1-rank run: no token position repeated or skipped, the same tokens, and per-source document and
token counts exactly the mixture's. Beside it, what ``DistributedSampler`` does on the same stop.

**e2e**: wall time from a fresh process to a validation loss (bits per byte, so the two
tokenizers compare) fixed before the runs, per seed; each arm starts from the raw text and
trains its own tokenizer (BPE, ``tokenizers``) and writes its own token files inside the timing.
Arms (``E2E_ARMS``): ``nanogpt_loop``, ``sluice`` (the text recipe's default: packed rows, no
curriculum; the goal's arm) and ``sluice_curriculum`` (the same with the sequence-length
curriculum, recorded beside it).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from benchmarks.common import table
from benchmarks.hostinfo import describe_run, load_average, results_name

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "benchmarks" / ".cache" / "tokens"
SOURCES = ("gcide", "fortunes", "pydocs")

GOALS = {"vs_nanogpt": 0.9, "vs_litdata": 1.0, "e2e_ratio": 0.8}

# ------------------------------------------------------------------ settings per mode
LOADER = {"full": {"batch": 16, "seq_len": 1024, "window_s": 30.0, "warmup_s": 3.0, "repeats": 3},
          "quick": {"batch": 16, "seq_len": 1024, "window_s": 6.0, "warmup_s": 1.0, "repeats": 3},
          "tiny": {"batch": 4, "seq_len": 64, "window_s": 0.3, "warmup_s": 0.1, "repeats": 2}}
# the mixture arm's weights: a share of documents per source
LOADER_MIX = {"gcide": 0.6, "fortunes": 0.3, "pydocs": 0.1}

RESUME = {"full": {"epoch_size": 7919, "weights": (0.71, 0.23, 0.06), "stop_frac": 0.37,
                   "seq": (32, 128), "global_batch": 24},
          "quick": {"epoch_size": 2003, "weights": (0.71, 0.23, 0.06), "stop_frac": 0.37,
                    "seq": (32, 128), "global_batch": 24},
          "tiny": {"epoch_size": 97, "weights": (0.71, 0.23, 0.06), "stop_frac": 0.37,
                   "seq": (8, 32), "global_batch": 24}}
RESUME_WORLDS = (1, 2, 3, 6)

# e2e: corpus (documents per source), model and budget. The target (bits per byte of the
# validation text) is fixed here before the timed runs; ``--calibrate`` records the sweep it was
# read from (every arm runs to the end of the budget, seed 0). The rule: the plain loop's bits per
# byte at three quarters of its budget, rounded up to 0.05 (quick: 3.12 at step 75 and 3.05 at
# step 100 of 122 in the calibration recorded in tokens-avx2_quick.json -> 3.10; full: 2.062 at
# step 850 and 2.047 at step 900 of 1171, 2.054 at step 878, in tokens-avx2.json -> 2.10).
E2E = {"full": {"limit": {"gcide": 12000, "fortunes": 6000, "pydocs": 60}, "vocab": 2048,
                "model": {"n_layer": 4, "n_head": 4, "d_model": 128, "max_len": 128},
                "seq_len": 128, "batch": 16, "budget_tokens": 2_400_000, "eval_every": 50,
                "lr": 3e-3, "curriculum": {"start": 32, "step": 16, "warmup_frac": 0.3}, "target_bpb": 2.10},
       "quick": {"limit": {"gcide": 6000, "fortunes": 3000, "pydocs": 30}, "vocab": 1024,
                 "model": {"n_layer": 2, "n_head": 4, "d_model": 128, "max_len": 128},
                 "seq_len": 128, "batch": 16, "budget_tokens": 250_000, "eval_every": 25,
                 "lr": 3e-3, "curriculum": {"start": 32, "step": 16, "warmup_frac": 0.3}, "target_bpb": 3.10},
       "tiny": {"limit": {"gcide": 150, "fortunes": 150, "pydocs": 2}, "vocab": 300,
                "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "max_len": 32},
                "seq_len": 32, "batch": 4, "budget_tokens": 6_000, "eval_every": 10,
                "lr": 3e-3, "curriculum": {"start": 8, "step": 8, "warmup_frac": 0.3}, "target_bpb": 50.0}}
E2E_SEEDS = (0, 1, 2)
# The goal's arms are the plain loop and ``sluice``, the text recipe's default (flows/recipes/text.yaml:
# no curriculum). ``sluice_curriculum`` adds the sequence-length curriculum (``E2E[mode]["curriculum"]``)
# and is recorded beside them: at this budget it costs quality (quick, 250k tokens, seed 0, bits per
# byte at the end of the budget in the calibration sweep: 3.10 with it, 3.04 without it, the plain
# loop 3.04; the calibration at 072bbf8, with consecutive rows, the curriculum and torch's betas,
# ended at 3.34).
E2E_ARMS = ("nanogpt_loop", "sluice", "sluice_curriculum")
TINY_LIMIT = {"gcide": 300, "fortunes": 200, "pydocs": 3}  # the loader and resume parts' corpus in --tiny


def log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def _stats(xs: list[float]) -> dict[str, float | None]:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


# ================================================================== data
def debian_text(out: Path, limit: dict[str, int | None]) -> dict[str, Path]:
    """The three Debian text sources under ``out`` (cached: written once per limit)."""
    from sluice.stages.data.text import debian
    out.mkdir(parents=True, exist_ok=True)
    done = out / ".complete"
    paths = {"gcide": out / "gcide.jsonl", "fortunes": out / "fortunes.parquet", "pydocs": out / "pydocs"}
    if not done.exists():
        debian.gcide_jsonl(out, limit.get("gcide"))
        debian.fortunes_parquet(out, limit.get("fortunes"))
        debian.pydocs_folder(out, limit.get("pydocs"))
        done.write_text(json.dumps(limit))
    return paths


def _tag(limit: dict[str, int] | None) -> str:
    return "all" if limit is None else "-".join(f"{k}{v}" for k, v in limit.items())


def debian_artifacts(limit: dict[str, int] | None) -> dict[str, Path]:
    """The three sources sharded by Sluice as ``debian --shard`` does (one BPE tokenizer, learnt
    from gcide's train split, shared; its default config): ``{name: version directory}``. Cached
    by the shard stage's fingerprint."""
    from sluice.stages.data.text import TextShardConfig, shard_text
    tag = _tag(limit)
    text = debian_text(CACHE / f"text-{tag}", limit or {})
    roots, first = {}, None
    for name in SOURCES:
        cfg = TextShardConfig(tokenizer_file=first, progress=False, **({} if limit is None else {"vocab_size": 512}))
        s = shard_text(cfg, text[name], CACHE / f"art-{tag}" / name)
        roots[name] = Path(s.root)
        first = first or s.root
    return roots


def open_train(roots: dict[str, Path]) -> list[Any]:
    from sluice.storage.tokens import open_token_split
    return [open_token_split(roots[n], "train") for n in SOURCES]


def stream_with_eot(splits: list[Any]) -> np.ndarray:
    """nanoGPT's prepare.py output: every document, each followed by the end-of-text id."""
    parts = []
    for sp in splits:
        toks = np.asarray(sp.tokens)
        parts.append(np.insert(toks, np.asarray(sp.offsets[1:], np.int64), sp.eot).astype(np.uint16))
    return np.concatenate(parts)


# ================================================================== part 1: loader
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
            yield b.input_ids, b.targets


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


# ================================================================== part 2: resume
def hamilton(weights: tuple[float, ...], total: int) -> list[int]:
    """Largest-remainder counts, written out here so the check does not trust the code it checks."""
    w = [Fraction(x) for x in weights]
    q = [x * total / sum(w) for x in w]
    c = [int(x) for x in q]
    for i in sorted(range(len(q)), key=lambda i: (-(q[i] - c[i]), i))[:total - sum(c)]:
        c[i] += 1
    return c


def _run_ranks(splits: list[Any], cfg: dict[str, Any], world: int, batch: int, state: dict | None,
               stop_steps: int | None, epochs: int) -> tuple[dict[int, list], dict | None]:
    """Every rank of ``world`` in lockstep (one process); returns the real rows seen per epoch:
    (start, L, inputs, targets, sources) and, when stopped, the state after ``stop_steps``."""
    from sluice.stages.load.tokens import TokenLoader
    loaders = [TokenLoader(splits, cfg, rank=r, world_size=world, batch_size=batch) for r in range(world)]
    if state is not None:
        for ld in loaders:
            ld.load_state_dict(state)
    rows: dict[int, list] = {}
    steps = 0
    while True:
        its = [iter(ld) for ld in loaders]
        for batches in zip(*its):
            for b in batches:
                e = loaders[0].epoch
                keep = (b.sample_ids >= 0).numpy()
                for i in np.nonzero(keep)[0]:
                    rows.setdefault(e, []).append((int(b.sample_ids[i]), b.seq_len, b.input_ids[i].numpy(),
                                                   b.targets[i].numpy(), b.sources[i].numpy()))
            steps += 1
            if stop_steps is not None and steps >= stop_steps:
                for it in its:
                    it.close()
                return rows, loaders[0].state_dict()
        if loaders[0].epoch >= epochs - 1:
            return rows, None


def _epoch_stream(rows: list, end: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, int]]:
    """The epoch's input tokens by stream position, their targets and sources, from its rows;
    with the count of positions covered twice and never."""
    cover = np.zeros(end, np.int32)
    toks = np.full(end, -1, np.int64)
    tgts = np.full(end, -1, np.int64)
    srcs = np.full(end, -1, np.int64)
    for start, L, x, y, s in rows:
        n = int((s >= 0).sum())  # the row's inputs: fewer than L at a lane's or the epoch's end
        cover[start:start + n] += 1
        toks[start:start + n], tgts[start:start + n], srcs[start:start + n] = x[:n], y[:n], s[:n]
    return toks, tgts, srcs, {"repeated": int((cover > 1).sum()), "skipped": int((cover == 0).sum())}


def naive_peer(n_chunks: int, stop_steps: int, old_world: int, batch: int, worlds: tuple[int, ...]) -> dict[str, Any]:
    """torch DataLoader + DistributedSampler over fixed chunks (no weighting: it cannot express
    the mixture), stopped at the same step, resumed two common ways: restart the epoch, or skip
    the batches each rank had taken (rescaled to keep the global batch)."""
    from torch.utils.data.distributed import DistributedSampler
    ds = range(n_chunks)

    def per_rank(w: int) -> list[list[int]]:
        return [list(DistributedSampler(ds, num_replicas=w, rank=r, shuffle=True, seed=0)) for r in range(w)]
    before = per_rank(old_world)
    consumed = [i for r in range(old_world) for i in before[r][:stop_steps * batch]]
    out: dict[str, Any] = {"chunks": n_chunks}
    for w in worlds:
        after = per_rank(w)
        per = stop_steps * batch * old_world // w
        for how, seen in (("restart_epoch", [i for rr in after for i in rr]),
                          ("skip_taken_batches", [i for rr in after for i in rr[per:]])):
            counts = np.bincount(np.asarray(consumed + seen, np.int64), minlength=n_chunks)
            out.setdefault(how, {})[str(w)] = {"repeated": int((counts > 1).sum()),
                                               "skipped": int((counts == 0).sum())}
    return out


def part_resume(mode: str, limit: dict[str, int] | None) -> dict[str, Any]:
    from sluice.stages.load.mixture import MixtureConfig, SourceSpec
    from sluice.stages.load.tokens import SeqLenSchedule, TokenLoader, TokenLoaderConfig
    s = RESUME[mode]
    splits = open_train(debian_artifacts(limit))
    lo, hi = s["seq"]
    mix = MixtureConfig(sources=[SourceSpec(name=n, weight=w) for n, w in zip(SOURCES, s["weights"])],
                        epoch_size=s["epoch_size"], seed=7)
    probe = TokenLoader(splits, TokenLoaderConfig(seq_len=hi, batch_size=1, mixture=mix, prefetch=0, seed=7))
    end0 = probe.stream(0).end
    cfg = TokenLoaderConfig(seq_len=hi, mixture=mix, seed=7, prefetch=0,
                            seq_len_schedule=SeqLenSchedule(start=lo, end=hi, step=8, warmup_tokens=max(1, end0 // 2)))
    G = s["global_batch"]
    t = time.perf_counter()
    ref_rows, _ = _run_ranks(splits, cfg, 1, G, None, None, epochs=2)
    ref_s = time.perf_counter() - t
    ref_steps_e0 = TokenLoader(splits, cfg, batch_size=G).__len__()
    stop = max(1, int(ref_steps_e0 * s["stop_frac"]))
    first_rows, state = _run_ranks(splits, cfg, 4, G // 4, None, stop, epochs=2)
    expected_counts = hamilton(s["weights"], s["epoch_size"])
    ref = {}
    for e in (0, 1):
        st = probe.stream(e)
        toks, tgts, srcs, cov = _epoch_stream(ref_rows[e], st.end)
        ref[e] = (st, toks, tgts, srcs, cov)
    results: dict[str, Any] = {}
    for w in RESUME_WORLDS:
        t = time.perf_counter()
        rows, _ = _run_ranks(splits, cfg, w, G // w, state, None, epochs=2)
        checks: dict[str, Any] = {}
        ok = True
        for e in (0, 1):
            st, rtoks, rtgts, rsrcs, rcov = ref[e]
            allrows = (first_rows.get(e, []) + rows.get(e, [])) if e == 0 else rows.get(e, [])
            toks, tgts, srcs, cov = _epoch_stream(allrows, st.end)
            docs = np.bincount(st.src, minlength=len(SOURCES)).tolist()
            want_tok = [int(st.lens[st.src == k].sum()) for k in range(len(SOURCES))]
            want_tok[int(st.src[-1])] -= 1  # the epoch's last token is only a target
            got_tok = np.bincount(srcs[srcs >= 0], minlength=len(SOURCES)).tolist()
            c = {"rows": len(allrows), "positions": int(st.end), **cov,
                 "same_tokens_as_uninterrupted": bool(np.array_equal(toks, rtoks) and np.array_equal(tgts, rtgts)),
                 "docs_per_source": dict(zip(SOURCES, docs)),
                 "docs_expected": dict(zip(SOURCES, expected_counts)),
                 "tokens_per_source": dict(zip(SOURCES, got_tok)),
                 "tokens_expected": dict(zip(SOURCES, want_tok))}
            c["counts_exact"] = docs == expected_counts and got_tok == want_tok
            c["pass"] = (c["repeated"] == 0 and c["skipped"] == 0 and c["same_tokens_as_uninterrupted"]
                         and c["counts_exact"])
            ok &= c["pass"]
            checks[f"epoch{e}"] = c
        results[str(w)] = {"pass": ok, "per_rank_batch": G // w, "seconds": time.perf_counter() - t, **checks}
        log(f"resume 4 -> {w}: {'pass' if ok else 'FAIL'}")
    chunk = hi + 1
    peer = naive_peer(int(ref[0][0].total // chunk), stop, 4, G // 4, RESUME_WORLDS)
    return {"sources": list(SOURCES), "weights": dict(zip(SOURCES, s["weights"])), "epoch_size": s["epoch_size"],
            "seq_len_schedule": cfg.seq_len_schedule.model_dump(), "global_batch": G, "from_world": 4,
            "stop_step": stop, "steps_epoch0": ref_steps_e0, "reference_seconds": ref_s,
            "expected_docs": dict(zip(SOURCES, expected_counts)), "worlds": results,
            "all_pass": all(r["pass"] for r in results.values()), "naive_peer": peer,
            "naive_peer_note": f"DistributedSampler over {chunk}-token chunks of the same epoch's stream, "
                               "shuffle=True, drop_last=False, stopped at the same step"}


# ================================================================== part 3: e2e
def e2e_corpus(mode: str) -> dict[str, Any]:
    """The raw text both arms start from, split once (outside every timing) into train and
    validation documents by a hash of each document's key: ``train/`` and ``val/`` each hold the
    three sources in their own formats."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    lim = E2E[mode]["limit"]
    tag = "-".join(f"{k}{v}" for k, v in lim.items())
    base = CACHE / f"e2e-{tag}"
    if (base / ".complete").exists():
        return json.loads((base / ".complete").read_text()) | {"base": str(base)}
    raw = debian_text(CACHE / f"text-{tag}", lim)

    def is_val(key: str) -> bool:
        return zlib.crc32(key.encode()) % 20 == 0  # 5%

    val_docs: list[str] = []
    for part in ("train", "val"):
        (base / part / "pydocs").mkdir(parents=True, exist_ok=True)
    lines = {"train": [], "val": []}
    for line in raw["gcide"].read_text().splitlines():
        d = json.loads(line)
        if d["text"].strip():
            lines["val" if is_val(d["id"]) else "train"].append(line)
    for part in lines:
        (base / part / "gcide.jsonl").write_text("\n".join(lines[part]) + "\n")
    val_docs += [json.loads(x)["text"] for x in lines["val"]]
    t = pq.read_table(raw["fortunes"]).to_pylist()
    rows = {"train": [], "val": []}
    for r in t:
        if r["text"].strip():
            rows["val" if is_val(r["id"]) else "train"].append(r)
    for part in rows:
        pq.write_table(pa.table({"id": [r["id"] for r in rows[part]], "text": [r["text"] for r in rows[part]]}),
                       base / part / "fortunes.parquet")
    val_docs += [r["text"] for r in rows["val"]]
    files = sorted(raw["pydocs"].rglob("*.txt"))
    k = min(5, len(files) - 1)
    for i, f in enumerate(files):
        rel = f.relative_to(raw["pydocs"])
        # pydocs are few: every 10th file is validation, so there is at least one
        part = "val" if i % 10 == k else "train"
        dest = base / part / "pydocs" / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(f.read_bytes())
        if part == "val":
            val_docs.append(f.read_text())
    info = {"val_docs": len(val_docs), "val_bytes": sum(len(d.encode()) for d in val_docs),
            "train_docs": len(lines["train"]) + len(rows["train"]) + sum(1 for _ in (base / "train" / "pydocs").rglob("*.txt")),
            "train_bytes": sum(f.stat().st_size for f in (base / "train").rglob("*") if f.is_file())}
    (base / ".complete").write_text(json.dumps(info))
    return info | {"base": str(base)}


def read_text_docs(folder: Path) -> tuple[list[str], list[str], list[str]]:
    """The baseline's reader: each source's documents (jsonl lines, Parquet rows, .txt files)."""
    import pyarrow.parquet as pq
    g = [json.loads(x)["text"] for x in (folder / "gcide.jsonl").read_text().splitlines() if x.strip()]
    f = pq.read_table(folder / "fortunes.parquet", columns=["text"]).column("text").to_pylist()
    p = [x.read_text() for x in sorted((folder / "pydocs").rglob("*.txt"))]
    return g, f, p


def _bpb(loss_nats_per_token: float, n_tokens: int, n_bytes: int) -> float:
    return loss_nats_per_token * n_tokens / (n_bytes * math.log(2))


def onecycle(progress: float, warm: float = 0.1) -> float:
    if progress < warm:
        return 0.04 + 0.96 * progress / warm
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warm) / (1 - warm))))


def e2e_baseline(mode: str, seed: int, work: Path, corpus: dict[str, Any], t_launch: float,
                 target: float | None) -> dict[str, Any]:
    """A plain nanoGPT-style run: prepare.py (BPE with ``tokenizers`` on the train text, uint16
    .bin files with an end-of-text after each document), random windows from an np.memmap, AdamW
    (nanoGPT's betas), warm-up + cosine, the same GPT class, the whole validation stream
    evaluated every ``eval_every`` steps."""
    import torch
    import torch.nn.functional as F
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from sluice.stages.models.gpt import GPT
    s = E2E[mode]
    torch.set_num_threads(2)
    base = Path(corpus["base"])
    # -- prepare.py
    train_docs = [d for src in read_text_docs(base / "train") for d in src]
    val_docs = [d for src in read_text_docs(base / "val") for d in src]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(train_docs, trainers.BpeTrainer(
        vocab_size=s["vocab"], special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    eot, V = tok.token_to_id("<|endoftext|>"), tok.get_vocab_size()
    for name, docs in (("train", train_docs), ("val", val_docs)):
        enc = tok.encode_batch(docs, add_special_tokens=False)
        np.concatenate([np.asarray(e.ids + [eot], np.uint16) for e in enc]).tofile(work / f"{name}.bin")
    t_prep = time.time()
    train = np.memmap(work / "train.bin", dtype=np.uint16, mode="r")
    val = torch.from_numpy(np.memmap(work / "val.bin", dtype=np.uint16, mode="r").astype(np.int64))
    # -- train.py
    torch.manual_seed(seed)
    L, B = s["seq_len"], s["batch"]
    model = GPT(1, V, **s["model"])
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=s["lr"], betas=(0.9, 0.95))
    steps = s["budget_tokens"] // (B * L)
    rng = np.random.default_rng(seed)

    @torch.no_grad()
    def evaluate() -> tuple[float, int]:
        model.eval()
        tot, n = 0.0, 0
        starts = list(range(0, len(val) - 1, L))
        for i in range(0, len(starts), 16):
            rows = [val[a:a + L + 1] for a in starts[i:i + 16]]
            m = min(len(r) for r in rows)
            if m < L + 1:  # the last, shorter row alone
                for r in rows:
                    out = model(r[None, :-1])
                    tot += F.cross_entropy(out[0], r[1:], reduction="sum").item()
                    n += len(r) - 1
                continue
            xy = torch.stack(rows)
            out = model(xy[:, :-1])
            tot += F.cross_entropy(out.reshape(-1, V), xy[:, 1:].reshape(-1), reduction="sum").item()
            n += xy[:, 1:].numel()
        model.train()
        return tot / n, n

    evals, reached = [], None
    for step in range(1, steps + 1):
        for g in opt.param_groups:
            g["lr"] = s["lr"] * onecycle((step - 1) / steps)
        ix = rng.integers(0, len(train) - L - 1, B)
        buf = torch.from_numpy(np.stack([train[i:i + L + 1] for i in ix]).astype(np.int64))
        x, y = buf[:, :-1], buf[:, 1:]
        loss = F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % s["eval_every"] == 0 or step == steps:
            lv, n = evaluate()
            bpb = _bpb(lv, n, corpus["val_bytes"] + corpus["val_docs"])
            evals.append({"step": step, "tokens": step * B * L, "bpb": bpb, "loss": lv, "n": n,
                          "t": time.time() - t_launch})
            if target is not None and bpb <= target:
                reached = evals[-1]["t"]
                break
    return {"arm": "nanogpt_loop", "seed": seed, "time_to_target_s": reached, "evals": evals,
            "prep_s": t_prep - t_launch, "steps_planned": steps, "vocab_size": V,
            "train_tokens": int(len(train)), "val_tokens": int(len(val))}


class _Reached(Exception):
    pass


class _Wrapped:
    """A loader that passes the trainer's loader contract through to ``self.loader``."""
    loader: Any

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, e: int) -> None:
        self.loader.set_epoch(e)

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, s: dict) -> None:
        self.loader.load_state_dict(s)


class _StopAtTarget(_Wrapped):
    """The trainer's loaders, wrapped so the run ends at the first evaluation at or under the
    target (the trainer has no such stop): the eval loader notes when each evaluation's pass
    ends; the train loader reads the trainer's metrics file before its next batch."""

    def __init__(self, loader: Any, ev: "_TimedEval", metrics: Path, target: float | None,
                 to_bpb: Callable[[dict], float]):
        self.loader, self.ev, self.metrics, self.target, self.to_bpb = loader, ev, metrics, target, to_bpb
        self.seen = 0

    def __iter__(self) -> Iterator[Any]:
        for b in self.loader:
            if self.target is not None and len(self.ev.ends) > self.seen:
                self.seen = len(self.ev.ends)
                evals = [json.loads(x)["eval"] for x in self.metrics.read_text().splitlines() if '"eval"' in x]
                if evals and self.to_bpb(evals[-1]) <= self.target:
                    raise _Reached()
            yield b


class _TimedEval(_Wrapped):
    """The eval loader, made afresh for every evaluation (an equal footing with the plain loop's
    evaluation, which reads the same rows each time), noting when each evaluation's pass ends."""

    def __init__(self, make: Callable[[], Any]):
        self.make, self.loader, self.ends = make, make(), []

    def __iter__(self) -> Iterator[Any]:
        self.loader = self.make()
        yield from self.loader
        self.ends.append(time.time())


def curriculum_steps(s: dict[str, Any], sch: Any) -> int:
    """Global steps whose rows add up to the token budget under the curriculum."""
    tokens, step = 0, 0
    while tokens < s["budget_tokens"]:
        tokens += s["batch"] * sch.at(step, tokens)
        step += 1
    return step


def e2e_sluice(mode: str, seed: int, work: Path, corpus: dict[str, Any], t_launch: float,
               target: float | None, curriculum: bool = False) -> dict[str, Any]:
    """Sluice's recipe: ``shard_text`` of each source (the tokenizer learnt on the first and
    shared, as ``debian --shard`` and the text recipe do), ``TokenLoader`` over the three (every
    document once, packed, documents masked apart), the trainer with the plain loop's optimizer
    settings. ``curriculum``: rows grow by the sequence-length curriculum (the
    ``sluice_curriculum`` arm; the recipe's default has none, see ``E2E_ARMS``)."""
    from sluice.stages.data.text import TextShardConfig, shard_text
    from sluice.stages.load.tokens import SeqLenSchedule, TokenLoader
    from sluice.stages.train import TrainConfig, train
    from sluice.storage.tokens import open_token_split
    s = E2E[mode]
    base = Path(corpus["base"])
    paths = {"gcide": "gcide.jsonl", "fortunes": "fortunes.parquet", "pydocs": "pydocs"}
    first, tr, va = None, [], []
    for name in SOURCES:
        cfg = TextShardConfig(tokenizer_file=first, vocab_size=s["vocab"], progress=False, val_fraction=0.0)
        sm = shard_text(cfg, base / "train" / paths[name], work / "train" / name)
        first = first or sm.root
        tr.append(open_token_split(sm.root, "train"))
        # the validation text: every document kept (no dedup), the same tokenizer
        vcfg = TextShardConfig(tokenizer_file=first, vocab_size=s["vocab"], progress=False, val_fraction=0.0,
                               dedup=False)
        vm = shard_text(vcfg, base / "val" / paths[name], work / "val" / name)
        va.append(open_token_split(vm.root, "train"))
    t_prep = time.time()
    val_docs = sum(len(v) for v in va)
    L, B = s["seq_len"], s["batch"]
    cur, sch = s["curriculum"], None
    if curriculum:
        sch = SeqLenSchedule(start=cur["start"], end=L, step=cur["step"],
                             warmup_tokens=max(1, int(cur["warmup_frac"] * s["budget_tokens"])))
    steps = curriculum_steps(s, sch) if sch is not None else s["budget_tokens"] // (B * L)
    loader = TokenLoader(tr, seq_len=L, batch_size=B, seed=seed, seq_len_schedule=sch, prefetch=0)
    ev = _TimedEval(lambda: TokenLoader(va, seq_len=L, batch_size=16, seed=0, prefetch=0))
    vbytes = corpus["val_bytes"] + corpus["val_docs"]
    metrics = work / "metrics.jsonl"
    cfg = TrainConfig(model="gpt", num_classes=tr[0].vocab_size, model_kwargs=s["model"], optimizer="adamw",
                      lr=s["lr"], betas=(0.9, 0.95), weight_decay=0.1, clip_grad_norm=1.0, schedule="onecycle",
                      warmup_fraction=0.1, max_steps=steps, batch_size=B, progress=False, torch_threads=2, seed=seed,
                      eval_every_steps=s["eval_every"], log_every_steps=10, metrics_path=str(metrics))
    wrapped = _StopAtTarget(loader, ev, metrics, target, lambda e: _bpb(e["loss"], e["n"], vbytes))
    try:
        train(cfg, wrapped, ev)
    except _Reached:
        pass
    evals = [json.loads(x)["eval"] for x in metrics.read_text().splitlines() if '"eval"' in x]
    out, reached = [], None
    for e, t_end in zip(evals, ev.ends):
        bpb = _bpb(e["loss"], e["n"], vbytes)
        out.append({"step": e["step"], "bpb": bpb, "loss": e["loss"], "n": e["n"], "t": t_end - t_launch})
        if reached is None and target is not None and bpb <= target:
            reached = t_end - t_launch
    return {"arm": "sluice_curriculum" if curriculum else "sluice", "seed": seed, "time_to_target_s": reached,
            "evals": out, "prep_s": t_prep - t_launch,
            "steps_planned": steps, "vocab_size": int(tr[0].vocab_size), "val_docs_in_artifact": val_docs,
            "train_tokens": int(sum(t.record.tokens for t in tr)), "val_tokens": int(sum(v.record.tokens for v in va))}


def _e2e_child(args: argparse.Namespace) -> None:
    """One timed run in this fresh process (``--e2e-run ARM SEED``); prints its record as JSON."""
    mode, arm, seed = args.mode_name, args.e2e_run[0], int(args.e2e_run[1])
    corpus = json.loads(args.corpus)
    target = None if args.target is None else float(args.target)
    with tempfile.TemporaryDirectory(prefix="sluice-tokens-e2e-") as work:
        if arm == "nanogpt_loop":
            rec = e2e_baseline(mode, seed, Path(work), corpus, float(args.t_launch), target)
        else:
            rec = e2e_sluice(mode, seed, Path(work), corpus, float(args.t_launch), target,
                             curriculum=arm == "sluice_curriculum")
    rec["wall_s"] = time.time() - float(args.t_launch)
    print("E2E-RESULT " + json.dumps(rec), flush=True)


def _spawn(mode: str, arm: str, seed: int, corpus: dict[str, Any], target: float | None) -> dict[str, Any]:
    t = time.time()
    cmd = [sys.executable, "-m", "benchmarks.tokens", "--e2e-run", arm, str(seed), "--mode-name", mode,
           "--t-launch", repr(t), "--corpus", json.dumps(corpus)]
    if target is not None:
        cmd += ["--target", repr(target)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith("E2E-RESULT "):
            return json.loads(line[len("E2E-RESULT "):])
    return {"arm": arm, "seed": seed, "error": (p.stderr or p.stdout)[-2000:], "time_to_target_s": None}


def part_e2e(mode: str, calibrate: bool) -> dict[str, Any]:
    s = E2E[mode]
    corpus = e2e_corpus(mode)
    target = None if calibrate else s["target_bpb"]
    if target is None and not calibrate:
        log(f"e2e: no target is fixed for mode {mode!r} (run --part e2e --calibrate, then set E2E[mode]['target_bpb'])")
        return {"skipped": f"no target fixed for {mode} mode yet: --part e2e --calibrate records the sweep to read "
                           "one from", "settings": {k: v for k, v in s.items() if k != "target_bpb"}}
    seeds = (0,) if calibrate else (E2E_SEEDS if mode != "tiny" else (0,))
    runs: list[dict[str, Any]] = []
    for i, seed in enumerate(seeds):
        arms = E2E_ARMS[i % len(E2E_ARMS):] + E2E_ARMS[:i % len(E2E_ARMS)]  # the order rotated
        for arm in arms:
            r = _spawn(mode, arm, seed, corpus, target)
            runs.append(r)
            log(f"e2e {arm} seed {seed}: " + ("error " + r["error"][-300:] if "error" in r else
                f"time to target {r['time_to_target_s']}, last bpb {r['evals'][-1]['bpb'] if r['evals'] else None}"))
    out: dict[str, Any] = {"corpus": {k: v for k, v in corpus.items() if k != "base"},
                           "settings": {k: v for k, v in s.items() if k != "target_bpb"},
                           "target_bpb": target, "seeds": list(seeds), "runs": runs,
                           "target_rule": "the plain loop's bits per byte at 3/4 of its budget in the calibration "
                                          "sweep (seed 0), rounded up to 0.05; fixed before these runs"}
    if calibrate:
        out["note"] = "calibration: every arm to the end of the budget, no target; the target is read from these"
        return out
    out["summary"], out["goal"] = e2e_goal(runs)
    return out


def e2e_goal(runs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each arm's seconds to the target over the seeds, and the goal: the median of the recipe's
    default arm (``sluice``, never ``sluice_curriculum``) over the plain loop's; a seed that
    missed the target leaves no ratio."""
    summ = {}
    for arm in E2E_ARMS:
        ts = [r["time_to_target_s"] for r in runs if r["arm"] == arm]
        summ[arm] = {**_stats(ts), "misses": sum(t is None for t in ts), "per_seed": ts}
    b, sl = summ["nanogpt_loop"]["median"], summ["sluice"]["median"]
    ratio = sl / b if (b and sl and not summ["sluice"]["misses"]) else None
    return summ, {"wanted": GOALS["e2e_ratio"], "ratio": ratio,
                  "met": ratio is not None and ratio <= GOALS["e2e_ratio"]}


# ================================================================== main
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short windows, a smaller e2e: *_quick.json")
    ap.add_argument("--tiny", action="store_true", help="the smallest settings on a tiny corpus (the test)")
    ap.add_argument("--part", choices=["loader", "resume", "e2e"], action="append",
                    help="run only these parts (repeatable; default all); the others are kept from the file")
    ap.add_argument("--calibrate", action="store_true", help="e2e: record the sweep the target is read from")
    ap.add_argument("--out", default=None, help="results file (default benchmarks/results/tokens-<class>[_quick].json)")
    ap.add_argument("--e2e-run", nargs=2, metavar=("ARM", "SEED"), help=argparse.SUPPRESS)
    ap.add_argument("--mode-name", default="full", help=argparse.SUPPRESS)
    ap.add_argument("--t-launch", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--corpus", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--target", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.e2e_run:
        _e2e_child(args)
        return
    mode = "tiny" if args.tiny else "quick" if args.quick else "full"
    limit = TINY_LIMIT if mode == "tiny" else None
    parts = args.part or ["loader", "resume", "e2e"]
    stem = results_name("tokens") + ("_quick" if mode == "quick" else "_tiny" if mode == "tiny" else "")
    from benchmarks.common import RESULTS
    path = Path(args.out) if args.out else RESULTS / f"{stem}.json"
    rec: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    t0 = time.perf_counter()
    prov = describe_run("benchmarks.tokens", sys.argv[1:] if argv is None else argv)
    for part in parts:
        log(f"== {part} ({mode})")
        tp = time.perf_counter()
        if part == "loader":
            d = part_loader(mode, limit)
        elif part == "resume":
            d = part_resume(mode, limit)
        else:
            d = part_e2e(mode, args.calibrate)
        key = "e2e_calibration" if (part == "e2e" and args.calibrate) else part
        rec[key] = {**d, "seconds": time.perf_counter() - tp, "load_average_end": load_average(), **prov}
    rec.update(prov)
    rec["mode"] = mode
    rec["seeds"] = list(E2E_SEEDS)
    rec["goals_wanted"] = GOALS
    rec["load_average_end"] = load_average()
    rec["last_run_seconds"] = time.perf_counter() - t0
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rec, indent=1, default=float) + "\n")
    os.replace(tmp, path)
    print_tables(rec)
    print(f"wrote {path}")


def print_tables(rec: dict[str, Any]) -> None:
    if "loader" in rec:
        d = rec["loader"]
        rows = [{"arm": n, "tokens/s median": v["tokens_per_s"]["median"], "min": v["tokens_per_s"]["min"],
                 "max": v["tokens_per_s"]["max"], "cores busy": v["cores_busy"]["median"]}
                for n, v in d["summary"].items()]
        print(f"\nloader: (B, L) = ({d['batch']}, {d['seq_len']}), one core, {d['repeats']} x {d['window_s']} s")
        print(table(rows, ["arm", "tokens/s median", "min", "max", "cores busy"]))
        for g, v in d["goals"].items():
            print(f"  {g}: {v['value']:.2f}x (wanted >= {v['wanted']}) {'met' if v['met'] else 'missed'}")
    if "resume" in rec:
        d = rec["resume"]
        print(f"\nresume: 4 ranks stopped at step {d['stop_step']} of {d['steps_epoch0']}")
        rows = [{"world": w, "pass": v["pass"], "e0 repeated": v["epoch0"]["repeated"],
                 "e0 skipped": v["epoch0"]["skipped"], "e0 counts exact": v["epoch0"]["counts_exact"],
                 "e1 counts exact": v["epoch1"]["counts_exact"]} for w, v in d["worlds"].items()]
        print(table(rows, ["world", "pass", "e0 repeated", "e0 skipped", "e0 counts exact", "e1 counts exact"]))
    if "e2e" in rec and "skipped" in rec["e2e"]:
        print(f"\ne2e: skipped ({rec['e2e']['skipped']})")
    elif "e2e" in rec:
        d = rec["e2e"]
        print(f"\ne2e: target {d['target_bpb']} bits per byte")
        rows = [{"arm": r["arm"], "seed": r["seed"], "time to target s": r.get("time_to_target_s"),
                 "evals": len(r.get("evals", [])), "prep s": r.get("prep_s")} for r in d["runs"]]
        print(table(rows, ["arm", "seed", "time to target s", "evals", "prep s"]))
        print(f"  ratio {d['goal']['ratio']} (wanted <= {d['goal']['wanted']}) {'met' if d['goal']['met'] else 'missed'}")


if __name__ == "__main__":
    main()
