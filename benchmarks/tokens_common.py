"""What the parts of ``benchmarks.tokens`` share: the three Debian text sources (dict-gcide, fortunes,
python3.11-doc), cached under ``benchmarks/.cache/tokens/`` and sharded as the text recipe does;
the goals; a log line and the summary of repeats.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "benchmarks" / ".cache" / "tokens"
SOURCES = ("gcide", "fortunes", "pydocs")

GOALS = {"vs_nanogpt": 0.9, "vs_litdata": 1.0, "e2e_ratio": 0.8}


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
