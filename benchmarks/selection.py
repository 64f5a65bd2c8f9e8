"""Sample selection on noisy Fashion-MNIST: steps and seconds to target accuracy.

    python -m benchmarks.selection [--quick]

Uniform label noise (10% and 20%) is injected into the whole train file, so the holdout split
(for the irreducible-loss model) is as noisy as the train split, as a user's would be. Every
method trains the same small CNN with the same optimizer and trained batch ``n_b``; they
differ only in which samples fill the batch:

* ``uniform``: ``n_b`` shuffled samples (plain training, no scoring pass);
* ``loss`` / ``rho_loss``: top ``n_b`` of ``n_B`` shuffled candidates by loss / reducible loss;
* ``selective_backprop``: ``n_b`` of ``sb_nB`` candidates by percentile keep probability;
* ``importance``: ``n_b`` drawn by loss-proportional probabilities, loss weighted 1/(N p);
* ``rho_loss_noise_aware``: ``rho_loss`` scoring the target's loss under a uniform label-noise
  likelihood whose rate is 1 - the IL model's holdout accuracy (``SelectionConfig.label_noise``).

Seconds count training and selection (evaluation excluded); for the methods that need IL scores
(``rho_loss``, ``rho_loss_noise_aware``) the IL model's training and scoring time is added to
their time to each target (``seconds_to_<t>_with_il``): per run, and amortised over
``--il-reuses`` runs, as nightly runs reuse the scores while the data is unchanged. Figures are
the median over seeds (min and max beside it); a seed that misses a target makes the median a
miss only if half the seeds miss. ``final_acc`` is every method's test accuracy at the same step budget;
``uniform`` (the cheapest) trains on to ``--uniform-extend`` times the budget only so that its
steps and seconds to the targets are measured rather than left ``null``. Writes
``benchmarks/results/selection.json`` (per noise level and method: steps_to_target,
seconds_to_target for the higher target, final_acc at the step budget), ``selection_details.json`` (curves, per-seed figures, settings) and ``selection.png``.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from sluice.stages.data.sources.idx import read_idx
from sluice.stages.models import build_model
from sluice.stages.precision import resolve_amp
from sluice.stages.select import (ILModelConfig, SelectionConfig, build_selector, inject_label_noise,
                           irreducible_loss_scores)
from benchmarks.hostinfo import describe_run, load_average
from sluice.storage.atomic import write_json
from sluice.storage.fingerprint import combine, hash_files, hash_obj

DATA = Path("/usr/share/datasets/fashion-mnist")
RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ["uniform", "loss", "rho_loss", "selective_backprop", "importance"]
# rho_loss scored under a uniform label-noise likelihood whose rate is read off the IL model
# (1 - its holdout accuracy): SelectionConfig.label_noise
VARIANTS = {"rho_loss_noise_aware": "rho_loss"}
MEAN, STD = 0.2860, 0.3530


def load_fmnist():
    """uint8 train/test images and labels, plus a content fingerprint of the files."""
    files = [DATA / f"{p}-{k}-idx{d}-ubyte.gz" for p in ("train", "t10k")
             for k, d in (("images", 3), ("labels", 1))]
    arrays = [read_idx(f) for f in files]
    return arrays, hash_files(files)


def normalise(x: np.ndarray) -> torch.Tensor:
    return ((torch.from_numpy(np.array(x)).float() / 255.0 - MEAN) / STD).unsqueeze(1)


def amp(a: argparse.Namespace):
    """bf16 autocast (CPU) for every forward pass when ``--amp`` resolves to bf16; else a no-op."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=resolve_amp(a.amp) == "bf16")


@torch.no_grad()
def accuracy(model, x: torch.Tensor, y: torch.Tensor, a: argparse.Namespace, bs: int = 2000) -> float:
    model.eval()
    with amp(a):
        hits = sum(int((model(x[s:s + bs]).argmax(1) == y[s:s + bs]).sum())
                   for s in range(0, len(x), bs))
    model.train()
    return hits / len(x)


