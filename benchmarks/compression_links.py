"""Gradient compression where bytes cost time: two simulated nodes (deploy/simcluster: one
network namespace and one core each) joined by a link shaped to 100 Mbit/s, 1 Gbit/s or
10 Gbit/s, one DDP rank per node over gloo, through ``sluice.stages.run.nodes.launch_nodes``
(real torchrun, c10d rendezvous on node 0). Run as ``python -m benchmarks.compression --link ...``.

Per link rate, model and mode it reports wall-clock seconds to the target accuracy, bytes per
step, the fraction of step time spent communicating and the final accuracy:

* target: the uncompressed run's final accuracy minus 1 point (same seed); ``seconds_to_target``
  is the training clock (eval time excluded, every step counted) at the first evaluation that
  reaches it. The PowerSGD goal compares it with the uncompressed run's whole training clock.
* ``comm_fraction``: 1 - (the compute-only step time) / (the mode's step time), where the
  compute-only step is the same model and per-rank batch on one node with no DDP (measured in
  the same cluster, seed and rate, just before the modes): the share of a step that
  communication, compression and waiting for the peer add. ``hook_busy_fraction``: the share of the step the compression thread was busy.
* ``none`` is DDP's own bucketed all-reduce (overlapped with the backward pass); PowerSGD's hook
  overlaps the same way (its thread takes buckets as DDP hands them over).

Budgets are fixed before the run or by a recorded sweep: the uncompressed run trains for the
model's ``steps``; a compressed mode, which loses some accuracy per step, trains for the smallest
of ``BUDGET_SWEEP`` (1, 1.25, 1.5, 2 times those steps, one-cycle over each) whose first-seed run
reaches the target, and seeds 1 and 2 train for that budget; every point of the sweep is in the
JSON (``budgets``). The same batch, learning-rate schedule shape, evaluation cadence and test
images for every mode; seeds 0, 1, 2; rates, models and modes interleaved within each seed (mode
order alternating) so the host's drift falls on all of them alike.

The full sweep takes ~85 min here (3 rates, 2 models, 3 seeds). ``--merge`` runs only the rates given and merges them into an
existing ``compression_links.json`` of the same settings, keeping its other rates (each rate
records its own commit, time and load): the modes compared at one rate always ran side by side,
while rates measured in different sessions are compared across host drift (the file says so).

    python -m benchmarks.compression --link 100mbit --merge   # then 1gbit, then 10gbit
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.common import table
from benchmarks.hostinfo import describe_run
from deploy.simcluster import SimCluster, netadmin_missing, rate_bits
from sluice.stages.run.launch import make_job, prepare_run
from sluice.stages.train.rank import TrainResult
from sluice.stages.run.nodes import launch_nodes
from sluice.storage.atomic import write_json

RESULTS = Path(__file__).resolve().parent / "results"
RATES = ("100mbit", "1gbit", "10gbit")
MODELS: dict[str, dict[str, Any]] = {
    # the dense-head SmallCNN: 871k parameters (3.5 MB of fp32 gradient), 92% in one matrix
    "small_cnn_dense": {"model": "small_cnn", "model_kwargs": {"width": 32, "hidden": 256},
                        "batch_size": 64, "steps": 300},
    # a ResNet-9-like net at width 40: 1.03M parameters (4.1 MB) in 3x3 convolutions
    "resnet_small": {"model": "resnet_small", "model_kwargs": {"width": 40},
                     "batch_size": 32, "steps": 200},
}
START_ITER = 20
MODES = {"none": {"mode": "none"},
         "powersgd_rank2": {"mode": "powersgd", "params": {"rank": 2, "start_iter": START_ITER,
                                                           "error_feedback": True, "warm_start": True}}}
EVAL_EVERY = 25
# a compressed mode may need more steps than the uncompressed run to reach the same accuracy; it
# trains for the smallest of these multiples of the uncompressed budget that reaches the target
# on the first seed (a recorded sweep, one per rate), and every later seed uses that budget
BUDGET_SWEEP = (1.0, 1.25, 1.5, 2.0)
QUICK_BUDGET_SWEEP = (1.0, 1.5)
TEST_IMAGES = 5000
COMPUTE_STEPS = 40
PROBE = ("import socket,time\ns=socket.socket();s.bind(('0.0.0.0',5001));s.listen();c,_=s.accept()\n"
         "n,t=0,time.time()\nwhile (d:=c.recv(1<<20)):\n    n+=len(d)\nprint(n*8/(time.time()-t)/1e6)")
SEND = ("import socket,time\nfor _ in range(100):\n    try:\n        c=socket.create_connection(('{a}',5001));break\n"
        "    except OSError: time.sleep(0.05)\nb=b'x'*(1<<20)\nfor _ in range({mb}): c.sendall(b)\nc.close()")


def base_config(model: str, seed: int, steps: int) -> dict[str, Any]:
    m = MODELS[model]
    return {"model": m["model"], "model_kwargs": m["model_kwargs"], "max_steps": steps,
            "batch_size": m["batch_size"], "lr": 0.1, "schedule": "onecycle",
            "warmup_fraction": 0.15, "weight_decay": 5e-4, "seed": seed, "progress": False,
            "torch_threads": 1, "log_every_steps": 1, "channels_last": True,
            "normalize_mean": [0.2860], "normalize_std": [0.3530],
            "eval_every_steps": EVAL_EVERY}


def data_specs(quick: bool) -> tuple[dict, dict]:
    return ({"kind": "arrays", "path": "fashion-mnist:train"},
            {"kind": "arrays", "path": "fashion-mnist:test", "batch_size": 500,
             "limit": 2000 if quick else TEST_IMAGES})


def probe_link(c: SimCluster) -> float:
    """Measured TCP throughput node 1 -> node 0, Mbit/s (one stream, ~1.5 s)."""
    mb = int(min(1000, max(8, rate_bits(c.rate or "10gbit") / 8 / 1e6 * 1.5))) if c.rate else 1000
    srv = c.nodes[0].popen([sys.executable, "-c", PROBE], stdout=subprocess.PIPE, text=True)
    c.nodes[1].run([sys.executable, "-c", SEND.format(a=c.nodes[0].address, mb=mb)], check=True, timeout=120)
    return float(srv.communicate(timeout=120)[0])


def compute_only(c: SimCluster, model: str, seed: int, specs: tuple[dict, dict], out: Path) -> float:
    """Median step time of the same model and per-rank batch on node 0 alone (no DDP)."""
    cfg = {**base_config(model, seed, COMPUTE_STEPS), "eval_every_steps": None}
    _, job, _ = prepare_run(make_job(cfg, specs[0], None), out)
    r = c.nodes[0].run([sys.executable, "-m", "sluice.stages.train.rank", "--job", str(job)],
                       capture_output=True, text=True, timeout=1200)
    if r.returncode != 0:
        raise RuntimeError(f"compute-only run failed:\n{(r.stdout + r.stderr)[-3000:]}")
    res = TrainResult.from_dict(json.loads((out / "result.json").read_text()))
    return statistics.median(m["step_s"] for m in res.metrics[5:])


def one_run(c: SimCluster, model: str, mode: str, seed: int, steps: int, specs: tuple[dict, dict],
            out: Path) -> dict[str, Any]:
    cfg = {**base_config(model, seed, steps), "comm": MODES[mode]}
    t0 = time.time()
    r = launch_nodes(make_job(cfg, *specs), {"nodes": [n.spec() for n in c.nodes], "rdzv_timeout_s": 120},
                     nproc=1, out_dir=out, timeout_s=3600, on_line=lambda line: None)
    ms = r.metrics
    steady = [m for m in ms[5:] if mode == "none" or m["step"] > START_ITER + 2] or ms
    return {"final_acc": r.final_acc, "steps": r.steps, "train_clock_s": r.summary["elapsed_s"],
            "wall_s": time.time() - t0,
            "step_s": statistics.median(m["step_s"] for m in steady),
            "bytes_per_step": statistics.median(m["bytes_comm"] for m in steady),
            "bytes_per_step_whole_run": r.summary["bytes_per_step"],
            "uncompressed_bytes": r.summary["uncompressed_bytes"],
            "hook_busy_fraction": statistics.median(m["comm_busy_s"] / m["step_s"] for m in steady),
            "evals": [(e["step"], e["elapsed_s"], e["acc"]) for e in r.evals],
            "param_digests_equal": len(set(r.summary["param_digests"])) == 1}


def seconds_to(evals: list[tuple[int, float, float]], target: float) -> float | None:
    return next((t for _, t, acc in evals if acc >= target - 1e-9), None)


def _agg(xs: list[float | None]) -> dict[str, Any]:
    vals = [x for x in xs if x is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0, "missing": len(xs)}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals),
            "missing": len(xs) - len(vals)}


def summarise(raw: dict, compute: dict, links: dict) -> dict[str, Any]:
    """Per rate, model and mode: medians (min-max) over seeds, and each seed's figures
    (``compute``: the compute-only step time by rate, model and seed)."""
    out: dict[str, Any] = {}
    for rate, per_model in raw.items():
        for model, per_mode in per_model.items():
            seeds = sorted(per_mode["none"])
            for mode, runs in per_mode.items():
                rows = []
                for s in seeds:
                    if s not in runs or "error" in runs[s] or "error" in per_mode["none"].get(s, {}):
                        continue
                    run, base = runs[s], per_mode["none"][s]
                    target = base["final_acc"] - 0.01
                    stt = seconds_to(run["evals"], target)
                    rows.append({"seed": s, "target_acc": target, "seconds_to_target": stt,
                                 "vs_uncompressed_wall": None if stt is None else stt / base["train_clock_s"],
                                 "comm_fraction": max(0.0, 1 - compute[rate][model][s] / run["step_s"]),
                                 "steps": run.get("steps"), "budget_multiplier": run.get("budget_multiplier", 1.0),
                                 **{k: run[k] for k in ("final_acc", "step_s", "bytes_per_step",
                                                        "bytes_per_step_whole_run", "train_clock_s",
                                                        "hook_busy_fraction", "param_digests_equal")}})
                agg = {k: _agg([r[k] for r in rows]) for k in (
                    "seconds_to_target", "vs_uncompressed_wall", "bytes_per_step", "comm_fraction",
                    "final_acc", "step_s", "train_clock_s", "hook_busy_fraction", "steps")}
                out.setdefault(rate, {"measured_mbit": _agg(links.get(rate, []))}).setdefault(model, {})[mode] = {
                    **{k: v["median"] for k, v in agg.items()}, "spread": agg, "seeds": rows}
    return out


def crossover(summary: dict[str, Any], model: str) -> dict[str, Any]:
    """Where PowerSGD stops winning: the bracket between measured rates, and the rate where
    the per-step times, fitted as a + b/throughput over the measured throughputs, cross."""
    pts = []
    for rate, per in summary.items():
        m = per.get(model, {})
        if "none" in m and "powersgd_rank2" in m and per["measured_mbit"]["median"]:
            pts.append((rate_bits(rate), per["measured_mbit"]["median"], m["none"], m["powersgd_rank2"]))
    pts.sort()
    wins = {f"{r / 1e6:g}mbit": (p["seconds_to_target"] is not None and n["seconds_to_target"] is not None
                                 and p["seconds_to_target"] < n["seconds_to_target"]) for r, _, n, p in pts}
    return {"powersgd_faster_to_target": wins,
            "fitted_crossover_mbit": _fitted_crossover(pts, "step_s"),
            "fitted_time_to_target_crossover_mbit": _fitted_crossover(pts, "seconds_to_target")}


def _fitted_crossover(pts: list[tuple], key: str) -> float | None:
    """Measured Mbit/s where ``key`` of the two modes, each fitted as a + b / throughput over
    the rates, is equal (PowerSGD ahead below it); None when the fits do not cross."""
    pts = [p for p in pts if p[2][key] is not None and p[3][key] is not None]
    if len(pts) < 2:
        return None
    import numpy as np
    x = np.array([1 / mbit for _, mbit, _, _ in pts])
    bn, an = np.polyfit(x, [n[key] for *_, n, _ in pts], 1)
    bp, ap = np.polyfit(x, [p[key] for *_, p in pts], 1)
    if bn != bp and (ap - an) / (bn - bp) > 0:
        return float(1 / ((ap - an) / (bn - bp)))
    return None


def resummarise(path: Path, argv: list[str]) -> None:
    """Recompute an existing results file's summary and goals from its raw runs (after a change
    to the summary code), recording the command and commit that did it."""
    d = json.loads(path.read_text())
    d = {**d, "raw": _int_seeds(d["raw"], 3), "compute_only_step_s": _int_seeds(d["compute_only_step_s"], 2)}
    prov = describe_run("benchmarks.compression", argv)
    d["_about"]["resummarised"] = {"command": prov["command"], "commit": prov["commit"],
                                   "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_results(d, list(d["_about"]["models"]), path)


def write_results(res: dict[str, Any], models: list[str], out: Path) -> None:
    """Summarise ``res`` (its raw runs keyed by int seeds), print the table and goals, and write
    it with its summary and goals, atomically."""
    summary = summarise(res["raw"], res["compute_only_step_s"], res["link_mbit"])
    g = goals(summary, models)
    print(report(summary, models))
    print(json.dumps(g, indent=1))
    write_json(out, {**{k: v for k, v in res.items() if k not in ("goals", "summary")},
                     "goals": g, "summary": summary}, default=str)
    print(f"wrote {out}")


def budget_entry(mult: float, res: dict[str, Any], target: float | None) -> dict[str, Any]:
    """One point of a budget sweep: its steps, final accuracy and when it reached the target."""
    if "error" in res:
        return {"multiplier": mult, "error": res["error"]}
    stt = None if target is None else seconds_to(res["evals"], target)
    return {"multiplier": mult, "steps": res["steps"], "final_acc": res["final_acc"],
            "train_clock_s": res["train_clock_s"], "target_acc": target, "seconds_to_target": stt,
            "reached": stt is not None}


def sweep_budget(target: float | None, first: dict[str, Any], multipliers: tuple[float, ...],
                 train: Callable[[float], dict[str, Any]]) -> tuple[float, dict[str, Any], list[dict[str, Any]]]:
    """The smallest step budget (a multiple of the uncompressed run's) whose run reaches the target.

    ``first`` is the run at ``multipliers[0]``; ``train(mult)`` runs another. Returns the chosen
    multiplier, its run and every point tried; when none reaches the target (or there is no
    target: the uncompressed run failed) the largest budget tried stands, marked not reached."""
    mult, res = multipliers[0], first
    points = [budget_entry(mult, res, target)]
    for bigger in multipliers[1:]:
        if target is None or points[-1].get("reached"):
            break
        mult, res = bigger, train(bigger)
        points.append(budget_entry(mult, res, target))
    return mult, res, points


def run(rates: list[str], models: list[str], seeds: list[int], quick: bool) -> dict[str, Any]:
    """Every seed, rate, model and mode. On the first seed each compressed mode also sweeps its step
    budget (``budget_sweep``): the smallest multiple of the uncompressed budget that reaches the
    target is what the later seeds train for at that rate."""
    specs = data_specs(quick)
    multipliers = QUICK_BUDGET_SWEEP if quick else BUDGET_SWEEP
    raw: dict = {r: {m: {k: {} for k in MODES} for m in models} for r in rates}
    compute: dict = {r: {m: {} for m in models} for r in rates}
    links: dict = {r: [] for r in rates}
    budgets: dict = {r: {m: {} for m in models} for r in rates}  # compressed modes' swept budgets
    order = []
    with tempfile.TemporaryDirectory(prefix="sluice-links-") as tmp:
        for seed in seeds:
            for i, rate in enumerate(rates):
                with SimCluster(2, rate=rate) as c:
                    links[rate].append(probe_link(c))
                    print(f"seed {seed} {rate}: measured {links[rate][-1]:.0f} Mbit/s", flush=True)
                    for model in models:
                        steps = 40 if quick else MODELS[model]["steps"]
                        compute[rate][model][seed] = compute_only(c, model, seed, specs,
                                                                  Path(tmp) / f"compute-{rate}-{model}-{seed}")
                        print(f"  {model}: compute-only {compute[rate][model][seed]:.3f} s/step", flush=True)

                        def train(mode: str, mult: float) -> dict[str, Any]:
                            order.append(f"seed{seed}/{rate}/{model}/{mode}" + ("" if mult == 1 else f"/x{mult:g}"))
                            try:
                                res = one_run(c, model, mode, seed, round(steps * mult), specs,
                                              Path(tmp) / f"{seed}-{rate}-{model}-{mode}-x{mult:g}")
                            except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
                                res = {"error": f"{type(e).__name__}: {e}"[:2000]}
                                print(f"  {model} {mode} x{mult:g}: FAILED {res['error'][:300]}", flush=True)
                            else:
                                print(f"  {model} {mode} x{mult:g}: acc {res['final_acc']:.4f}, {res['step_s']:.3f} s/step, "
                                      f"{res['bytes_per_step'] / 1e6:.2f} MB/step, clock {res['train_clock_s']:.0f} s",
                                      flush=True)
                            return {**res, "budget_multiplier": mult}

                        per_mode = budgets[rate][model]
                        modes = list(MODES) if (seed + i) % 2 == 0 else list(reversed(MODES))
                        for mode in modes:
                            swept = mode != "none" and seed != seeds[0]
                            raw[rate][model][mode][seed] = train(mode, per_mode[mode]["multiplier"] if swept else 1.0)
                        if seed != seeds[0]:
                            continue
                        base = raw[rate][model]["none"][seed]
                        target = None if "error" in base else base["final_acc"] - 0.01
                        for mode in MODES:
                            if mode == "none":
                                continue
                            mult, res, points = sweep_budget(target, raw[rate][model][mode][seed], multipliers,
                                                             lambda m, mode=mode: train(mode, m))
                            raw[rate][model][mode][seed] = res
                            per_mode[mode] = {"multiplier": mult, "steps": round(steps * mult),
                                              "sweep_seed": seed, "sweep": points}
    return {"raw": raw, "compute_only_step_s": compute, "link_mbit": links, "budgets": budgets, "order": order}


def report(summary: dict[str, Any], models: list[str]) -> str:
    rows = []
    for rate, per in summary.items():
        for model in models:
            for mode, v in per.get(model, {}).items():
                rows.append({"link": rate, "Mbit/s": per["measured_mbit"]["median"], "model": model, "mode": mode,
                             "s_to_target": v["seconds_to_target"], "vs_none_wall": v["vs_uncompressed_wall"],
                             "MB/step": None if v["bytes_per_step"] is None else v["bytes_per_step"] / 1e6,
                             "comm_frac": v["comm_fraction"], "s/step": v["step_s"], "steps": v["steps"],
                             "acc": v["final_acc"]})
    return table(rows, ["link", "Mbit/s", "model", "mode", "s_to_target", "vs_none_wall", "MB/step",
                        "comm_frac", "s/step", "steps", "acc"])


def goals(summary: dict[str, Any], models: list[str]) -> dict[str, Any]:
    out = {}
    for model in models:
        g: dict[str, Any] = {}
        slow = summary.get("100mbit", {}).get(model)
        if slow:
            v = slow["powersgd_rank2"]["vs_uncompressed_wall"]
            g["100mbit_powersgd_vs_uncompressed_wall"] = {"median": v, "goal": "<= 0.4",
                                                          "met": v is not None and v <= 0.4}
        mid = summary.get("1gbit", {}).get(model)
        if mid:
            p, n = mid["powersgd_rank2"]["seconds_to_target"], mid["none"]["seconds_to_target"]
            g["1gbit_powersgd_not_slower"] = {"powersgd_s": p, "none_s": n, "goal": "powersgd <= none",
                                              "met": p is not None and n is not None and p <= n}
        g["crossover"] = crossover(summary, model)
        out[model] = g
    return out


SAME_SETTINGS = ("models", "modes", "steps", "budget_sweep", "seeds", "eval_every_steps", "test_images",
                 "compute_only_steps")


def check_same_settings(old_about: dict[str, Any], new_about: dict[str, Any]) -> None:
    """Refuse (SystemExit naming what differs) to merge runs of other settings or a quick run."""
    differ = [k for k in SAME_SETTINGS if json.dumps(old_about.get(k), sort_keys=True, default=str)
              != json.dumps(new_about.get(k), sort_keys=True, default=str)]
    if old_about.get("mode") != "full" or differ:
        raise SystemExit(f"--merge: the existing file ran other settings ({', '.join(differ) or 'its mode'}); "
                         "run every rate again, or write elsewhere with --out")


def _int_seeds(tree: Any, depth: int) -> Any:
    """``tree`` with the keys ``depth`` levels down (the seeds) as ints again: JSON made them strings."""
    if depth == 0:
        return {int(k): v for k, v in tree.items()}
    return {k: _int_seeds(v, depth - 1) for k, v in tree.items()}


def merge(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new``'s rates over ``old``'s, when both ran the same settings (else a clear refusal):
    raw runs, compute-only steps, link probes and each rate's provenance."""
    a, b = old.get("_about", {}), new["_about"]
    check_same_settings(a, b)
    old = {**old, "raw": _int_seeds(old["raw"], 3),  # rate / model / mode / seed
           "compute_only_step_s": _int_seeds(old["compute_only_step_s"], 2)}  # rate / model / seed
    per_rate = {**a.get("per_rate", {}), **b["per_rate"]}
    rates = [r for r in RATES if r in per_rate] + [r for r in per_rate if r not in RATES]
    pick = lambda r, key: (new if r in b["per_rate"] else old)[key][r]  # noqa: E731
    return {"_about": {**b, "rates": rates, "per_rate": {r: per_rate[r] for r in rates},
                       "merged": "rates measured in separate runs: see per_rate"},
            "raw": {r: pick(r, "raw") for r in rates},
            "compute_only_step_s": {r: pick(r, "compute_only_step_s") for r in rates},
            "link_mbit": {r: pick(r, "link_mbit") for r in rates},
            "budgets": {r: pick(r, "budgets") for r in rates},
            "order": [o for o in old.get("order", []) if o.split("/")[1] not in b["per_rate"]] + new["order"]}


def main(args: argparse.Namespace, argv: list[str]) -> None:
    if args.resummarise:
        return resummarise(Path(args.out) if args.out else RESULTS / "compression_links.json", argv)
    reason = netadmin_missing()
    if reason:
        print(f"skipped: the link benchmark needs a simulated cluster ({reason})")
        return
    if args.merge and args.quick:
        raise SystemExit("--merge merges full runs; a quick run writes its own file")
    rates = args.link or list(RATES)
    models = args.models or list(MODELS)
    seeds = list(range(1 if args.quick else args.seeds))
    t0 = time.time()
    name = "compression_links_quick.json" if args.quick else "compression_links.json"
    out = Path(args.out) if args.out else RESULTS / name
    prov = describe_run("benchmarks.compression", argv)
    about = {**prov, "mode": "quick" if args.quick else "full",
             "seeds": seeds, "rates": rates, "models": {m: MODELS[m] for m in models}, "modes": MODES,
             "steps": {m: 40 if args.quick else MODELS[m]["steps"] for m in models},
             "budget_sweep": list(QUICK_BUDGET_SWEEP if args.quick else BUDGET_SWEEP),
             "eval_every_steps": EVAL_EVERY, "test_images": 2000 if args.quick else TEST_IMAGES,
             "compute_only_steps": COMPUTE_STEPS, "nodes": 2, "ranks_per_node": 1, "cores_per_node": 1,
             "target": "the uncompressed run's final accuracy - 1 point, same seed",
             "link": "tbf on each node's send side and on the switch port towards it (full duplex); "
                     "no added latency (this kernel has no netem)",
             "sweep": "for seed: for rate: for model: compute-only step, then modes in alternating order; "
                      "on the first seed each compressed mode then sweeps its step budget (budget_sweep "
                      "multiples of steps) up to the first that reaches the target, and later seeds train "
                      "for that budget"}
    old = json.loads(out.read_text()) if args.merge and out.exists() else None
    if old is not None:
        check_same_settings(old.get("_about", {}), about)  # refuse before hours of work, not after
    res = run(rates, models, seeds, args.quick)
    about["total_s"] = time.time() - t0
    about["per_rate"] = {r: {k: prov[k] for k in ("command", "commit", "load_average_start")}
                         | {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)), "total_s": about["total_s"]}
                         for r in rates}
    res = {"_about": about, **res}
    if old is not None:
        res = merge(old, res)
    write_results(res, models, out)
