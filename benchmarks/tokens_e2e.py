"""``benchmarks.tokens --part e2e``: a small GPT from a fresh process to a validation loss (bits per
byte, so two tokenizers compare) fixed before the runs, per seed, arms interleaved; each arm
starts from the raw text and trains its own tokenizer and writes its own token files inside the
timing. Arms (``E2E_ARMS``): ``nanogpt_loop`` (nanoGPT's prepare.py and train.py), ``sluice`` (the
text recipe's default; the goal's arm) and ``sluice_curriculum`` (with the sequence-length
curriculum, recorded beside it). Each run is ``python -m benchmarks.tokens --e2e-run ARM SEED``.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from benchmarks.tokens_common import CACHE, GOALS, ROOT, SOURCES, _stats, debian_text, log
from sluice.stages.contracts import PassThroughLoader

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


class _Wrapped(PassThroughLoader):
    """A loader that passes the trainer's loader contract through to ``self.loader``."""


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
