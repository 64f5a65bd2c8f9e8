"""Reading a text source the way the shard stage does: which documents are bad, which split
each good one lands in, and which repeats are dropped.

Kept apart from ``shard.py`` so that whatever else needs "the documents ``shard_text`` would
put in a split" (a tokenizer shared by several sources learns from their train documents) gets
them by the very same rules rather than by a copy of them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from sluice.errors import ShardError
from sluice.stages.data.engine import LocalParts, Parts
from sluice.stages.data.split import split_of
from sluice.stages.data.text.config import TextShardConfig
from sluice.stages.data.text.dedup import Deduplicator, content_hash
from sluice.stages.data.text.parts import bucket_part, chunks, sign_part
from sluice.stages.data.text.sources import RawDoc, TextSource
from sluice.storage import atomic
from sluice.storage.manifest import QuarantineRecord
from sluice.storage.tokens import Dropped

QUARANTINE = "quarantine"


@dataclass
class ScannedDoc:
    key: str
    split: str
    digest: int
    pos: int  # position in the source's order
    sig: np.ndarray | None = None
    nbytes: int = 0  # UTF-8 bytes of its text


@dataclass
class Scan:
    good: list[ScannedDoc] = field(default_factory=list)
    bad: list[QuarantineRecord] = field(default_factory=list)


def progress_bar(total: int | None, desc: str, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="doc", disable=not enabled, dynamic_ncols=True, leave=False)


def judge(doc: RawDoc, cfg: TextShardConfig) -> tuple[str | None, str | None, bytes]:
    """(text, None, raw) for a good document, (None, reason, raw) for a bad one."""
    data = doc.data
    raw = data if isinstance(data, bytes) else b""
    if doc.error:
        return None, doc.error, raw
    if isinstance(data, str):
        try:
            raw = data.encode("utf-8")
        except UnicodeEncodeError as e:  # a JSON "\udc80" escape: a lone surrogate, not text
            return None, f"utf8: {e.reason} at character {e.start}", data.encode("utf-8", "surrogatepass")
    if len(raw) > cfg.max_doc_bytes:
        return None, f"oversize: {len(raw)} bytes, max_doc_bytes {cfg.max_doc_bytes}", raw
    try:
        text = raw.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as e:
        return None, f"utf8: {e.reason} at byte {e.start}", raw
    if not text.strip():
        return None, "empty", raw
    return text, None, raw


def texts(src: TextSource, cfg: TextShardConfig, want: set[str]) -> Iterator[tuple[str, str]]:
    """(key, text) of the documents in ``want``, in source order (a second read of the source)."""
    for doc in src.docs():
        if doc.key in want:
            text, reason, _ = judge(doc, cfg)
            if text is None:
                raise ShardError(f"{doc.where}: document {doc.key!r} changed while it was being sharded ({reason})")
            yield doc.key, text


def scan(src: TextSource, cfg: TextShardConfig, dedup: Deduplicator, work: Path | None = None,
         parts: Parts | None = None) -> Scan:
    """Judge every document and sign the good ones; with ``work``, store the bad ones in
    ``work/quarantine/`` (without, only list them). The signatures are computed in parts of
    consecutive documents (``text/parts.py``) on ``parts`` (a Ray cluster) or here."""
    found = Scan()
    reasons = []

    def good() -> Iterator[tuple[int, str]]:
        with progress_bar(None, "reading documents", cfg.progress) as bar:
            for pos, doc in enumerate(src.docs()):
                bar.update(1)
                text, reason, raw = judge(doc, cfg)
                split = split_of(doc.key, cfg, has_test=False)
                if text is None:
                    if work is not None:
                        stored = raw[:cfg.max_doc_bytes]
                        name = f"{QUARANTINE}/{doc.key}.bin"
                        atomic.write_bytes(work / name, stored)
                        reasons.append({"key": doc.key, "where": doc.where, "reason": reason, "bytes": len(raw),
                                        "stored": name, "stored_bytes": len(stored)})
                    found.bad.append(QuarantineRecord(split=split, key=doc.key, where=doc.where, reason=reason or ""))
                    continue
                found.good.append(ScannedDoc(doc.key, split, content_hash(raw), pos, None, len(raw)))
                yield len(found.good) - 1, text

    if cfg.dedup and dedup.near:
        h = dedup.hasher
        for ids, sigs in (parts or LocalParts()).ordered(
                sign_part, (((h.num_perm, h.shingle, h.seed), ids, texts) for ids, texts in chunks(good()))):
            for i, sig in zip(ids, sigs):
                found.good[i].sig = sig
    else:
        for _ in good():
            pass
    if reasons:
        qdir = work / QUARANTINE
        qdir.mkdir(parents=True, exist_ok=True)
        atomic.write_bytes(qdir / "reasons.jsonl", "".join(json.dumps(r, sort_keys=True) + "\n" for r in reasons).encode())
    return found


def deduplicate(found: Scan, first: Iterable[str], dedup: Deduplicator, enabled: bool,
                parts: Parts | None = None) -> tuple[list[ScannedDoc], Dropped]:
    """The kept documents in source order. The documents keyed in ``first`` (a parent version's,
    in its split order) are judged first, so a document the parent kept is never dropped for a
    newer near-copy. The LSH buckets of the whole corpus are found first, a band a part
    (``parts``: on the engine); the clusters, which need every earlier verdict, here."""
    dropped = Dropped()
    if not enabled:
        return list(found.good), dropped
    rank: dict[str, int] = {}
    for k in first:
        rank.setdefault(k, len(rank))
    order = sorted(found.good, key=lambda d: (0, rank[d.key]) if d.key in rank else (1, d.pos))
    buckets = _buckets(order, dedup, parts)
    keep = set()
    for n, d in enumerate(order):
        hit = dedup.check(d.key, d.digest, d.sig, None if buckets is None else buckets[n])
        if hit is None:
            keep.add(d.key)
            continue
        kind, kept = hit
        dropped.duplicate_of[d.key] = kept
        if kind == "exact":
            dropped.exact_duplicates += 1
        else:
            dropped.near_duplicates += 1
    return [d for d in found.good if d.key in keep], dropped


def _buckets(order: list[ScannedDoc], dedup: Deduplicator, parts: Parts | None) -> np.ndarray | None:
    """Each document's LSH bucket in each band, (n, bands), in judging order; None when some
    document has no signature (near dedup off)."""
    if not dedup.near or not order or any(d.sig is None for d in order):
        return None
    sigs = np.stack([d.sig for d in order])
    r = dedup.rows
    out = np.empty((len(order), dedup.bands), np.int64)
    for band, ids in (parts or LocalParts()).ordered(
            bucket_part, ((b, sigs[:, b * r:(b + 1) * r]) for b in range(dedup.bands))):
        out[:, band] = ids
    return out


def new_deduplicator(cfg: TextShardConfig) -> Deduplicator:
    return Deduplicator(cfg.near_dup_threshold, cfg.num_perm, cfg.shingle, cfg.seed, near=True)


def kept_documents(src: TextSource, cfg: TextShardConfig, parts: Parts | None = None) -> list[ScannedDoc]:
    """The documents a first version of ``src`` keeps (bad ones and repeats left out), in source
    order, each with its split: what ``shard_text`` writes when there is no parent to rank first."""
    dedup = new_deduplicator(cfg)
    kept, _ = deduplicate(scan(src, cfg, dedup, parts=parts), (), dedup, cfg.dedup, parts)
    return kept


__all__ = ["ScannedDoc", "Scan", "QUARANTINE", "judge", "texts", "scan", "deduplicate", "kept_documents",
           "new_deduplicator", "progress_bar"]
