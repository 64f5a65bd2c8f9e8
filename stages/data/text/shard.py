"""``shard_text``: a text source becomes a versioned token artifact (``storage/tokens.py``).

One version is ``<out>/<fingerprint[:16]>/``: the fingerprint hashes the source's bytes and the
config, so the same inputs find their version and write nothing. The passes:

1. **scan** the source once: bad documents (undecodable UTF-8, empty, over ``max_doc_bytes``, a
   record without text) go to ``quarantine/`` with their reason; each good one gets its split by
   key (``stages/data/split.py``), a content hash and a MinHash signature;
2. **dedup**: exact and near-duplicates are dropped, first seen kept (a parent's documents first);
3. **tokenizer**: BPE learnt from the kept train documents only, or bytes; a version on top of a
   parent keeps the parent's tokenizer, so the ids of unchanged documents stay valid;
4. **write** each split: the parent's unchanged documents copied as token bytes (its tar shards
   reused where the indices did not move), then the new ones tokenised, then the manifest last.

A grown source (``incremental``, the default) is written on top of the version ``LATEST`` names:
the manifest names its ``parent`` and a ``delta`` by key.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from sluice.errors import ConfigError, ShardError, SluiceError
from sluice.stages.data.split import split_of
from sluice.stages.data.text.config import TextShardConfig
from sluice.stages.data.text.dedup import Deduplicator, content_hash
from sluice.stages.data.text.sources import RawDoc, TextSource, open_text_source
from sluice.stages.data.text.tokenizer import BpeTokenizer, ByteTokenizer, TextTokenizer, load_tokenizer
from sluice.stages.data.text.writer import SplitWriter, file_record
from sluice.storage import atomic
from sluice.storage.artifact import LATEST
from sluice.storage.fingerprint import combine, hash_obj, sha256_file
from sluice.storage.gc import GC_LOCK
from sluice.storage.locking import exclusive, shared
from sluice.storage.manifest import MAX_ANCESTORS, MANIFEST_NAME, QuarantineRecord, SourceRecord
from sluice.storage.paths import is_local, local_path
from sluice.storage.tokens import (TOKEN_SCHEMA, TOKEN_SPLITS, TOKENIZER_NAME, Dropped, TokenDelta,
                                   TokenizerRecord, TokenManifest, TokenSplit, read_token_manifest,
                                   version_dir, write_token_manifest)

QUARANTINE = "quarantine"
BATCH = 256  # documents per tokenizer call


@dataclass
class TextShardSummary:
    root: str
    manifest: TokenManifest
    reused: bool
    seconds: float

    def info(self) -> dict[str, Any]:
        m = self.manifest
        return {"root": self.root, "fingerprint": m.fingerprint, "counts": m.counts(),
                "tokens": {n: s.tokens for n, s in m.splits.items()}, "vocab_size": m.tokenizer.vocab_size,
                "eot": m.tokenizer.eot, "dtype": m.dtype, "reused": self.reused, "seconds": self.seconds,
                "quarantined": m.quarantined, "dropped": {"exact": m.dropped.exact_duplicates,
                                                          "near": m.dropped.near_duplicates}}

    def format(self) -> str:
        m = self.manifest
        lines = [f"token artifact {self.root}",
                 f"  fingerprint {m.fingerprint[:16]}  source {m.source.kind}:{m.source.uri}",
                 f"  tokenizer {m.tokenizer.kind}, vocab {m.tokenizer.vocab_size}, eot {m.tokenizer.eot}, {m.dtype}"
                 + (f" (kept from {m.tokenizer.from_version})" if m.tokenizer.from_version else ""),
                 f"  {'split':<8} {'docs':>8} {'tokens':>11} {'shards':>7} {'MB':>8}"]
        for name, s in m.splits.items():
            mb = sum(f.bytes for f in s.files()) / 1e6
            lines.append(f"  {name:<8} {s.docs:>8} {s.tokens:>11} {len(s.shards):>7} {mb:>8.1f}")
        lines.append(f"  total {sum(m.counts().values())} documents, {sum(s.tokens for s in m.splits.values())} tokens")
        lines.append(f"  dropped {m.dropped.exact_duplicates} exact and {m.dropped.near_duplicates} near duplicates")
        q = ", ".join(f"{n} {r}" for r, n in sorted(m.quarantined.items())) or "none"
        lines.append(f"  quarantined: {q}")
        if m.delta is not None:
            d = m.delta
            lines.append(f"  on top of {m.parent}: {sum(d.added.values())} added, {len(d.changed)} changed, "
                         f"{len(d.removed)} removed; {d.reused_docs} documents' tokens reused, "
                         f"{d.written_bytes / 1e6:.1f} MB written, {d.reused_bytes / 1e6:.1f} MB of shards reused")
        if m.parent_refused:
            lines.append(f"  written whole: {m.parent_refused}")
        lines.append(f"  {'up to date (nothing rewritten)' if self.reused else 'written'} in {self.seconds:.1f} s")
        return "\n".join(lines)


@dataclass
class _Doc:
    key: str
    split: str
    digest: int
    pos: int  # position in the source's order
    sig: np.ndarray | None = None


@dataclass
class _Scan:
    good: list[_Doc] = field(default_factory=list)
    bad: list[QuarantineRecord] = field(default_factory=list)


@dataclass
class _Parent:
    version: str
    manifest: TokenManifest
    splits: dict[str, TokenSplit]
    content: dict[str, np.ndarray]


def given_tokenizer(cfg: TextShardConfig) -> Path | None:
    """The ``tokenizer.json`` that ``cfg.tokenizer_file`` names (a file, or a token artifact)."""
    if cfg.tokenizer_file is None:
        return None
    p = Path(cfg.tokenizer_file)
    if p.is_dir():
        p = version_dir(p) / TOKENIZER_NAME
    if not p.is_file():
        raise ConfigError(f"tokenizer_file: {cfg.tokenizer_file} is neither a tokenizer.json nor a token artifact")
    return p


def text_fingerprint(src: TextSource, cfg: TextShardConfig) -> str:
    given = given_tokenizer(cfg)
    return combine(f"tokens{TOKEN_SCHEMA}", "sums:crc32", src.fingerprint(), cfg.content_fingerprint(),
                   f"tokenizer:{sha256_file(given) if given else ''}")


def shard_text(config: TextShardConfig | None, source: str | os.PathLike, out: str | os.PathLike) -> TextShardSummary:
    """Write (or find) the token artifact of the text at ``source`` under ``out`` (local) and
    point ``out/LATEST`` at it; see the module docstring."""
    t0 = time.perf_counter()
    cfg = config or TextShardConfig()
    if not is_local(out):
        raise ConfigError(f"shard_text writes to a local directory; {out} is a URL (upload the version "
                          "directory afterwards)")
    out = local_path(out)
    src = open_text_source(source, cfg.kind, cfg.text_field, cfg.key_field)
    whole = text_fingerprint(src, cfg)
    out.mkdir(parents=True, exist_ok=True)
    with shared(out / GC_LOCK):
        done = _finished(out, whole[:16], t0)
        if done is not None:
            return done
        parent, refused = _find_parent(out, src, cfg) if cfg.incremental else (None, None)
        if parent is not None and parent.manifest.inputs == whole:
            done = _finished(out, parent.version, t0)
            if done is not None:
                return done
        fp = combine(whole, f"parent:{parent.manifest.fingerprint}") if parent is not None else whole
        version = fp[:16]
        with exclusive(out / f".{version}.lock", on_wait=lambda who: print(
                f"sluice shard: {out / version} is being written by {who}; waiting", file=sys.stderr)):
            done = _finished(out, version, t0)
            if done is not None:
                return done
            work = out / version
            try:
                manifest = _write(src, cfg, work, whole, fp, parent, refused)
            except OSError as e:
                if isinstance(e, SluiceError):
                    raise
                raise ShardError(f"writing the token artifact under {work} failed: {e}") from e
        atomic.write_bytes(out / LATEST, (version + "\n").encode())
    return TextShardSummary(str(out / version), manifest, False, time.perf_counter() - t0)


def _finished(out: Path, version: str, t0: float) -> TextShardSummary | None:
    if not (out / version / MANIFEST_NAME).exists():
        return None
    m = read_token_manifest(out / version)
    atomic.write_bytes(out / LATEST, (version + "\n").encode())
    return TextShardSummary(str(out / version), m, True, time.perf_counter() - t0)


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in ("progress", "incremental")}


def _find_parent(out: Path, src: TextSource, cfg: TextShardConfig) -> tuple[_Parent | None, str | None]:
    """The version LATEST names, when it was written from the same source with the same config
    (so its ids, splits and dedup mean the same); else None and why (None: no version yet)."""
    if not (out / LATEST).exists():
        return None, None
    version = (out / LATEST).read_text().strip()
    try:
        m = read_token_manifest(out / version)
        if m.source.kind != src.kind or m.source.uri != str(src.path):
            return None, f"the newest version {version} was written from {m.source.kind}:{m.source.uri}"
        if _comparable(m.config) != _comparable(cfg.model_dump(mode="json")):
            return None, f"the newest version {version} was written with another config"
        splits = {s: TokenSplit(out / version, m, s) for s in m.splits}
        content = {s: np.load(splits[s].path(m.splits[s].content), allow_pickle=False) for s in m.splits}
    except (SluiceError, OSError, ValueError) as e:
        return None, f"the newest version {version} is unreadable ({e})"
    return _Parent(version, m, splits, content), None


def _bar(total: int | None, desc: str, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="doc", disable=not enabled, dynamic_ncols=True, leave=False)


def _judge(doc: RawDoc, cfg: TextShardConfig) -> tuple[str | None, str | None, bytes]:
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


def _texts(src: TextSource, cfg: TextShardConfig, want: set[str]) -> Iterator[tuple[str, str]]:
    """(key, text) of the documents in ``want``, in source order (a second read of the source)."""
    for doc in src.docs():
        if doc.key in want:
            text, reason, _ = _judge(doc, cfg)
            if text is None:
                raise ShardError(f"{doc.where}: document {doc.key!r} changed while it was being sharded ({reason})")
            yield doc.key, text


def _scan(src: TextSource, cfg: TextShardConfig, work: Path, dedup: Deduplicator) -> _Scan:
    """Judge every document; store the bad ones in ``quarantine/``; sign the good ones."""
    found = _Scan()
    qdir = work / QUARANTINE
    reasons = []
    with _bar(None, "reading documents", cfg.progress) as bar:
        for pos, doc in enumerate(src.docs()):
            bar.update(1)
            text, reason, raw = _judge(doc, cfg)
            split = split_of(doc.key, cfg, has_test=False)
            if text is None:
                stored = raw[:cfg.max_doc_bytes]
                name = f"{QUARANTINE}/{doc.key}.bin"
                atomic.write_bytes(work / name, stored)
                found.bad.append(QuarantineRecord(split=split, key=doc.key, where=doc.where, reason=reason or ""))
                reasons.append({"key": doc.key, "where": doc.where, "reason": reason, "bytes": len(raw),
                                "stored": name, "stored_bytes": len(stored)})
                continue
            sig = dedup.hasher.signature(text) if cfg.dedup and dedup.near else None
            found.good.append(_Doc(doc.key, split, content_hash(raw), pos, sig))
    if reasons:
        qdir.mkdir(parents=True, exist_ok=True)
        atomic.write_bytes(qdir / "reasons.jsonl", "".join(json.dumps(r, sort_keys=True) + "\n" for r in reasons).encode())
    return found


def _deduplicate(found: _Scan, parent: _Parent | None, dedup: Deduplicator, enabled: bool) -> tuple[list[_Doc], Dropped]:
    """The kept documents in source order. The parent's documents are judged first (in its
    split order), so a document the parent kept is never dropped for a newer near-copy."""
    dropped = Dropped()
    if not enabled:
        return list(found.good), dropped
    rank: dict[str, int] = {}
    if parent is not None:
        for s in TOKEN_SPLITS:
            if s in parent.splits:
                for k in parent.splits[s].keys:
                    rank.setdefault(k, len(rank))
    order = sorted(found.good, key=lambda d: (0, rank[d.key]) if d.key in rank else (1, d.pos))
    keep = set()
    for d in order:
        hit = dedup.check(d.key, d.digest, d.sig)
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


def _tokenizer(src: TextSource, cfg: TextShardConfig, kept: list[_Doc], parent: _Parent | None) -> TextTokenizer:
    if parent is not None:
        return load_tokenizer(parent.splits[next(iter(parent.splits))].tokenizer_path)
    given = given_tokenizer(cfg)
    if given is not None:
        return load_tokenizer(given)
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    train = {d.key for d in kept if d.split == "train"}
    if not train:
        raise ShardError(f"{src.path}: no document landed in the train split, so there is nothing to learn "
                         "BPE merges from; add documents, lower val/holdout/test fractions, or use tokenizer: byte")
    return BpeTokenizer.train((t for _, t in _texts(src, cfg, train)), cfg.vocab_size, cfg.min_frequency)


def _write(src: TextSource, cfg: TextShardConfig, work: Path, inputs: str, fp: str,
           parent: _Parent | None, refused: str | None) -> TokenManifest:
    if work.exists():  # a killed run: start over (its files are temp names or are rewritten whole)
        shutil.rmtree(work)
    work.mkdir(parents=True)
    dedup = Deduplicator(cfg.near_dup_threshold, cfg.num_perm, cfg.shingle, cfg.seed, near=True)
    found = _scan(src, cfg, work, dedup)
    kept, dropped = _deduplicate(found, parent, dedup, cfg.dedup)
    tok = _tokenizer(src, cfg, kept, parent)
    atomic.write_bytes(work / TOKENIZER_NAME, tok.to_json())
    dtype = "uint16" if tok.vocab_size <= 65535 else "uint32"
    splits, delta = _write_splits(src, cfg, work, kept, tok, np.dtype(dtype), parent)
    qfiles = sorted((work / QUARANTINE).glob("*")) if (work / QUARANTINE).exists() else []
    files = [file_record(work, p) for p in qfiles]
    tok_rec = TokenizerRecord(kind=tok.kind, file=file_record(work, work / TOKENIZER_NAME), vocab_size=tok.vocab_size,
                              eot=tok.eot, trained_on=["train"] if tok.kind == "bpe" and not cfg.tokenizer_file and not parent else
                              (parent.manifest.tokenizer.trained_on if parent else []),
                              from_version=(parent.manifest.tokenizer.from_version or parent.version) if parent else None)
    all_files = [tok_rec.file, *(f for s in splits.values() for f in s.files()), *files]
    if delta is not None:
        delta.written_bytes = sum(f.bytes for f in all_files if f.version is None)
        delta.reused_bytes = sum(f.bytes for f in all_files if f.version is not None)
    manifest = TokenManifest(
        fingerprint=fp, inputs=inputs, content_sha256=hash_obj([f.sha256 for f in all_files]),
        source=SourceRecord(kind=src.kind, uri=str(src.path), fingerprint=src.fingerprint(),
                            details={"files": len(src.files())}),
        config=cfg.model_dump(mode="json"), tokenizer=tok_rec, dtype=dtype, splits=splits, dropped=dropped,
        quarantine=found.bad, quarantined=dict(Counter(q.reason.split(":", 1)[0] for q in found.bad)),
        quarantine_files=files, parent=parent.version if parent else None,
        ancestors=([parent.manifest.fingerprint, *parent.manifest.ancestors][:MAX_ANCESTORS] if parent else []),
        delta=delta, parent_refused=refused)
    write_token_manifest(work, manifest)
    return manifest


def _write_splits(src: TextSource, cfg: TextShardConfig, work: Path, kept: list[_Doc], tok: TextTokenizer,
                  dtype: np.dtype, parent: _Parent | None):
    """Every split's files: the parent's unchanged documents first (token bytes copied), then
    the new and changed ones, tokenised in source order."""
    by_split: dict[str, list[_Doc]] = {s: [] for s in TOKEN_SPLITS}
    for d in kept:
        by_split[d.split].append(d)
    delta = TokenDelta() if parent is not None else None
    writers: dict[str, SplitWriter] = {}
    new: dict[str, _Doc] = {}
    try:
        for s in TOKEN_SPLITS:
            reuse, reused_shards = _reuse_plan(parent, s, by_split[s], delta)
            writers[s] = SplitWriter(work, s, dtype, cfg.shard_tokens, reused_shards)
            for i in reuse:  # copied, not tokenised again
                ps = parent.splits[s]
                writers[s].add(ps.keys[i], int(parent.content[s][i]), np.asarray(ps.doc(i)))
            done = {parent.splits[s].keys[i] for i in reuse} if parent else set()
            for d in by_split[s]:
                if d.key not in done:
                    new[d.key] = d
            if delta is not None:
                delta.reused_docs += len(reuse)
                delta.added[s] = sum(1 for d in by_split[s] if d.key not in done)
        with _bar(len(new), "tokenising", cfg.progress) as bar:
            batch: list[tuple[str, str]] = []
            for item in _texts(src, cfg, set(new)):
                batch.append(item)
                if len(batch) >= BATCH:
                    _flush(batch, tok, new, writers, bar)
            _flush(batch, tok, new, writers, bar)
        return {s: writers[s].finish() for s in TOKEN_SPLITS}, delta
    except BaseException:
        for w in writers.values():
            w.abort()
        raise


def _flush(batch: list[tuple[str, str]], tok: TextTokenizer, new: dict[str, _Doc],
           writers: dict[str, SplitWriter], bar) -> None:
    for (key, _), ids in zip(batch, tok.encode_batch([t for _, t in batch])):
        d = new[key]
        writers[d.split].add(key, d.digest, ids)
    bar.update(len(batch))
    batch.clear()


def _reuse_plan(parent: _Parent | None, split: str, docs: list[_Doc], delta: TokenDelta | None):
    """The parent's document indices whose tokens this version copies (kept, same bytes), in
    the parent's order, and the parent's tar shards that still hold the same documents at the
    same indices (every shard before the first document that left)."""
    if parent is None or split not in parent.splits:
        return [], []
    ps, content = parent.splits[split], parent.content[split]
    now = {d.key: d.digest for d in docs}
    reuse = []
    first_gone = None
    for i, k in enumerate(ps.keys):
        if now.get(k) == int(content[i]):
            reuse.append(i)
            continue
        if first_gone is None:
            first_gone = i
        (delta.changed if k in now else delta.removed).append(k)
    limit = len(ps.keys) if first_gone is None else first_gone
    shards = []
    for sh in ps.record.shards:
        if sh.first_doc + sh.count > limit:
            break
        rec = sh.tar.model_copy(update={"version": sh.tar.version or parent.version})
        shards.append(sh.model_copy(update={"tar": rec}))
    return reuse, shards


__all__ = ["TextShardSummary", "shard_text", "text_fingerprint"]
