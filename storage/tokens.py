"""The token artifact: its manifest, and the reader a token loader memory-maps.

A token artifact (``modality: tokens``) is what ``stages/data/text`` writes from text documents.
One version (``<root>/<fingerprint[:16]>/``) holds::

    manifest.json              written last and atomically: the version exists once it does
    tokenizer.json             the tokenizer that made the ids (a ``tokenizers`` JSON for BPE; a
                               small JSON for ``byte``): no download is ever needed to decode
    <split>/tokens.bin         every document's token ids, back to back, little-endian ``dtype``;
                               no end-of-text between documents (the loader adds ``eot`` as it packs)
    <split>/offsets.npy        int64, n_docs + 1: document i is tokens[offsets[i]:offsets[i + 1]]
    <split>/keys.txt           the documents' keys, one a line, aligned to the document index
    <split>/sums.npy           uint32: CRC-32 of each document's token bytes as stored in tokens.bin
    <split>/content.npy        uint64: a hash of each document's source bytes (what tells a
                               changed document from an unchanged one in the next version)
    <split>/shard-000000.tar   WebDataset shards for object storage: <key>.tokens (the same
                               bytes as in tokens.bin) and <key>.idx (int64 LE document index)
    quarantine/                the documents left out (their raw bytes) and reasons.jsonl

Its manifest is not a dataset (image) manifest: it has no ``schema_version`` but
``token_schema``, so ``open_artifact`` refuses it by name rather than misreading it.
"""
from __future__ import annotations

import io
import json
import os
import zlib
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from sluice.errors import ArtifactError, CorruptSample
from sluice.storage import atomic
from sluice.storage.artifact import LATEST, verify_file
from sluice.storage.manifest import MANIFEST_NAME, FileRecord, QuarantineRecord, SourceRecord
from sluice.storage.paths import join, local_path, version_file

TOKEN_SCHEMA = 1
TOKEN_SPLITS = ("train", "holdout", "val", "test")
TOKENIZER_NAME = "tokenizer.json"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenShardRecord(_Model):
    """A WebDataset tar holding documents ``first_doc .. first_doc + count - 1`` of its split."""
    tar: FileRecord
    first_doc: int
    count: int


class TokenSplitRecord(_Model):
    docs: int
    tokens: int
    tokens_file: FileRecord
    offsets: FileRecord
    keys: FileRecord
    sums: FileRecord
    content: FileRecord
    shards: list[TokenShardRecord] = Field(default_factory=list)
    # UTF-8 bytes of the documents' text (bits per byte); None in a manifest written before it was
    # recorded: sluice.stages.data.text.retokenize.split_text_bytes then decodes the split
    text_bytes: int | None = None

    def files(self) -> list[FileRecord]:
        return [self.tokens_file, self.offsets, self.keys, self.sums, self.content,
                *(s.tar for s in self.shards)]


class TokenizerRecord(_Model):
    kind: Literal["bpe", "byte"]
    file: FileRecord
    vocab_size: int
    eot: int  # the end-of-text id: never inside a document, added between documents by the loader
    eot_token: str = "<|endoftext|>"
    trained_on: list[str] = Field(default_factory=list)  # the splits the BPE merges were learnt from
    from_version: str | None = None  # the ancestor whose tokenizer this version kept (incremental)


class Dropped(_Model):
    """Documents left out at shard time because they repeat another one (kept: the first)."""
    exact_duplicates: int = 0
    near_duplicates: int = 0
    # dropped key -> kept key, for both kinds (a small table: what to check when a count looks wrong)
    duplicate_of: dict[str, str] = Field(default_factory=dict)


class TokenDelta(_Model):
    """What a version changed against its parent, by key."""
    added: dict[str, int] = Field(default_factory=dict)  # split -> documents new in this version
    removed: list[str] = Field(default_factory=list)  # keys the source (or dedup) no longer yields
    changed: list[str] = Field(default_factory=list)  # keys whose bytes changed (tokenised anew)
    reused_docs: int = 0  # documents whose tokens were copied from the parent, not tokenised again
    reused_bytes: int = 0  # bytes of the parent's files this version lists as they are
    written_bytes: int = 0


