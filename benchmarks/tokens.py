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

Each part is a module of its own (``benchmarks.tokens_loader``, ``benchmarks.tokens_resume``,
``benchmarks.tokens_e2e``; what they share is ``benchmarks.tokens_common``, the section of
docs/results.md ``benchmarks.tokens_report``); this one runs them and writes the file.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import table
from benchmarks.hostinfo import describe_run, load_average, results_name
from benchmarks.tokens_common import GOALS, log
# e2e_goal and E2E are read from here too (tests/test_tokens_benchmark.py, docs/benchmarks.md)
from benchmarks.tokens_e2e import E2E, E2E_SEEDS, _e2e_child, e2e_goal, part_e2e  # noqa: F401
from benchmarks.tokens_loader import part_loader
from benchmarks.tokens_resume import part_resume

TINY_LIMIT = {"gcide": 300, "fortunes": 200, "pydocs": 3}  # the loader and resume parts' corpus in --tiny


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