class Stream:
    """Epoch-wise shuffled indices, handed out ``k`` at a time (no sample repeats in an epoch)."""

    def __init__(self, n: int, seed: int):
        self.n, self.g, self.buf = n, torch.Generator().manual_seed(seed), torch.empty(0, dtype=torch.long)

    def take(self, k: int) -> torch.Tensor:
        while self.buf.numel() < k:
            self.buf = torch.cat([self.buf, torch.randperm(self.n, generator=self.g)])
        out, self.buf = self.buf[:k], self.buf[k:]
        return out


def run_method(method: str, a: argparse.Namespace, data: dict, il, noise_mask, seed: int,
               label_noise: float = 0.0) -> dict:
    """Train one method for ``a.steps`` steps; returns its accuracy curve and timings."""
    torch.manual_seed(seed)
    x, y, ex, ey = data["x"], data["y"], data["eval_x"], data["eval_y"]
    model = build_model("small_cnn", in_channels=1, num_classes=10, width=a.width)
    if a.channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.wd)
    n_cand = {"uniform": a.nb, "importance": a.nb, "selective_backprop": a.sb_nB}.get(method, a.nB)
    base = VARIANTS.get(method, method)
    name = "none" if method == "uniform" else base
    params = {}  # each method's own knobs (selection.params)
    if name in ("loss", "rho_loss", "selective_backprop"):
        params = {"label_noise": label_noise if method in VARIANTS else 0.0, "score_mode": a.score_mode,
                  "score_chunk": a.score_chunk}
    elif name == "importance":
        params = {"smoothing": a.smoothing}
    cfg = SelectionConfig(method=name, n_select=a.nb, seed=seed, params=params)
    sel = build_selector(cfg, il, candidate_size=n_cand, split_size=len(y), noise_mask=noise_mask)
    stream = Stream(len(y), seed)
    curve, train_s, cpu_s, noisy, n_sel = [], 0.0, 0.0, 0.0, 0.0
    last_noisy = last_sel = 0.0  # noisy share of the trained samples since the last eval
    # uniform may run on past the common budget, only to find when it reaches the targets
    total = a.steps * (a.uniform_extend if method == "uniform" else 1)
    final = final_noisy = None
    model.train()
    for step in range(1, total + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        idx = (torch.as_tensor(sel.sampler.sample(n_cand)) if method == "importance"
               else stream.take(n_cand))
        bx, by = x[idx], y[idx]
        if a.channels_last:
            bx = bx.contiguous(memory_format=torch.channels_last)
        if sel is None:
            weights, bidx = None, idx
            noisy += float(noise_mask[idx.numpy()].sum())
        else:
            with amp(a):
                b = sel(model, bx, by, idx)
            bx, by, bidx, weights = b.inputs, b.targets, b.indices, b.weights
            noisy += b.stats.get("sel_noisy", 0.0)
        n_sel += len(bidx)
        with amp(a):
            out = model(bx)
        per = F.cross_entropy(out.float(), by, reduction="none")
        loss = (per * weights).mean() if weights is not None else per.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if sel is not None:
            sel.observe(bidx, per.detach())
        train_s += time.perf_counter() - t0
        cpu_s += time.process_time() - c0
        if step % a.eval_every == 0 or step == a.steps or step == total:
            curve.append((step, round(train_s, 3), round(accuracy(model, ex, ey, a), 4),
                          round(cpu_s, 3),
                          round((noisy - last_noisy) / max(1.0, n_sel - last_sel), 4)))
            last_noisy, last_sel = noisy, n_sel
        if step == a.steps:  # the fixed budget every method is compared at
            final, seconds, cpu = accuracy(model, data["test_x"], data["test_y"], a), train_s, cpu_s
            final_noisy = noisy / max(1.0, n_sel)
    return {"curve": curve, "final_acc": round(final, 4), "seconds": round(seconds, 2),
            "cpu_seconds": round(cpu, 2), "steps_run": total,
            "noisy_selected_fraction": round(final_noisy, 4)}


def first_reach(curve: list, target: float) -> tuple[int | None, float | None, float | None]:
    """(step, wall seconds, CPU seconds) of the first evaluation at or above ``target``."""
    for step, secs, acc, cpu, *_ in curve:
        if acc >= target:
            return step, secs, cpu
    return None, None, None


def _median(values: list) -> float | None:
    """Median with a miss (None) counted as infinitely slow; None when it lands on a miss."""
    keyed = sorted(float("inf") if v is None else v for v in values)
    m = statistics.median(keyed)
    return None if m == float("inf") else round(m, 2)


def summarise(runs: list[dict], targets: list[float], il_seconds: float = 0.0,
              il_reuses: int = 1) -> dict:
    """Medians over seeds (min-max and per-seed values kept); ``il_seconds`` (the IL model's
    training and scoring) is added to the times of a method that needs it, once per run and
    amortised over ``il_reuses`` runs."""
    out: dict = {"final_acc": round(statistics.median(r["final_acc"] for r in runs), 4),
                 "final_acc_per_seed": [r["final_acc"] for r in runs]}
    for t in targets:
        hits = [first_reach(r["curve"], t) for r in runs]
        secs = [h[1] for h in hits]
        out[f"steps_to_{t}"] = _median([h[0] for h in hits])
        out[f"seconds_to_{t}"] = _median(secs)
        out[f"seconds_to_{t}_per_seed"] = secs
        out[f"seconds_to_{t}_range"] = [min((s for s in secs if s is not None), default=None),
                                        None if None in secs else max(secs)]
        out[f"cpu_seconds_to_{t}"] = _median([h[2] for h in hits])
        if il_seconds:
            out[f"seconds_to_{t}_with_il"] = _median([None if s is None else s + il_seconds for s in secs])
            out[f"seconds_to_{t}_with_il_amortised"] = _median(
                [None if s is None else s + il_seconds / il_reuses for s in secs])
    hi = max(targets)
    out["steps_to_target"], out["seconds_to_target"] = out[f"steps_to_{hi}"], out[f"seconds_to_{hi}"]
    out["seconds_to_target_with_il"] = out.get(f"seconds_to_{hi}_with_il", out["seconds_to_target"])
    out["noisy_selected_fraction"] = round(statistics.median(r["noisy_selected_fraction"] for r in runs), 4)
    out["train_seconds"] = round(statistics.median(r["seconds"] for r in runs), 2)
    out["train_cpu_seconds"] = round(statistics.median(r["cpu_seconds"] for r in runs), 2)
    return out


def prepare(level: float, a: argparse.Namespace, arrays, base_fp: str, scores_root: str):
    """Noisy train/holdout split for one noise level, and its IL scores (cached artifact)."""
    (tr_x, tr_y, te_x, te_y) = arrays
    noise = inject_label_noise(tr_y, level, 10, seed=a.noise_seed)
    perm = np.random.default_rng(0).permutation(len(tr_y))
    hold, train = perm[:a.holdout], perm[a.holdout:a.holdout + a.train_size]
    fp = combine(base_fp, hash_obj({"noise": level, "noise_seed": a.noise_seed,
                                    "holdout": a.holdout, "train_size": a.train_size}))
    il_cfg = ILModelConfig(model_kwargs={"width": a.il_width, "hidden": a.il_hidden},
                           epochs=a.il_epochs, lr=a.il_lr, batch_size=128, optimizer="adamw",
                           amp=a.amp, progress=False)
    il = irreducible_loss_scores(il_cfg, tr_x[hold], noise.labels[hold], tr_x[train],
                                 noise.labels[train], fp, scores_root)
    order = np.random.default_rng(1).permutation(len(te_y))
    ev, fin = order[:a.eval_size], order[:a.final_size]
    data = {"x": normalise(tr_x[train]), "y": torch.from_numpy(noise.labels[train]).long(),
            "test_x": normalise(te_x[fin]), "test_y": torch.from_numpy(te_y[fin].astype(np.int64)),
            "eval_x": normalise(te_x[ev]), "eval_y": torch.from_numpy(te_y[ev].astype(np.int64))}
    return data, il, noise.mask[train], fp


def plot(curves: dict, path: Path) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed (pip install matplotlib): no plot written"
    fig, axes = plt.subplots(2, len(curves), figsize=(6 * len(curves), 7.5), squeeze=False,
                             sharex="col", gridspec_kw={"height_ratios": [2, 1]})
    for col, (level, by_method) in enumerate(curves.items()):
        top, bottom = axes[0][col], axes[1][col]
        for method, runs in by_method.items():
            steps = [p[0] for p in runs[0]["curve"]]
            acc = np.mean([[p[2] for p in r["curve"]] for r in runs], axis=0)
            top.plot(steps, acc, label=method)
            if all(len(p) > 4 for r in runs for p in r["curve"]):
                bottom.plot(steps, np.mean([[p[4] for p in r["curve"]] for r in runs], axis=0),
                            label=method)
        top.set(title=f"Fashion-MNIST, {float(level):.0%} label noise",
                ylabel="test accuracy (eval subset)")
        top.set_ylim(0.6, 0.95)
        bottom.axhline(float(level), color="grey", lw=0.8, ls=":")
        bottom.set(xlabel="gradient steps", ylabel="noisy share of trained samples")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
        top.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="1 seed, 200 steps, smaller split, targets 0.8/0.85 (~3 min on 2 cores)")
    p.add_argument("--seeds", type=int)
    p.add_argument("--steps", type=int, help="gradient-step budget per run")
    p.add_argument("--levels", type=float, nargs="+", default=[0.1, 0.2])
    p.add_argument("--targets", type=float, nargs="+",
                   help="accuracy targets (default 0.85 0.88; --quick: 0.8 0.85)")
    p.add_argument("--methods", nargs="+", default=METHODS + list(VARIANTS),
                   choices=METHODS + list(VARIANTS))
    p.add_argument("--nb", type=int, default=64, help="trained batch n_b (all methods)")
    p.add_argument("--nB", type=int, default=320,
                   help="candidates n_B for loss / rho_loss (n_b/n_B = 20%%: the paper's 10%% takes "
                        "fewer steps but each costs more; see docs/selection.md)")
    p.add_argument("--uniform-extend", dest="uniform_extend", type=int, default=2,
                   help="uniform runs on to this multiple of --steps to find when it reaches the "
                        "targets (its final_acc is still taken at --steps)")
    p.add_argument("--sb-nB", dest="sb_nB", type=int, default=128,
                   help="candidates for selective backprop (keeps ~1/(1+beta) of them)")
    p.add_argument("--score-mode", choices=["train", "eval"], default="train")
    p.add_argument("--score-chunk", dest="score_chunk", type=int, default=64,
                   help="score candidates this many at a time (0: one pass; 64 is ~25%% cheaper per "
                        "sample than one pass over 384 on one CPU core)")
    p.add_argument("--width", type=int, default=32, help="small_cnn width (same for all)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--amp", choices=["auto", "none", "bf16"], default="auto",
                   help="autocast for every forward (scoring, training, eval); all methods alike; "
                        "auto = bf16 only on CPUs with native bf16 (else ~10x slower than fp32)")
    p.add_argument("--no-channels-last", dest="channels_last", action="store_false",
                   help="keep NCHW (channels-last is faster on CPU in fp32 and bf16 alike)")
    p.add_argument("--wd", type=float, default=0.01)
    p.add_argument("--smoothing", type=float, default=0.5, help="importance sampling")
    p.add_argument("--holdout", type=int, help="holdout samples for the IL model")
    p.add_argument("--train-size", dest="train_size", type=int)
    p.add_argument("--il-epochs", dest="il_epochs", type=int)
    p.add_argument("--il-lr", dest="il_lr", type=float, default=2e-3)
    p.add_argument("--il-width", dest="il_width", type=int, default=32, help="IL model: small_cnn width")
    p.add_argument("--il-hidden", dest="il_hidden", type=int, default=256,
                   help="IL model: dense head units (0: pooled head); a stronger IL model keeps "
                        "RHO-LOSS filtering noise for longer")
    p.add_argument("--eval-every", dest="eval_every", type=int)
    p.add_argument("--eval-size", dest="eval_size", type=int, help="test samples per curve point")
    p.add_argument("--final-size", dest="final_size", type=int, help="test samples for final_acc")
    p.add_argument("--noise-seed", dest="noise_seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per process (1 is steadiest on shared cores)")
    p.add_argument("--jobs", type=int, default=2,
                   help="(noise level, seed) runs in parallel processes; each method's seconds are "
                        "measured inside one process, so compare methods within a run")
    p.add_argument("--scores-root", dest="scores_root", help="reuse IL scores across runs")
    p.add_argument("--il-reuses", dest="il_reuses", type=int, default=7,
                   help="runs one IL model's scores serve (a week of nightly runs on unchanged data)")
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args(argv)
    a.score_chunk = a.score_chunk or None
    quick = dict(seeds=1, steps=200, holdout=3000, train_size=12000, il_epochs=3, eval_every=20,
                 eval_size=1000, final_size=4000, targets=[0.8, 0.85])
    full = dict(seeds=3, steps=3000, holdout=10000, train_size=50000, il_epochs=10, eval_every=100,
                eval_size=3000, final_size=10000, targets=[0.85, 0.88])
    for k, v in (quick if a.quick else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    return a


def level_il(level: float, a: argparse.Namespace, scores_root: str) -> dict:
    """Train (or reuse) one noise level's IL model; returns its cost line."""
    torch.set_num_threads(a.threads)
    arrays, base_fp = load_fmnist()
    _, il, _, fp = prepare(level, a, arrays, base_fp, scores_root)
    cost = il.extra
    print(f"[noise {level:.0%}] IL model: train {cost['train_seconds']:.1f}s on "
          f"{cost['holdout_size']} holdout samples + score {cost['score_seconds']:.1f}s on "
          f"{len(il)} train samples (holdout acc {cost['holdout_accuracy']:.3f}, "
          f"reused={cost['reused']})", flush=True)
    return {"il_cost": cost, "fingerprint": fp}


def level_seed(level: float, seed: int, a: argparse.Namespace, scores_root: str) -> dict:
    """Every method for one noise level and seed (one process each with ``--jobs``); the IL
    scores come from ``scores_root``, where ``level_il`` left them."""
    torch.set_num_threads(a.threads)
    arrays, base_fp = load_fmnist()
    data, il, mask, _ = prepare(level, a, arrays, base_fp, scores_root)
    runs = {}
    for m in a.methods:
        r = runs[m] = run_method(m, a, data, il.values, mask, seed,
                                 label_noise=round(1 - il.extra["holdout_accuracy"], 4))
        print(f"[noise {level:.0%}] seed {seed} {m:>18}: final {r['final_acc']:.4f}  "
              f"{r['seconds']:.1f}s wall {r['cpu_seconds']:.1f}s cpu  "
              f"noisy-selected {r['noisy_selected_fraction']:.3f}", flush=True)
    return runs


def _map(fn, jobs: int, *arg_lists) -> list:
    """``map`` over spawned processes when ``jobs > 1`` (each run stays single-process inside)."""
    if jobs <= 1 or len(arg_lists[0]) <= 1:
        return list(map(fn, *arg_lists))
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(min(jobs, len(arg_lists[0])), mp_context=mp.get_context("spawn")) as ex:
        return list(ex.map(fn, *arg_lists))


def main(argv=None) -> dict:
    a = parse(argv)
    t_start = time.perf_counter()
    scores_root = a.scores_root or tempfile.mkdtemp(prefix="sluice-bench-scores-")
    n = len(a.levels)
    ils = _map(level_il, a.jobs, a.levels, [a] * n, [scores_root] * n)
    pairs = [(lv, s) for lv in a.levels for s in range(a.seeds)]
    per_pair = _map(level_seed, a.jobs, [p[0] for p in pairs], [p[1] for p in pairs],
                    [a] * len(pairs), [scores_root] * len(pairs))
    levels: dict = {}
    hi = max(a.targets)
    for level, il in zip(a.levels, ils):
        runs = {m: [r[m] for (lv, _), r in zip(pairs, per_pair) if lv == level] for m in a.methods}
        il_s = il["il_cost"]["train_seconds"] + il["il_cost"]["score_seconds"]
        summary = {m: summarise(runs[m], a.targets, il_s if VARIANTS.get(m, m) == "rho_loss" else 0.0,
                                a.il_reuses) for m in a.methods}
        goal = None
        if "uniform" in summary and "rho_loss" in summary:
            u, r = summary["uniform"]["seconds_to_target"], summary["rho_loss"]["seconds_to_target_with_il"]
            goal = {"target": hi, "uniform_s": u, "rho_loss_with_il_s": r,
                    "ratio": round(r / u, 3) if u and r else None, "met": bool(u and r and r < u)}
        levels[str(level)] = {**il, "il_seconds": round(il_s, 2), "summary": summary, "runs": runs,
                              "goal_rho_loss_with_il_faster_than_uniform": goal}
    keep = ("steps_to_target", "seconds_to_target", "seconds_to_target_with_il",
            f"seconds_to_{hi}_range", "final_acc")
    about = describe_run("benchmarks.selection", argv)
    results = {**about, "seeds": list(range(a.seeds)), "targets": a.targets, "il_reuses": a.il_reuses,
               "mode": "quick" if a.quick else "full", "load_average_end": load_average(),
               "levels": {k: {"il_seconds": d["il_seconds"],
                              "goal_rho_loss_with_il_faster_than_uniform": d["goal_rho_loss_with_il_faster_than_uniform"],
                              "methods": {m: {f: s.get(f) for f in keep} for m, s in d["summary"].items()}}
                          for k, d in levels.items()}}
    details = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
               "levels": levels, "total_seconds": round(time.perf_counter() - t_start, 1)}
    a.out.mkdir(parents=True, exist_ok=True)
    stem = "selection_quick" if a.quick else "selection"
    write_json(a.out / f"{stem}.json", results)
    write_json(a.out / f"{stem}_details.json", details)
    note = plot({k: d["runs"] for k, d in levels.items()}, a.out / f"{stem}.png")
    print_table(details, a)
    if note:
        print(note)
    print(f"total {details['total_seconds']}s; wrote {a.out / (stem + '.json')}")
    return results