class TokenManifest(_Model):
    token_schema: int = TOKEN_SCHEMA
    modality: Literal["tokens"] = "tokens"
    fingerprint: str
    inputs: str  # hash of the source content and config alone (fingerprint also hashes the parent)
    content_sha256: str
    created_at: str = Field(default_factory=lambda: datetime.now(timezone.utc).isoformat())
    source: SourceRecord
    config: dict[str, Any]
    tokenizer: TokenizerRecord
    dtype: Literal["uint16", "uint32"]
    splits: dict[str, TokenSplitRecord]
    dropped: Dropped = Field(default_factory=Dropped)
    quarantine: list[QuarantineRecord] = Field(default_factory=list)
    quarantined: dict[str, int] = Field(default_factory=dict)  # reason -> documents
    quarantine_files: list[FileRecord] = Field(default_factory=list)
    parent: str | None = None
    ancestors: list[str] = Field(default_factory=list)
    delta: TokenDelta | None = None
    parent_refused: str | None = None

    def counts(self) -> dict[str, int]:
        return {name: s.docs for name, s in self.splits.items()}

    def files(self) -> list[FileRecord]:
        """Every file the manifest vouches for, in a stable order."""
        return [self.tokenizer.file, *(f for n in sorted(self.splits) for f in self.splits[n].files()),
                *self.quarantine_files]

    def split(self, name: str) -> TokenSplitRecord:
        if name not in self.splits:
            raise KeyError(f"split {name!r} is not in this token artifact; it has {sorted(self.splits)}")
        return self.splits[name]


def write_token_manifest(root: str | os.PathLike, manifest: TokenManifest) -> None:
    atomic.write_bytes(join(root, MANIFEST_NAME), (manifest.model_dump_json(indent=2) + "\n").encode())


def version_dir(path: str | os.PathLike) -> Path:
    """The version directory ``path`` names: itself when it holds a manifest, else the version
    its ``LATEST`` names (a token root)."""
    p = local_path(path)
    if not (p / MANIFEST_NAME).exists() and (p / LATEST).exists():
        return p / (p / LATEST).read_text().strip()
    return p


def read_token_manifest(path: str | os.PathLike) -> TokenManifest:
    """The token manifest of a version directory (or the version a root's LATEST names)."""
    p = version_dir(path) / MANIFEST_NAME
    try:
        data = json.loads(p.read_bytes())
    except FileNotFoundError:
        raise ArtifactError(f"no token artifact at {path}: {MANIFEST_NAME} is missing "
                            "(not written yet, or the shard run did not finish)") from None
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{p} is not valid JSON: {e}") from None
    if data.get("modality") != "tokens":
        raise ArtifactError(f"{p} is not a token artifact (modality {data.get('modality', 'images')!r}); "
                            "open it with sluice.storage.artifact.open_artifact")
    if data.get("token_schema") != TOKEN_SCHEMA:
        raise ArtifactError(f"{p} has token schema {data.get('token_schema')}; this Sluice reads {TOKEN_SCHEMA}")
    try:
        return TokenManifest.model_validate(data)
    except ValueError as e:
        raise ArtifactError(f"{p} is not a valid token manifest: {e}") from None


def _load_npy(path: Path, what: str) -> np.ndarray:
    try:
        return np.load(io.BytesIO(path.read_bytes()), allow_pickle=False)
    except (ValueError, OSError) as e:
        raise ArtifactError(f"{path} ({what}) is not a valid .npy file: {e}") from None


