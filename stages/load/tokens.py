"""Packed token sequences from one or several token sources (a weighted mixture), with a
sequence-length curriculum and a position that resumes exactly at any world size.

The stream. Epoch e orders documents by the mixture (``mixture.MixturePlan``: which documents of
which source, interleaved, a pure function of (seed, epoch, counts)) and concatenates them, each
followed by the end-of-text token: a virtual stream of T tokens, never materialised (a table of
document starts is). A row of length L starting at stream position p holds inputs
``stream[p : p+L]`` and targets ``stream[p+1 : p+L+1]``; rows advance by L, so every token of the
epoch is an input once and a target once (the first only an input, the last only a target).

Rows of a step (``row_order``). ``lanes`` (the default): when an epoch begins, its ``T - 1``
inputs are cut into ``K = batch_size × world`` lanes of ``ceil((T-1)/K)`` tokens; a global step of
row length L (``seq_len``, or the curriculum's length for this step) takes the next L tokens of
every lane, so the rows of a batch come from K far-apart places of the epoch (consecutive rows of
a shuffled stream still share a long document, and in ablations a small GPT trained on such
batches reached a clearly higher loss at the same tokens than on lane batches). A lane's last row
stops at the lane's end (its last target is the next lane's first token) and is padded; lanes
that are done give padding rows until the longest is. Rank r takes lanes r, r+W, r+2W, ... (the
image loader's strided rule, ``epochs``), its last rows padding where W does not divide K.
``consecutive``: a step at position P takes G rows starting at ``P, P+L, ...`` and advances P by
G × L; the last step takes the rest, split as evenly as strides allow and padded. Either way
every input of the epoch is trained once: nothing is dropped and nothing repeats. Padding rows
have targets all ``ignore_index``.

So the state is (epoch, tokens consumed, the lanes and how far into each, the counts the epoch
was built from, the curriculum's progress): resuming at another world size, per-rank batch or
sequence length continues from the same tokens (an epoch keeps the lanes it began with; the next
one cuts as many as its global batch has rows), and the tokens covered over the epoch are exactly
those of the uninterrupted run.

The curriculum (DeepSpeed's sequence-length warm-up, ``seqlen`` ``fixed_linear``/``fixed_root``):
L rises from ``start`` to ``end`` over ``warmup_tokens`` (tokens trained, the same at any world
size) or ``warmup_steps`` (global steps this loader handed out), rounded down to a multiple of
``step``. Early rows are re-packed shorter rather than truncated, so no token is wasted.

Batches (``contracts.Batch``, the one every loader yields): ``inputs["input_ids"]`` and
``targets`` int64 (B, L), and the per-token fields the config lists in ``fields`` (by default all
three; ``[]``: nanoGPT's batch, the fastest): ``inputs["segment_ids"]`` int32 (B, L), the
document's number within the row (0, 1, ...; -1 for padding): attend only where equal;
``inputs["position_ids"]`` int64 (B, L), the token's position within its document's part of the
row; ``sources`` int16 (B, L), the mixture source of each token (-1 for padding: per-source
losses), with ``source_counts`` (the batch's input tokens per source). ``doc_keys`` int64 (B, L)
on request (``doc_keys=True``): each token's document as one key over all sources
(``doc_key_base[source] + index``; -1 for padding), for selection by document. ``indices`` int64
(B,): the row's start in the epoch's stream (-1 for a padding row): with (epoch, L) it names the
row's tokens exactly. Unpacked, a batch is ``(input_ids, targets, indices)``. ``cu_seqlens``
gives flash-attention's varlen boundaries. Packing itself is ``token_rows``; the position is
``token_cursor``'s.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterator, Literal, Protocol, Sequence

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from sluice.errors import LoaderError
from sluice.stages.contracts import Batch
from sluice.stages.load.base import LoaderBase, as_device
from sluice.stages.load.mixture import MixtureConfig, MixturePlan, SeededDraw, source_key
from sluice.stages.load.prefetch import prefetched
from sluice.stages.load.timings import Timings
from sluice.stages.load.token_cursor import SeqLenSchedule, Step, TokenCursor
from sluice.stages.load.token_rows import ROW_FIELDS, EpochStream, build_stream, pack_rows
from sluice.storage.tokens import open_token_split

__all__ = ["TokenLoader", "TokenLoaderConfig", "SeqLenSchedule", "ArrayTokens", "TokenSource", "cu_seqlens",
           "source_losses", "open_token_sources"]


class TokenSource(Protocol):
    """What the loader reads from a token split (``storage.tokens.TokenSplit``, or arrays)."""
    tokens: np.ndarray  # 1-D token ids (uint16/uint32), often an np.memmap
    offsets: np.ndarray  # int64, n_docs + 1: document i is tokens[offsets[i]:offsets[i+1]]
    eot: int
    vocab_size: int


@dataclasses.dataclass
class ArrayTokens:
    """An in-memory token source (tests, notebooks): documents as one array and their offsets."""
    tokens: np.ndarray
    offsets: np.ndarray
    eot: int
    vocab_size: int

    @classmethod
    def from_documents(cls, docs: Sequence[Sequence[int]], eot: int, vocab_size: int,
                       dtype: Any = np.uint16) -> "ArrayTokens":
        lens = np.array([len(d) for d in docs], dtype=np.int64)
        toks = np.concatenate([np.asarray(d, dtype=dtype) for d in docs]) if len(docs) else np.empty(0, dtype)
        return cls(toks, np.concatenate([[0], np.cumsum(lens)]).astype(np.int64), eot, vocab_size)


class TokenLoaderConfig(BaseModel):
    """Everything that shapes what the token loader yields."""
    model_config = ConfigDict(extra="forbid")
    split: str = "train"
    seq_len: int = Field(1024, ge=1, description="row length without a curriculum")
    batch_size: int = Field(8, ge=1, description="rows per rank per step")
    seq_len_schedule: SeqLenSchedule | None = None
    mixture: MixtureConfig | None = Field(None, description="default: every document of every source once")
    seed: int = 0
    ignore_cross_document: bool = Field(False, description="targets that cross a document boundary "
                                        "(the end-of-text token's) become ignore_index")
    ignore_index: int = -100
    prefetch: int = Field(2, ge=0, description="batches made ahead in a helper thread; 0: none")
    row_order: Literal["lanes", "consecutive"] = Field(
        "lanes", description="lanes: the epoch's stream cut into one lane per row of the global batch, "
        "a step taking the next row of every lane (rows of a batch from far-apart places: measured "
        "better training than consecutive rows); consecutive: a step's rows back to back")
    doc_keys: bool = Field(False, description="batches carry doc_keys: each input token's document as "
                           "one key over all sources (selection by document)")
    fields: list[Literal["segment_ids", "position_ids", "sources"]] = Field(
        default_factory=lambda: list(ROW_FIELDS),
        description="the per-token fields batches carry besides input_ids and targets (each costs a "
                    "pass or two over the batch): segment_ids and position_ids keep a packed "
                    "document's attention and positions its own (the gpt model uses them when "
                    "present), sources gives per-source losses; [] gives nanoGPT's batch")

    @model_validator(mode="after")
    def _unique_fields(self) -> "TokenLoaderConfig":
        if len(set(self.fields)) != len(self.fields):
            raise ValueError(f"fields lists a field twice: {self.fields}")
        return self


def cu_seqlens(batch: Batch) -> torch.Tensor:
    """int32 boundaries of the documents (and padding runs) over the flattened (B × L) inputs of
    a token batch (its ``inputs["segment_ids"]``), for varlen attention (flash-attention's
    ``cu_seqlens``)."""
    seg = batch.inputs.get("segment_ids")
    if seg is None:
        raise LoaderError("cu_seqlens needs segment_ids: list them in the loader's fields")
    B, L = seg.shape
    change = torch.ones_like(seg, dtype=torch.bool)
    change[:, 1:] = seg[:, 1:] != seg[:, :-1]
    starts = torch.nonzero(change.reshape(-1)).reshape(-1)
    return torch.cat([starts, starts.new_tensor([B * L])]).to(torch.int32)


def source_losses(per_token: torch.Tensor, sources: torch.Tensor, n_sources: int,
                  valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed loss and token count per mixture source, on the loss's device (no sync): divide
    the two (after an all-reduce) for per-source mean losses. ``valid``: tokens that count
    (default: every non-padding token)."""
    keep = sources >= 0 if valid is None else valid & (sources >= 0)
    idx = sources.clamp_min(0).reshape(-1).long()
    w = keep.reshape(-1).to(per_token.dtype)
    sums = torch.zeros(n_sources, dtype=per_token.dtype, device=per_token.device)
    counts = torch.zeros(n_sources, dtype=per_token.dtype, device=per_token.device)
    sums.index_add_(0, idx, per_token.reshape(-1) * w)
    counts.index_add_(0, idx, w)
    return sums, counts