def print_table(details: dict, a: argparse.Namespace) -> None:
    lo, hi = min(a.targets), max(a.targets)
    print(f"\nn_b={a.nb}, n_B={a.nB} (loss/rho_loss), sb n_B={a.sb_nB}, steps={a.steps}, "
          f"seeds={a.seeds}, small_cnn width {a.width}, AdamW lr {a.lr}")
    print(f"{'noise':>5} {'method':>18} {'steps@' + str(lo):>11} {'secs@' + str(lo):>10} "
          f"{'steps@' + str(hi):>11} {'secs@' + str(hi):>10} {'cpu@' + str(hi):>9} {'final':>7} "
          f"{'noisy sel':>9}")
    for level, d in details["levels"].items():
        c = d["il_cost"]
        print(f"{level:>5} {'IL model (once)':>18}  train {c['train_seconds']}s + score "
              f"{c['score_seconds']}s")
        for m, s in d["summary"].items():
            f = lambda v: "-" if v is None else str(v)  # noqa: E731
            print(f"{level:>5} {m:>18} {f(s[f'steps_to_{lo}']):>11} {f(s[f'seconds_to_{lo}']):>10} "
                  f"{f(s[f'steps_to_{hi}']):>11} {f(s[f'seconds_to_{hi}']):>10} "
                  f"{f(s[f'cpu_seconds_to_{hi}']):>9} "
                  f"{s['final_acc']:>7.4f} {s['noisy_selected_fraction']:>9.3f}"
                  + (f"   with IL: {f(s.get(f'seconds_to_{hi}_with_il'))}s per run, "
                     f"{f(s.get(f'seconds_to_{hi}_with_il_amortised'))}s amortised"
                     if f"seconds_to_{hi}_with_il" in s else ""))
        g = d.get("goal_rho_loss_with_il_faster_than_uniform")
        if g:
            print(f"{level:>5} goal: rho_loss incl. IL {f(g['rho_loss_with_il_s'])}s vs uniform "
                  f"{f(g['uniform_s'])}s to {g['target']}: {'met' if g['met'] else 'MISSED'}")


if __name__ == "__main__":
    main()
