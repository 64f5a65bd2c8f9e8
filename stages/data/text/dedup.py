"""Dropping repeated documents at shard time: exact duplicates by a hash of their bytes, and
near-duplicates by MinHash over word shingles with LSH banding (numpy only).

Repeats inflate what a model memorises and, across splits, leak training text into val: so both
kinds are dropped from every split, keeping the first document seen (the shard stage feeds the
parent version's documents first, so a grown source never drops a document it kept before in
favour of a new one). Everything is a pure function of the text and ``(num_perm, shingle, seed)``:
word hashes are CRC-32s, the permutations come from ``numpy.random.default_rng(seed)``.
"""
from __future__ import annotations

import functools
import hashlib
import re
import zlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

_WORD = re.compile(r"\w+")
_SHIFT = np.uint64(32)
_MIX = np.uint64(0x9E3779B97F4A7C15)  # combines a shingle's word hashes (odd: a bijection mod 2^64)


def content_hash(data: bytes) -> int:
    """The 64-bit hash of a document's UTF-8 bytes: exact duplicates, and changed documents
    between versions (``content.npy``)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


@functools.lru_cache(maxsize=64)
def _bands(num_perm: int, threshold: float) -> tuple[int, int]:
    """LSH bands x rows (b * r <= num_perm) minimising the weighted area of false positives
    below the threshold and false negatives above it (the choice datasketch makes)."""
    def area(f, lo, hi, n=64):
        xs = np.linspace(lo, hi, n)
        return float(np.trapezoid(f(xs), xs)) if hasattr(np, "trapezoid") else float(np.trapz(f(xs), xs))
    best, best_err = (1, num_perm), float("inf")
    for b in range(1, num_perm + 1):
        for r in range(1, num_perm // b + 1):
            fp = area(lambda s: 1 - (1 - s ** r) ** b, 0.0, threshold)
            fn = area(lambda s: (1 - s ** r) ** b, threshold, 1.0)
            err = 0.5 * fp + 0.5 * fn
            if err < best_err:
                best, best_err = (b, r), err
    return best


@dataclass
class MinHasher:
    num_perm: int = 128
    shingle: int = 5
    seed: int = 0
    _a: np.ndarray = field(init=False, repr=False)
    _b: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        rng = np.random.default_rng(self.seed)
        # multiply-shift hashing ((a x + b) mod 2^64) >> 32 with odd a: universal, and no modulo
        self._a = rng.integers(0, 1 << 63, self.num_perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        self._b = rng.integers(0, 1 << 63, self.num_perm, dtype=np.uint64)

    def shingles(self, text: str) -> np.ndarray:
        """Distinct 64-bit hashes of the text's lower-cased word n-grams (the whole text as one
        shingle when it has fewer words)."""
        words = _WORD.findall(text.lower())
        if not words:
            return np.array([zlib.crc32(text.encode("utf-8", "surrogatepass"))], np.uint64)
        h = np.fromiter((zlib.crc32(w.encode()) for w in words), np.uint64, len(words))
        k = min(self.shingle, len(h))
        with np.errstate(over="ignore"):
            acc = h[:len(h) - k + 1].copy()
            for j in range(1, k):
                acc = acc * _MIX + h[j:len(h) - k + 1 + j]
        return np.unique(acc)

    def signature(self, text: str) -> np.ndarray:
        """The MinHash signature (uint32, ``num_perm``): for each permutation, the least hash."""
        sh = self.shingles(text)
        out = np.full(self.num_perm, 0xFFFFFFFF, np.uint64)
        with np.errstate(over="ignore"):
            for i in range(0, len(sh), 1024):  # bounded memory for long documents
                x = sh[i:i + 1024, None]
                ph = (x * self._a + self._b) >> _SHIFT
                np.minimum(out, ph.min(axis=0), out=out)
        return out.astype(np.uint32)


class Deduplicator:
    """Feed documents in order; ``check`` says whether one repeats an earlier kept one (and
    which), and remembers it when it does not."""

    def __init__(self, threshold: float = 0.8, num_perm: int = 128, shingle: int = 5, seed: int = 0,
                 near: bool = True):
        self.threshold, self.near = threshold, near
        self.hasher = MinHasher(num_perm, shingle, seed)
        self.bands, self.rows = _bands(num_perm, threshold)
        self._exact: dict[int, str] = {}
        self._buckets: list[dict[Any, list[int]]] = [{} for _ in range(self.bands)]
        self._sigs: list[np.ndarray] = []
        self._keys: list[str] = []

    def check(self, key: str, digest: int, sig: np.ndarray | None = None,
              buckets: Sequence[int] | None = None) -> tuple[str, str] | None:
        """None for a new document (now remembered), or ``("exact" | "near", kept key)``.
        ``digest``: its ``content_hash``; ``sig``: its ``hasher.signature`` (None: exact only);
        ``buckets``: its LSH bucket in each band, found beforehand for the whole corpus
        (``text/parts.bucket_part``), else its bands' bytes are the buckets. The same
        answers either way; a deduplicator takes one or the other for every document."""
        if digest in self._exact:
            return "exact", self._exact[digest]
        if self.near and sig is not None:
            parts: Sequence[Any] = buckets if buckets is not None else \
                [sig[b * self.rows:(b + 1) * self.rows].tobytes() for b in range(self.bands)]
            seen: set[int] = set()
            for b, part in enumerate(parts):
                for j in self._buckets[b].get(part, ()):
                    if j in seen:
                        continue
                    seen.add(j)
                    if jaccard_estimate(self._sigs[j], sig) >= self.threshold:
                        return "near", self._keys[j]
            j = len(self._sigs)
            self._sigs.append(sig)
            self._keys.append(key)
            for b, part in enumerate(parts):
                self._buckets[b].setdefault(part, []).append(j)
        self._exact[digest] = key
        return None


def jaccard_estimate(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(a == b))


__all__ = ["content_hash", "MinHasher", "Deduplicator", "jaccard_estimate"]
