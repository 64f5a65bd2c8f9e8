"""A split's documents read back as text: to count its UTF-8 bytes (bits per byte, for a manifest
written before ``text_bytes`` was recorded) and to re-tokenise it with another tokenizer (a
champion trained with an older tokenizer, graded on tonight's documents).

Both decode with the artifact's own ``tokenizer.json``. Byte and byte-level BPE tokenizers give
the text back exactly, so a re-tokenised split is what the other tokenizer makes of the same
texts. (Here, not in ``storage/tokens.py``: decoding needs the tokenizer code of this stage.)
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from sluice.errors import ConfigError
from sluice.stages.data.text.tokenizer import TextTokenizer, load_tokenizer
from sluice.storage.tokens import TOKENIZER_NAME, open_token_split, recorded_text_bytes, version_dir

BATCH = 256  # documents per decode / encode call


@dataclass
class RetokenizedSplit:
    """A split's documents in another tokenizer's ids, in the split's document order: the duck
    type a token loader reads (``tokens``, ``offsets`` int64 n_docs + 1, ``eot``, ``vocab_size``)."""
    tokens: np.ndarray
    offsets: np.ndarray
    eot: int
    vocab_size: int
    keys: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def doc(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]


def tokenizer_at(where: str | os.PathLike | TextTokenizer) -> TextTokenizer:
    """A tokenizer: itself, the one a ``tokenizer.json`` holds, or a token artifact's (a version
    directory, or a root whose LATEST names one)."""
    if isinstance(where, TextTokenizer):
        return where
    p = Path(where)
    if p.is_dir():
        p = version_dir(p) / TOKENIZER_NAME
    if not p.is_file():
        raise ConfigError(f"{where} is neither a tokenizer.json nor a token artifact")
    return load_tokenizer(p)


def split_texts(root: str | os.PathLike, split: str) -> Iterator[tuple[str, str]]:
    """(key, text) of each document of ``split``, in its order, decoded with the artifact's own
    tokenizer."""
    ts = open_token_split(root, split)
    tok = load_tokenizer(ts.tokenizer_path)
    for i in range(0, len(ts), BATCH):
        hi = min(i + BATCH, len(ts))
        yield from zip(ts.keys[i:hi], tok.decode_batch([ts.doc(j) for j in range(i, hi)]))


def decoded_text_bytes(root: str | os.PathLike, split: str) -> int:
    """The UTF-8 bytes of ``split``'s decoded text (what a manifest without ``text_bytes`` leaves
    to count)."""
    return sum(len(text.encode("utf-8")) for _, text in split_texts(root, split))


def split_text_bytes(root: str | os.PathLike, split: str) -> int:
    """The UTF-8 bytes of the text ``split``'s documents hold (the denominator of bits per byte):
    the number the manifest records, else counted by decoding the split."""
    n = recorded_text_bytes(root, split)
    return decoded_text_bytes(root, split) if n is None else n


def retokenized(root: str | os.PathLike, split: str,
                tokenizer: str | os.PathLike | TextTokenizer) -> RetokenizedSplit:
    """``split``'s documents decoded with the artifact's tokenizer and encoded with ``tokenizer``
    (a ``tokenizer.json``, a token artifact, or a ``TextTokenizer``): its ids, end-of-text and
    vocabulary size; uint16 when its ids fit, else uint32, as in an artifact."""
    other = tokenizer_at(tokenizer)
    dtype = np.uint16 if other.vocab_size <= 65535 else np.uint32
    keys: list[str] = []
    parts: list[np.ndarray] = []
    batch: list[str] = []

    def flush() -> None:
        parts.extend(np.asarray(ids, dtype) for ids in other.encode_batch(batch))
        batch.clear()

    for key, text in split_texts(root, split):
        keys.append(key)
        batch.append(text)
        if len(batch) >= BATCH:
            flush()
    flush()
    lens = np.fromiter((len(p) for p in parts), np.int64, len(parts))
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype)
    return RetokenizedSplit(tokens, offsets, other.eot, other.vocab_size, keys)


__all__ = ["RetokenizedSplit", "tokenizer_at", "split_texts", "decoded_text_bytes", "split_text_bytes",
           "retokenized"]