def open_token_sources(config: TokenLoaderConfig) -> list[TokenSource]:
    """Each mixture source's token split (``storage.tokens``), by its path."""
    if config.mixture is None or any(s.path is None for s in config.mixture.sources):
        raise LoaderError("the token loader needs sources: pass them, or give every mixture source a path")
    return [open_token_split(s.path, config.split) for s in config.mixture.sources]


class TokenLoader(LoaderBase):
    """Batches of packed token rows (``contracts.Batch``) over a mixture of token sources,
    resumable mid-epoch at any world size. ``sources`` (in the mixture's order) default to opening
    each mixture source's ``path``; other keyword arguments override config fields. Batches are
    made on the CPU (``device``); the trainer moves them."""
    served_unit = "tokens"

    def __init__(self, sources: Sequence[TokenSource] | None = None,
                 config: TokenLoaderConfig | dict | None = None, *, rank: int = 0, world_size: int = 1,
                 device: str | torch.device | None = None, **overrides: Any):
        cfg = config if isinstance(config, TokenLoaderConfig) else TokenLoaderConfig.model_validate(config or {})
        if overrides:
            cfg = TokenLoaderConfig.model_validate({**dict(cfg), **overrides})
        srcs = list(sources) if sources is not None else open_token_sources(cfg)
        if not srcs:
            raise LoaderError("the token loader needs at least one source")
        mix = cfg.mixture or MixtureConfig.once_each(len(srcs), cfg.seed)
        if len(mix.sources) != len(srcs):
            raise LoaderError(f"{len(srcs)} token sources for a mixture of {len(mix.sources)}")
        if len({int(s.eot) for s in srcs}) != 1 or len({int(s.vocab_size) for s in srcs}) != 1:
            raise LoaderError("mixture sources disagree on the end-of-text token or vocabulary size "
                              f"({[(int(s.eot), int(s.vocab_size)) for s in srcs]}): another tokenizer")
        self.config, self.rank, self.world_size = cfg, rank, world_size
        self.device = as_device(device)
        self.eot, self.vocab_size = int(srcs[0].eot), int(srcs[0].vocab_size)
        self.tokens = [np.asarray(s.tokens) for s in srcs]  # plain ndarray views of the memmaps
        self.offsets = [np.asarray(s.offsets, dtype=np.int64) for s in srcs]
        for k, off in enumerate(self.offsets):
            if off.ndim != 1 or len(off) < 2 or off[0] != 0 or off[-1] != len(self.tokens[k]) \
                    or (np.diff(off) < 0).any():
                raise LoaderError(f"token source {mix.names[k]!r}: offsets must rise from 0 to its "
                                  f"{len(self.tokens[k])} tokens")
        n_docs = np.array([len(o) - 1 for o in self.offsets], np.int64)
        # a source's tokens in the stream: its documents' and an end-of-text each (weights in tokens),
        # drawn from its subset of documents where it has one (a warm run's new and replayed ones)
        docs = [None if s.subset is None else np.unique(np.load(s.subset, allow_pickle=False).astype(np.int64))
                for s in mix.sources]
        draws = [SeededDraw(int(n) if d is None else len(d), mix.seed, source_key(str(s.name)), d)
                 for s, n, d in zip(mix.sources, n_docs, docs)]
        lens = [np.diff(o) if d is None else np.diff(o)[d] for o, d in zip(self.offsets, docs)]
        self.plan = MixturePlan(mix, tokens=[int(x.sum()) + len(x) for x in lens], draws=draws)
        self.names = self.plan.names
        self.doc_key_base = np.concatenate([[0], np.cumsum(n_docs)[:-1]]).astype(np.int64)
        self.n_doc_keys = int(n_docs.sum())  # keys run 0 .. n_doc_keys - 1
        self.timings = Timings()
        self._stream: EpochStream | None = None
        self.cursor = TokenCursor(self.stream, rank=rank, world=world_size, batch=cfg.batch_size,
                                  seq_len=cfg.seq_len, schedule=cfg.seq_len_schedule, row_order=cfg.row_order)

    # ------------------------------------------------------------------ geometry
    def stream(self, epoch: int | None = None) -> EpochStream:
        """The epoch's document table (built once per epoch)."""
        e = self.epoch if epoch is None else epoch
        if self._stream is None or self._stream.epoch != e or len(self._stream.src) != self.plan.epoch_size(e):
            self._stream = build_stream(self.plan, e, self.offsets)
        return self._stream

    def seq_len_at(self, step: int, tokens: int) -> int:
        return self.cursor.seq_len_at(step, tokens)

    @property
    def position(self) -> int:
        """Tokens of this epoch consumed (over all ranks)."""
        return self.cursor.position

    @property
    def step(self) -> int:
        """Global steps handed out since the run began."""
        return self.cursor.step

    # ------------------------------------------------------------------ reading
    def _produce(self, epoch: int, start: int) -> Iterator[Batch]:
        """This rank's batches from the cursor's position to the epoch's end."""
        stream, cursor = self.stream(), self.cursor

        def make() -> Iterator[tuple[Step, Batch]]:
            for st in cursor.steps():
                yield st, self._batch(stream, st)
        produced = prefetched(make, self.config.prefetch, False, self.timings)
        try:
            for st, batch in produced:
                cursor.advance(st)
                yield batch
        finally:
            produced.close()

    def _batch(self, stream: EpochStream, st: Step) -> Batch:
        cfg = self.config
        t0 = time.perf_counter()
        a = pack_rows(stream, st.starts, st.seq_len, self.tokens, self.eot, cfg.ignore_cross_document,
                      cfg.ignore_index, self.doc_key_base if cfg.doc_keys else None, cfg.fields, st.limits)
        t = {k: torch.from_numpy(v) for k, v in a.items() if k != "source_tokens"}
        inputs = {k: t[k] for k in ("input_ids", "segment_ids", "position_ids") if k in t}
        batch = Batch(inputs, t["targets"], t["sample_ids"], sources=t.get("sources"),
                      source_counts=torch.from_numpy(a["source_tokens"]), doc_keys=t.get("doc_keys"))
        self.timings.add("pack", time.perf_counter() - t0)
        return batch

    def _counts_sources(self) -> bool:
        return True

    # ------------------------------------------------------------------ inspection
    def rows(self, starts: np.ndarray, seq_len: int, epoch: int | None = None) -> dict[str, np.ndarray]:
        """The rows at ``starts`` of an epoch's stream, as numpy (what a batch holds)."""
        cfg = self.config
        return pack_rows(self.stream(epoch), np.asarray(starts, np.int64), seq_len, self.tokens, self.eot,
                         cfg.ignore_cross_document, cfg.ignore_index,
                         self.doc_key_base if cfg.doc_keys else None, cfg.fields)

    def documents(self, start: int, length: int, epoch: int | None = None) -> list[dict[str, int]]:
        """The documents a row covers: source, index in its source, and its stream span (selection
        and inspection by sequence)."""
        st = self.stream(epoch)
        k0 = int(np.searchsorted(st.cum, start, "right") - 1)
        k1 = int(np.searchsorted(st.cum, min(start + length, st.total) - 1, "right") - 1)
        return [{"source": int(st.src[k]), "doc": int(st.doc[k]), "stream_start": int(st.cum[k]),
                 "stream_end": int(st.cum[k + 1])} for k in range(k0, k1 + 1)]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Where the run is, global (the same on every rank but ``rank`` and the per-rank
        ``served``): resuming yields the very next token, at any world size, batch or sequence
        length."""
        sch = self.config.seq_len_schedule
        return {"kind": "tokens", **self.cursor.state_dict(), "seed": self.config.seed,
                "world_size": self.world_size, "rank": self.rank, "batch_size": self.config.batch_size,
                "seq_len": self.config.seq_len, "seq_len_schedule": sch.model_dump() if sch else None,
                "mixture": self.plan.state_dict(self.epoch), **self._served_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (written at any world size): the rest of its epoch over the
        counts it began with, then the config's mixture."""
        if state.get("kind") != "tokens":
            raise LoaderError(f"not a token loader state (kind={state.get('kind')!r})")
        if state.get("seed") != self.config.seed:
            raise LoaderError(f"token loader state has seed={state.get('seed')}, this loader "
                              f"{self.config.seed}: another order")
        self.plan.load_state_dict(state["mixture"], begun=int(state["position"]) > 0)
        self._stream = None
        self.cursor.load_state_dict(state)
        if state.get("world_size") == self.world_size and state.get("rank") == self.rank:
            self._restore_served(state, "source_tokens")

    @property
    def mixture_changes(self) -> list[dict[str, Any]]:
        """Each change of the mixture's counts: ``{"epoch", "old", "new"}`` (for the run report)."""
        return self.plan.changes
