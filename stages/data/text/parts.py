"""The text stage's costly passes as parts that run in any process (this one, or a Ray
worker: ``stages/data/engine.py``): MinHash signatures and token ids of consecutive documents in
source order, and the LSH buckets of the whole corpus, a band a part. A part is plain data (the hasher's parameters or the tokenizer's JSON, the
documents' texts) and its result is a pure function of it, so where a part ran never changes
a byte of the artifact; the stage feeds the results back in order."""
from __future__ import annotations

import functools
import hashlib
from typing import Iterable, Iterator, TypeVar

import numpy as np

from sluice.stages.data.engine import keep, kept
from sluice.stages.data.text.dedup import MinHasher
from sluice.stages.data.text.tokenizer import TextTokenizer, tokenizer_from_json

PART_DOCS = 1024  # documents per part, at most
PART_BYTES = 8 * 2**20  # and about this much text (a part travels through Ray's object store)

T = TypeVar("T")


def chunks(items: Iterable[tuple[T, str]]) -> Iterator[tuple[list[T], list[str]]]:
    """(ids, texts) of consecutive items, cut at ``PART_DOCS`` documents or ``PART_BYTES`` of text:
    the same cut wherever it runs, since it depends on the documents alone."""
    ids: list[T] = []
    texts: list[str] = []
    size = 0
    for i, text in items:
        ids.append(i)
        texts.append(text)
        size += len(text)
        if len(ids) >= PART_DOCS or size >= PART_BYTES:
            yield ids, texts
            ids, texts, size = [], [], 0
    if ids:
        yield ids, texts


@functools.lru_cache(maxsize=4)
def _hasher(num_perm: int, shingle: int, seed: int) -> MinHasher:
    return MinHasher(num_perm, shingle, seed)


def sign_part(part: tuple[tuple[int, int, int], list, list[str]]) -> tuple[list, np.ndarray]:
    """((num_perm, shingle, seed), ids, texts) -> (ids, their signatures as a (n, num_perm) array)."""
    params, ids, texts = part
    h = _hasher(*params)
    sigs = np.stack([h.signature(t) for t in texts]) if texts else np.zeros((0, params[0]), np.uint32)
    return ids, sigs


def bucket_part(part: tuple[int, np.ndarray]) -> tuple[int, np.ndarray]:
    """(band, that band's rows of every signature in judging order, (n, rows)) -> (band, each
    document's LSH bucket in it: the position of the first document whose rows are the same).
    One part per band: the buckets of the whole corpus, cut by band as datatrove cuts them."""
    band, rows = part
    if len(rows) == 0:
        return band, np.zeros(0, np.int64)
    rows = np.ascontiguousarray(rows)
    keys = rows.view(np.dtype((np.void, rows.dtype.itemsize * rows.shape[1]))).ravel()
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    return band, first[inverse.ravel()].astype(np.int64)


def remember(tok: TextTokenizer, raw: bytes) -> None:
    """Parts run in this process encode with ``tok`` itself (``raw``: its JSON)."""
    keep("tokenizer", hashlib.sha256(raw).hexdigest(), tok)


def encode_part(part: tuple[bytes, list, list[str]]) -> tuple[list, list[np.ndarray]]:
    """(the tokenizer's JSON, ids, texts) -> (ids, each text's token ids)."""
    raw, ids, texts = part
    tok = kept("tokenizer", hashlib.sha256(raw).hexdigest(), lambda: tokenizer_from_json(raw))
    return ids, tok.encode_batch(texts)


__all__ = ["PART_DOCS", "PART_BYTES", "chunks", "sign_part", "bucket_part", "encode_part", "remember"]
