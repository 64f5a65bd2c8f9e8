"""Tokenizers of a token artifact: byte-level BPE learnt with ``tokenizers`` from the train split
only (so no val or test text shapes the vocabulary), or plain UTF-8 bytes.

Both round-trip exactly: BPE is byte-level (every string encodes, no unknown token, decoding gives
the text back), and ``byte`` maps each UTF-8 byte to its value. The end-of-text id is a special
token that no text ever encodes to: ``<|endoftext|>`` is id 0 for BPE, 256 for bytes. The
tokenizer is saved in the artifact as ``tokenizer.json`` (for BPE the ``tokenizers`` JSON, which
``tokenizers.Tokenizer.from_file`` reads; for bytes a three-line JSON), so nothing is downloaded.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import numpy as np

from sluice.errors import ArtifactError, MissingDependency

EOT_TOKEN = "<|endoftext|>"


def _tokenizers():
    try:
        import tokenizers
    except ImportError as e:
        raise MissingDependency(f"a BPE tokenizer needs the 'tokenizers' package ({e}); install it with: "
                                "pip install tokenizers (or use tokenizer: byte)") from e
    return tokenizers


class TextTokenizer:
    """The one interface the shard stage (and a user decoding samples) needs."""
    kind: str = ""
    vocab_size: int = 0
    eot: int = 0

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def decode_batch(self, docs: list[np.ndarray]) -> list[str]:
        """Each document's text (its end-of-text ids, if any, left out)."""
        return [self.decode(d) for d in docs]

    def to_json(self) -> bytes:
        raise NotImplementedError


class ByteTokenizer(TextTokenizer):
    kind, vocab_size, eot = "byte", 257, 256

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.uint32) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if int(i) != self.eot).decode("utf-8", errors="replace")

    def decode_batch(self, docs: list[np.ndarray]) -> list[str]:
        out = []
        for d in docs:  # vectorised: a split's documents are decoded to count or re-encode their text
            a = np.asarray(d)
            a = a[a != self.eot]
            if a.size and int(a.max()) > 255:
                raise ValueError(f"byte tokenizer: id {int(a.max())} is not a byte")
            out.append(a.astype(np.uint8).tobytes().decode("utf-8", errors="replace"))
        return out

    def to_json(self) -> bytes:
        return (json.dumps({"kind": "byte", "vocab_size": self.vocab_size, "eot": self.eot,
                            "eot_token": EOT_TOKEN}, indent=2) + "\n").encode()


class BpeTokenizer(TextTokenizer):
    kind = "bpe"

    def __init__(self, tok):
        self.tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        eot = tok.token_to_id(EOT_TOKEN)
        if eot is None:
            raise ArtifactError(f"the BPE tokenizer has no {EOT_TOKEN} token")
        self.eot = eot

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, min_frequency: int) -> "BpeTokenizer":
        """Learn byte-level BPE merges from ``texts`` (the train split, in a fixed order)."""
        t = _tokenizers()
        from tokenizers import decoders, models, pre_tokenizers, trainers
        tok = t.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                      special_tokens=[EOT_TOKEN], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def from_json(cls, raw: bytes) -> "BpeTokenizer":
        return cls(_tokenizers().Tokenizer.from_str(raw.decode()))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, np.uint32) for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def decode_batch(self, docs: list[np.ndarray]) -> list[str]:
        return self.tok.decode_batch([np.asarray(d).tolist() for d in docs], skip_special_tokens=True)

    def to_json(self) -> bytes:
        return self.tok.to_str(pretty=True).encode()

    def merges(self) -> list[tuple[str, str]]:
        """The learnt merges, as pairs of byte-level strings (what a test reads)."""
        model = json.loads(self.tok.to_str())["model"]
        return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]

    def vocab(self) -> dict[str, int]:
        return self.tok.get_vocab(with_added_tokens=True)


def load_tokenizer(path: str | Path) -> TextTokenizer:
    """The tokenizer saved in a token artifact (``TokenSplit.tokenizer_path``)."""
    try:
        return tokenizer_from_json(Path(path).read_bytes())
    except ArtifactError as e:
        raise ArtifactError(f"{path}: {e}") from None


def tokenizer_from_json(raw: bytes) -> TextTokenizer:
    """A tokenizer from the bytes of its ``tokenizer.json`` (what a remote part is handed)."""
    try:
        head = json.loads(raw)
    except ValueError as e:
        raise ArtifactError(f"not a tokenizer JSON: {e}") from None
    if head.get("kind") == "byte":
        return ByteTokenizer()
    return BpeTokenizer.from_json(raw)


__all__ = ["TextTokenizer", "ByteTokenizer", "BpeTokenizer", "load_tokenizer", "tokenizer_from_json", "EOT_TOKEN"]