class TokenSplit:
    """One split of a token artifact, memory-mapped: what a token loader reads.

    ``tokens`` (1-D ``np.memmap`` of ``dtype``), ``offsets`` (int64, n_docs + 1), ``keys``,
    ``sums`` (uint32 CRC-32 per document), ``eot``, ``vocab_size``, ``tokenizer_path``. Documents
    are stored without an end-of-text; a packer appends ``eot`` after each one."""

    def __init__(self, root: Path, manifest: TokenManifest, split: str):
        self.root, self.manifest, self.split = root, manifest, split
        rec = manifest.split(split)
        self.record = rec
        self.dtype = np.dtype(manifest.dtype).newbyteorder("<")
        self.eot = manifest.tokenizer.eot
        self.vocab_size = manifest.tokenizer.vocab_size
        self.tokenizer_path = self.path(manifest.tokenizer.file)
        tok = self.path(rec.tokens_file)
        if not tok.exists():
            raise ArtifactError(f"artifact file missing: {tok}")
        if tok.stat().st_size != rec.tokens * self.dtype.itemsize:
            raise ArtifactError(f"{tok} has {tok.stat().st_size} bytes; split {split!r} has {rec.tokens} "
                                f"{manifest.dtype} tokens by its manifest (truncated or replaced)")
        # np.memmap refuses an empty file: an empty split gets an empty array of the same dtype
        self.tokens = np.memmap(tok, self.dtype, mode="r") if rec.tokens else np.zeros(0, self.dtype)
        for r in (rec.offsets, rec.keys, rec.sums):  # small: re-hashed on every open
            verify_file(str(self.path(r)), r, deep=True)
        self.offsets = _load_npy(self.path(rec.offsets), "document offsets").astype(np.int64, copy=False)
        self.sums = _load_npy(self.path(rec.sums), "document checksums").astype(np.uint32, copy=False)
        self.keys = self.path(rec.keys).read_bytes().decode().splitlines()
        n = rec.docs
        if self.offsets.shape != (n + 1,) or self.sums.shape != (n,) or len(self.keys) != n:
            raise ArtifactError(f"{self.root}: split {split!r} has {n} documents by its manifest, but "
                                f"offsets.npy {self.offsets.shape}, sums.npy {self.sums.shape}, keys.txt "
                                f"{len(self.keys)} lines (edited, or from other files); re-shard")
        if n and (self.offsets[0] != 0 or self.offsets[-1] != rec.tokens or np.any(np.diff(self.offsets) < 0)):
            raise ArtifactError(f"{self.path(rec.offsets)}: offsets do not tile 0..{rec.tokens} (damaged); re-shard")

    def path(self, rec: FileRecord) -> Path:
        return local_path(version_file(str(self.root), rec.path, rec.version))

    @property
    def text_bytes(self) -> int | None:
        """The UTF-8 bytes of the split's text as its manifest records them (None: written
        before they were recorded)."""
        return self.record.text_bytes

    def __len__(self) -> int:
        return len(self.keys)

    def doc(self, i: int) -> np.ndarray:
        """Document ``i``'s token ids (a view into the memory map; no end-of-text)."""
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]

    def check_doc(self, i: int) -> None:
        """Raise CorruptSample naming the file, document and key when ``i``'s bytes no longer
        match the checksum written with them."""
        got = zlib.crc32(np.ascontiguousarray(self.doc(i)).tobytes()) & 0xFFFFFFFF
        if got != int(self.sums[i]):
            f = self.path(self.record.tokens_file)
            raise CorruptSample(f"{f}: document {i} (key {self.keys[i]!r}) of split {self.split!r} has "
                                f"CRC-32 {got:08x}, written as {int(self.sums[i]):08x} (damaged); re-shard",
                                file=str(f), key=self.keys[i], index=i, split=self.split)

    def verify(self, deep: bool = True) -> None:
        """Sizes (and with ``deep`` sha256) of the split's files against the manifest, then every
        document against its checksum; raises ArtifactError naming the file or document."""
        big = [self.record.tokens_file, *(s.tar for s in self.record.shards)]
        for rec in [self.manifest.tokenizer.file, *self.record.files()]:
            verify_file(str(self.path(rec)), rec, deep=deep or all(rec is not b for b in big))
        for i in range(len(self)):
            self.check_doc(i)
        if deep:
            self._check_shards()

    def _check_shards(self) -> None:
        """Each tar shard's ``.tokens`` members against the documents' checksums, in order."""
        import tarfile
        for sh in self.record.shards:
            f = self.path(sh.tar)
            try:
                with tarfile.open(f) as t:
                    members = [(m.name, t.extractfile(m).read()) for m in t if m.name.endswith(".tokens")]
            except (tarfile.TarError, OSError) as e:
                raise ArtifactError(f"{f}: cannot read its members ({e}); re-shard") from None
            if len(members) != sh.count:
                raise ArtifactError(f"{f} holds {len(members)} documents, the manifest says {sh.count}")
            for k, (name, data) in enumerate(members):
                i = sh.first_doc + k
                if name != f"{self.keys[i]}.tokens" or zlib.crc32(data) & 0xFFFFFFFF != int(self.sums[i]):
                    raise CorruptSample(f"{f}: member {name} (document {i}, key {self.keys[i]!r}) does not match "
                                        "its checksum or key (damaged); re-shard",
                                        file=str(f), key=self.keys[i], index=i, split=self.split)

    def __repr__(self) -> str:
        return (f"TokenSplit({self.root.name}/{self.split}: {len(self)} docs, {self.record.tokens} tokens, "
                f"{self.dtype.name}, vocab {self.vocab_size}, eot {self.eot})")


def open_token_split(path: str | os.PathLike, split: str) -> TokenSplit:
    """Open ``split`` of the token artifact at ``path`` (a version directory, or a root whose
    ``LATEST`` names one). Local only: a remote artifact is fetched first."""
    root = version_dir(path)
    return TokenSplit(root, read_token_manifest(root), split)


def recorded_text_bytes(path: str | os.PathLike, split: str) -> int | None:
    """The UTF-8 bytes of ``split``'s documents' text as the manifest at ``path`` (a version, or a
    root's LATEST) records them, or None for a manifest written before they were recorded (the
    stage ``sluice.stages.data.text.retokenize.split_text_bytes`` then counts them by decoding)."""
    return read_token_manifest(path).split(split).text_bytes


def is_token_artifact(path: str | os.PathLike) -> bool:
    """True when ``path`` (or the version its LATEST names) holds a token manifest."""
    p = version_dir(path) / MANIFEST_NAME
    try:
        return json.loads(p.read_bytes()).get("modality") == "tokens"
    except (OSError, ValueError):
        return False


__all__ = ["TokenManifest", "TokenSplitRecord", "TokenShardRecord", "TokenizerRecord", "Dropped",
           "TokenDelta", "TokenSplit", "open_token_split", "read_token_manifest", "write_token_manifest",
           "is_token_artifact", "recorded_text_bytes", "version_dir", "TOKEN_SCHEMA", "TOKEN_SPLITS", "TOKENIZER_NAME"]
