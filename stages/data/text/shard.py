"""``shard_text``: a text source becomes a versioned token artifact (``storage/tokens.py``).

One version is ``<out>/<fingerprint[:16]>/``: the fingerprint hashes the source's bytes and the
config, so the same inputs find their version and write nothing. The passes:

1. **scan** the source once: bad documents (undecodable UTF-8, empty, over ``max_doc_bytes``, a
   record without text) go to ``quarantine/`` with their reason; each good one gets its split by
   key (``stages/data/split.py``), a content hash and a MinHash signature;
2. **dedup**: exact and near-duplicates are dropped, first seen kept (a parent's documents first);
3. **tokenizer**: BPE learnt from the kept train documents only, or bytes, or the one
   ``tokenizer_file`` names (a mixture's: ``shared_tokenizer.py``); a version on top of a parent
   keeps the parent's tokenizer, so the ids of unchanged documents stay valid;
4. **write** each split: the parent's unchanged documents copied as token bytes (its tar shards
   reused where the indices did not move), then the new ones tokenised, then the manifest last
   (with each split's ``text_bytes``, the UTF-8 bytes of its documents: bits per byte).

A grown source (``incremental``, the default) is written on top of the version ``LATEST`` names:
the manifest names its ``parent`` and a ``delta`` by key.
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sluice.errors import ConfigError, ShardError, SluiceError
from sluice.stages.data.engine import LocalParts, Parts
from sluice.stages.data.text.config import TextShardConfig
from sluice.stages.data.text.parts import chunks, encode_part, remember
from sluice.stages.data.text.resume import PARTS_DIR, KeptParts, clear_except_parts, drop_parts
from sluice.stages.data.text.scan import (QUARANTINE, ScannedDoc, deduplicate, new_deduplicator, progress_bar,
                                          scan, texts)
from sluice.stages.data.text.sources import TextSource, open_text_source
from sluice.stages.data.text.tokenizer import BpeTokenizer, ByteTokenizer, TextTokenizer, load_tokenizer
from sluice.stages.data.text.writer import SplitWriter, file_record
from sluice.storage import atomic
from sluice.storage.artifact import LATEST
from sluice.storage.fingerprint import combine, hash_obj, sha256_file
from sluice.storage.gc import GC_LOCK
from sluice.storage.locking import exclusive, shared
from sluice.storage.manifest import MAX_ANCESTORS, MANIFEST_NAME, SourceRecord
from sluice.storage.paths import is_local, local_path
from sluice.storage.tokens import (TOKEN_SCHEMA, TOKEN_SPLITS, TOKENIZER_NAME, TokenDelta,
                                   TokenizerRecord, TokenManifest, TokenSplit, read_token_manifest,
                                   version_dir, write_token_manifest)



@dataclass
class TextShardSummary:
    root: str
    manifest: TokenManifest
    reused: bool
    seconds: float
    resumed: str = ""  # what an interrupted run's finished parts saved ('' when none were reused)

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
        if self.resumed:
            lines.append(f"  {self.resumed}")
        lines.append(f"  {'up to date (nothing rewritten)' if self.reused else 'written'} in {self.seconds:.1f} s")
        return "\n".join(lines)


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


def shard_text(config: TextShardConfig | None, source: str | os.PathLike, out: str | os.PathLike,
               parts: Parts | None = None) -> TextShardSummary:
    """Write (or find) the token artifact of the text at ``source`` under ``out`` (local) and
    point ``out/LATEST`` at it; see the module docstring. ``parts``: where the signatures and the
    tokenizing run (``stages/data/engine.py``: a Ray cluster; None: here), the same bytes either way."""
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
                manifest, resumed = _write(src, cfg, work, whole, fp, parent, refused, parts)
            except OSError as e:
                if isinstance(e, SluiceError):
                    raise
                raise ShardError(f"writing the token artifact under {work} failed: {e}") from e
        atomic.write_bytes(out / LATEST, (version + "\n").encode())
    return TextShardSummary(str(out / version), manifest, False, time.perf_counter() - t0, resumed)


def _finished(out: Path, version: str, t0: float) -> TextShardSummary | None:
    if not (out / version / MANIFEST_NAME).exists():
        return None
    m = read_token_manifest(out / version)
    atomic.write_bytes(out / LATEST, (version + "\n").encode())
    return TextShardSummary(str(out / version), m, True, time.perf_counter() - t0)


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    """What a parent's config must share with this one: not the tokenizer file's path (its bytes
    are compared instead, so a data root moved elsewhere keeps its lineage)."""
    return {k: v for k, v in config.items() if k not in ("progress", "incremental", "tokenizer_file")}


def _find_parent(out: Path, src: TextSource, cfg: TextShardConfig) -> tuple[_Parent | None, str | None]:
    """The version LATEST names, when it was written from the same source with the same config
    and, for a ``tokenizer_file``, that very tokenizer (a shared one relearnt at the same path
    must not be ignored for the parent's); so its ids, splits and dedup mean the same. Else None
    and why (None: no version yet)."""
    if not (out / LATEST).exists():
        return None, None
    version = (out / LATEST).read_text().strip()
    try:
        m = read_token_manifest(out / version)
        if m.source.kind != src.kind or m.source.uri != str(src.path):
            return None, f"the newest version {version} was written from {m.source.kind}:{m.source.uri}"
        if _comparable(m.config) != _comparable(cfg.model_dump(mode="json")):
            return None, f"the newest version {version} was written with another config"
        given = given_tokenizer(cfg)  # compared as shard_text writes it (loaded, then saved)
        if given is not None and hashlib.sha256(load_tokenizer(given).to_json()).hexdigest() \
                != m.tokenizer.file.sha256:
            return None, f"the newest version {version} holds another tokenizer than {cfg.tokenizer_file}"
        splits = {s: TokenSplit(out / version, m, s) for s in m.splits}
        content = {s: np.load(splits[s].path(m.splits[s].content), allow_pickle=False) for s in m.splits}
    except (SluiceError, OSError, ValueError) as e:
        return None, f"the newest version {version} is unreadable ({e})"
    return _Parent(version, m, splits, content), None


def _tokenizer(src: TextSource, cfg: TextShardConfig, kept: list[ScannedDoc], parent: _Parent | None) -> TextTokenizer:
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
    return BpeTokenizer.train((t for _, t in texts(src, cfg, train)), cfg.vocab_size, cfg.min_frequency)


def _write(src: TextSource, cfg: TextShardConfig, work: Path, inputs: str, fp: str,
           parent: _Parent | None, refused: str | None, parts: Parts | None = None) -> tuple[TokenManifest, str]:
    # a killed run: start over, but for the signature and token parts it finished (text/resume.py)
    clear_except_parts(work)
    work.mkdir(parents=True, exist_ok=True)
    kept_parts = KeptParts(parts, work / PARTS_DIR)
    dedup = new_deduplicator(cfg)
    found = scan(src, cfg, dedup, work, kept_parts)
    first = [k for s in TOKEN_SPLITS if s in parent.splits for k in parent.splits[s].keys] if parent else []
    kept, dropped = deduplicate(found, first, dedup, cfg.dedup, parts)
    tok = _tokenizer(src, cfg, kept, parent)
    atomic.write_bytes(work / TOKENIZER_NAME, tok.to_json())
    dtype = "uint16" if tok.vocab_size <= 65535 else "uint32"
    splits, delta = _write_splits(src, cfg, work, kept, tok, np.dtype(dtype), parent, kept_parts)
    drop_parts(work)  # the summary says what they saved (``resumed``)
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
    return manifest, kept_parts.said()


def _write_splits(src: TextSource, cfg: TextShardConfig, work: Path, kept: list[ScannedDoc], tok: TextTokenizer,
                  dtype: np.dtype, parent: _Parent | None, parts: Parts | None = None):
    """Every split's files: the parent's unchanged documents first (token bytes copied), then
    the new and changed ones, tokenised in source order (in parts: ``text/parts.py``)."""
    by_split: dict[str, list[ScannedDoc]] = {s: [] for s in TOKEN_SPLITS}
    for d in kept:
        by_split[d.split].append(d)
    delta = TokenDelta() if parent is not None else None
    writers: dict[str, SplitWriter] = {}
    new: dict[str, ScannedDoc] = {}
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
        raw = tok.to_json()
        remember(tok, raw)  # this process encodes with the very tokenizer it holds
        todo = ((raw, keys, docs) for keys, docs in chunks(texts(src, cfg, set(new))))
        with progress_bar(len(new), "tokenising", cfg.progress) as bar:
            for keys, ids in (parts or LocalParts()).ordered(encode_part, todo):
                for key, a in zip(keys, ids):
                    d = new[key]
                    writers[d.split].add(key, d.digest, a)
                bar.update(len(keys))
        # a reused document is in by_split too (same key, same bytes), so this counts every document
        return {s: writers[s].finish(sum(d.nbytes for d in by_split[s])) for s in TOKEN_SPLITS}, delta
    except BaseException:
        for w in writers.values():
            w.abort()
        raise


def _reuse_plan(parent: _Parent | None, split: str, docs: list[ScannedDoc], delta: TokenDelta | None):
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
