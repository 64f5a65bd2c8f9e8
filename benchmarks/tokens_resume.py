"""``benchmarks.tokens --part resume``: a weighted three-source mixture packed at 4 ranks, stopped
mid-epoch, resumed at 1, 2, 3 and 6 ranks and run through a second epoch; every epoch's rows
checked against an uninterrupted 1-rank run (no token position repeated or skipped, the same
tokens, per-source counts exactly the mixture's), and ``DistributedSampler`` on the same stop.
"""
from __future__ import annotations

import time
from fractions import Fraction
from typing import Any

import numpy as np

from benchmarks.tokens_common import SOURCES, debian_artifacts, log, open_train

# ------------------------------------------------------------------ settings per mode
RESUME = {"full": {"epoch_size": 7919, "weights": (0.71, 0.23, 0.06), "stop_frac": 0.37,
                   "seq": (32, 128), "global_batch": 24},
          "quick": {"epoch_size": 2003, "weights": (0.71, 0.23, 0.06), "stop_frac": 0.37,
                    "seq": (32, 128), "global_batch": 24},
          "tiny": {"epoch_size": 97, "weights": (0.71, 0.23, 0.06), "stop_frac": 0.37,
                   "seq": (8, 32), "global_batch": 24}}
RESUME_WORLDS = (1, 2, 3, 6)


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
                ids = b.inputs["input_ids"]  # (B, L): L is this step's row length
                keep = (b.indices >= 0).numpy()  # a row's start in the epoch's stream; -1: padding
                for i in np.nonzero(keep)[0]:
                    rows.setdefault(e, []).append((int(b.indices[i]), ids.shape[1], ids[i].numpy(),
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
