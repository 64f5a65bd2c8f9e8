"""One tokenizer for every source of a mixture, learnt from the train documents of all of them.

A model that mixes sources needs their ids to mean the same thing; a BPE learnt from one source
alone splits the others' words into many short pieces. The documents it learns from are the ones
``shard_text`` puts in each source's train split (``scan.py``: the same bad-document rules, split
by key, dedup within the source), so no val or test text shapes the vocabulary.

It lives under ``tokenizers_dir/<key[:16]>/`` where the key hashes the set of source names and
the tokenizer settings, not the sources' bytes: a grown source keeps it (its unchanged documents
keep their ids, and last night's model can be warm-started), and only other settings or another
set of sources learn a new one. ``learnt_from.json`` beside it says what it was learnt from.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from sluice.errors import ConfigError, ShardError
from sluice.stages.data.engine import Parts
from sluice.stages.data.text.config import TextShardConfig
from sluice.stages.data.text.scan import kept_documents, texts
from sluice.stages.data.text.shard import given_tokenizer
from sluice.stages.data.text.sources import TextSource, open_text_source
from sluice.stages.data.text.tokenizer import BpeTokenizer, ByteTokenizer, TextTokenizer
from sluice.storage import atomic
from sluice.storage.fingerprint import hash_obj
from sluice.storage.locking import exclusive
from sluice.storage.tokens import TOKENIZER_NAME

LEARNT_FROM = "learnt_from.json"


def shared_tokenizer_key(names: Sequence[str], config: TextShardConfig) -> str:
    """What a shared tokenizer is kept by: the set of source names (order does not matter) and
    ``config.tokenizer_fingerprint()``. A byte tokenizer learns nothing, so its key leaves the
    names out: adding a source does not move the other sources' ``tokenizer_file``."""
    names_part = [] if config.tokenizer == "byte" else sorted(names)
    return hash_obj({"shared_tokenizer": 1, "sources": names_part, "tokenizer": config.tokenizer_fingerprint()})


def shared_tokenizer(sources: Sequence[tuple[str, str | os.PathLike]], config: TextShardConfig,
                     tokenizers_dir: str | os.PathLike, *,
                     log: Callable[[str], None] = lambda line: None, parts: Parts | None = None) -> Path:
    """The ``tokenizer.json`` every one of ``sources`` ((name, path) pairs, in the mixture's
    order) is to be sharded with: ``config.model_copy(update={"tokenizer_file": str(path)})``.

    ``config.tokenizer_file`` set: that file (a token artifact's, when it names one), nothing
    learnt. ``tokenizer: byte``: a byte tokenizer file (nothing learnt; the same file whatever the
    sources). ``bpe``: learnt once from the train documents of all sources, then reused while
    the names and tokenizer settings stay the same (see the module docstring). ``parts``: where the
    scan's signatures run (``stages/data/engine.py``); the merges are learnt here."""
    given = given_tokenizer(config)
    if given is not None:
        log(f"shared tokenizer: {given} (tokenizer_file), nothing learnt")
        return given
    pairs = [(str(name), Path(path)) for name, path in sources]
    names = [n for n, _ in pairs]
    if not pairs:
        raise ConfigError("shared_tokenizer: no sources")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(f"shared_tokenizer: source names must be unique; repeated: {repeated}")
    key = shared_tokenizer_key(names, config)
    base = Path(tokenizers_dir)
    d = base / key[:16]
    path = d / TOKENIZER_NAME
    base.mkdir(parents=True, exist_ok=True)
    with exclusive(base / f".{key[:16]}.lock", on_wait=lambda who: print(
            f"sluice: the shared tokenizer {d} is being learnt by {who}; waiting", file=sys.stderr)):
        if path.is_file():
            log(f"shared tokenizer {key[:16]}: reused {path} ({_describe(path, True)})")
            return path
        if config.tokenizer == "byte":
            tok: TextTokenizer = ByteTokenizer()
            used: list[dict[str, Any]] = []
        else:
            tok, used = _learn(pairs, config, parts)
        raw = tok.to_json()
        record = {"key": key, "kind": tok.kind, "vocab_size": tok.vocab_size, "eot": tok.eot,
                  "tokenizer_sha256": hashlib.sha256(raw).hexdigest(),
                  "sources": used, "documents": sum(u["train_documents"] for u in used),
                  "config": config.model_dump(mode="json", exclude={"progress", "incremental"}),
                  "created_at": datetime.now(timezone.utc).isoformat()}
        atomic.write_json(d / LEARNT_FROM, record)
        atomic.write_bytes(path, raw)  # last: its presence means the tokenizer is whole
        log(f"shared tokenizer {key[:16]}: {_describe(path, False)}: {path}")
    return path


def learnt_from(tokenizer_json: str | os.PathLike) -> dict[str, Any] | None:
    """The record written beside a shared tokenizer (None beside any other tokenizer.json)."""
    p = Path(tokenizer_json).with_name(LEARNT_FROM)
    try:
        return json.loads(p.read_bytes())
    except (OSError, ValueError):
        return None


def _describe(tokenizer_json: Path, when: bool) -> str:
    rec = learnt_from(tokenizer_json)
    if rec is None:
        return "no record of what it was learnt from"
    if rec["kind"] == "byte":
        return "byte, 257 ids: nothing to learn"
    per = ", ".join(f"{s['name']} ({s['train_documents']})" for s in rec["sources"])
    at = f" at {rec['created_at'][:19]}" if when else ""
    return f"{rec['kind']}, vocab {rec['vocab_size']}, learnt{at} from {rec['documents']} train documents of {per}"


def _learn(pairs: list[tuple[str, Path]], cfg: TextShardConfig,
           parts: Parts | None = None) -> tuple[TextTokenizer, list[dict[str, Any]]]:
    """BPE learnt from every source's train documents, source after source in the given order."""
    plan: list[tuple[TextSource, set[str]]] = []
    used = []
    for name, p in pairs:
        src = open_text_source(p, cfg.kind, cfg.text_field, cfg.key_field)
        train = [d for d in kept_documents(src, cfg, parts) if d.split == "train"]
        plan.append((src, {d.key for d in train}))
        used.append({"name": name, "source": f"{src.kind}:{src.path}", "train_documents": len(train),
                     "train_bytes": sum(d.nbytes for d in train)})
    if not any(want for _, want in plan):
        raise ShardError("shared tokenizer: no document of " + ", ".join(n for n, _ in pairs) + " landed in a "
                         "train split, so there is nothing to learn BPE merges from; add documents, lower "
                         "val/holdout/test fractions, or use tokenizer: byte")

    def all_texts() -> Iterator[str]:
        for src, want in plan:
            yield from (text for _, text in texts(src, cfg, want))

    return BpeTokenizer.train(all_texts(), cfg.vocab_size, cfg.min_frequency), used


__all__ = ["shared_tokenizer", "shared_tokenizer_key", "learnt_from", "LEARNT_FROM"]
