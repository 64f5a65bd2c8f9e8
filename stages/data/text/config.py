"""How text becomes a token artifact (``TextShardConfig``): the tokenizer, what counts as a bad or
a repeated document, how documents are split by key, and how big the tar shards are."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sluice.storage.fingerprint import hash_obj


class TextShardConfig(BaseModel):
    """Everything that decides the bytes of a token artifact, plus ``progress`` and
    ``incremental`` (which do not)."""
    model_config = ConfigDict(extra="forbid")

    kind: Literal["auto", "folder", "jsonl", "parquet"] = "auto"
    text_field: str = Field("text", description="the .jsonl field / Parquet column holding the text")
    key_field: str | None = Field("id", description="a field giving each document its stable key "
                                  "(used when present; else the file and line/row number)")
    tokenizer: Literal["bpe", "byte"] = "bpe"
    tokenizer_file: str | None = Field(None, description="use this tokenizer.json (or the one of this token "
                                       "artifact) instead of learning one: the sources of one mixture must share ids")
    vocab_size: int = Field(8192, ge=260, le=1 << 20,
                            description="BPE: merges are learnt until the vocabulary has this many ids")
    min_frequency: int = Field(2, ge=1, description="BPE: a pair seen fewer times is never merged")
    max_doc_bytes: int = Field(1 << 20, ge=1, description="a larger document is quarantined (oversize)")
    dedup: bool = True
    near_dup_threshold: float = Field(0.8, gt=0.0, le=1.0,
                                      description="estimated Jaccard similarity of shingle sets at or above "
                                                  "which a document is a near-duplicate of an earlier one")
    num_perm: int = Field(128, ge=8, le=1024, description="MinHash permutations (LSH: bands x rows)")
    shingle: int = Field(5, ge=1, le=32, description="words per shingle")
    holdout_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    val_fraction: float = Field(0.05, ge=0.0, lt=1.0)
    test_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    seed: int = 0
    shard_tokens: int = Field(1 << 22, ge=1, description="a tar shard is closed once it holds this many tokens")
    progress: bool = True
    incremental: bool = Field(True, description="a grown source's version is written on top of the one LATEST "
                              "names: its tokenizer is kept and unchanged documents' tokens copied, not re-tokenised")

    @model_validator(mode="after")
    def _fractions(self) -> "TextShardConfig":
        if self.holdout_fraction + self.val_fraction + self.test_fraction >= 1.0:
            raise ValueError("holdout_fraction + val_fraction + test_fraction must be < 1")
        return self

    def content_fingerprint(self) -> str:
        """What changes the bytes written (not progress bars or incremental; a ``tokenizer_file``
        counts by its bytes, added by the shard stage, not by its path)."""
        return hash_obj(self.model_dump(exclude={"progress", "incremental", "tokenizer_file"}))

    def tokenizer_fingerprint(self) -> str:
        """What a parent's tokenizer must share with this config to be kept (ids mean the same)."""
        return hash_obj(self.model_dump(include={"tokenizer", "tokenizer_file", "vocab_size", "min_frequency"}))


__all__ = ["TextShardConfig"]
