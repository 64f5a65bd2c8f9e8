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

Batches (``TokenBatch``): ``input_ids`` and ``targets`` int64 (B, L), and the per-token fields
the config lists in ``fields`` (by default all three; ``[]``: nanoGPT's batch, the fastest):
``segment_ids`` int32 (B, L), the document's number within the row (0, 1, ...; -1 for padding):
attend only where equal; ``position_ids`` int64 (B, L), the token's position within its
document's part of the row; ``sources`` int16 (B, L), the mixture source of each token (-1 for
padding: per-source losses). ``doc_keys`` int64 (B, L) on request (``doc_keys=True``): each
token's document as one key over all sources (``doc_key_base[source] + index``; -1 for padding),
for selection by document. Packing itself is ``token_rows``.
``sample_ids`` int64 (B,), the row's start in the epoch's stream (-1 for a padding row): with
(epoch, L) it names the row's tokens exactly. Unpacked, a batch is ``(input_ids, targets,
sample_ids)``: the loop's ``(inputs, labels, indices)``. ``cu_seqlens()`` gives flash-attention's
varlen boundaries.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator, Literal, Protocol, Sequence

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from sluice.errors import LoaderError
from sluice.stages.load.mixture import MixtureConfig, MixturePlan
from sluice.stages.load.prefetch import prefetched
from sluice.stages.load.timings import Timings
from sluice.stages.load.token_rows import ROW_FIELDS, EpochStream, build_stream, pack_rows
from sluice.storage.tokens import open_token_split


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


class SeqLenSchedule(BaseModel):
    """Sequence-length warm-up: ``start`` → ``end`` over ``warmup_tokens`` or ``warmup_steps``,
    rounded down to a multiple of ``step`` (never below ``start``)."""
    model_config = ConfigDict(extra="forbid")
    start: int = Field(64, ge=1)
    end: int = Field(1024, ge=1)
    warmup_tokens: int | None = Field(None, ge=1)
    warmup_steps: int | None = Field(None, ge=1)
    step: int = Field(8, ge=1)
    kind: Literal["linear", "root"] = "linear"

    @model_validator(mode="after")
    def _check(self) -> "SeqLenSchedule":
        if (self.warmup_tokens is None) == (self.warmup_steps is None):
            raise ValueError("seq_len_schedule needs exactly one of warmup_tokens, warmup_steps")
        if self.end < self.start:
            raise ValueError(f"seq_len_schedule end ({self.end}) must be >= start ({self.start})")
        return self

    def at(self, step: int, tokens: int) -> int:
        """The length of the global step ``step`` beginning after ``tokens`` trained tokens."""
        t = step / self.warmup_steps if self.warmup_steps else tokens / self.warmup_tokens
        t = min(max(t, 0.0), 1.0)
        if self.kind == "root":
            t = math.sqrt(t)
        L = self.start + (self.end - self.start) * t
        return int(min(self.end, max(self.start, L // self.step * self.step)))

    def done(self, step: int, tokens: int) -> bool:
        return (step >= self.warmup_steps) if self.warmup_steps else tokens >= self.warmup_tokens


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


@dataclasses.dataclass
class TokenBatch:
    """One rank's rows of a step (see the module docstring for each field). The per-token fields
    are None unless the config asks for them (``fields``, ``doc_keys``). ``input_ids`` and
    ``targets`` may share memory (the targets the inputs shifted by one): copy before writing."""
    input_ids: torch.Tensor
    targets: torch.Tensor
    sample_ids: torch.Tensor
    source_tokens: np.ndarray  # input tokens per mixture source (metrics)
    seq_len: int
    segment_ids: torch.Tensor | None = None  # (B, L) int32 with "segment_ids" in config.fields
    position_ids: torch.Tensor | None = None  # (B, L) int64 with "position_ids" in config.fields
    sources: torch.Tensor | None = None  # (B, L) int16 with "sources" in config.fields
    doc_keys: torch.Tensor | None = None  # (B, L) int64 with config.doc_keys: see doc_key_base

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter((self.input_ids, self.targets, self.sample_ids))

    def cu_seqlens(self) -> torch.Tensor:
        """int32 boundaries of the documents (and padding runs) over the flattened (B × L)
        inputs, for varlen attention (flash-attention's ``cu_seqlens``)."""
        seg = self.segment_ids
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


@dataclasses.dataclass(frozen=True)
class Step:
    """One global step: where it begins, its row length, and this rank's row starts (-1: padding)."""
    epoch: int
    position: int
    seq_len: int
    advance: int
    starts: np.ndarray
    limits: np.ndarray | None = None  # lanes: where each row's tokens stop (its lane's end + 1)


def open_token_sources(config: TokenLoaderConfig) -> list[TokenSource]:
    """Each mixture source's token split (``storage.tokens``), by its path."""
    if config.mixture is None or any(s.path is None for s in config.mixture.sources):
        raise LoaderError("the token loader needs sources: pass them, or give every mixture source a path")
    return [open_token_split(s.path, config.split) for s in config.mixture.sources]


class TokenLoader:
    """Batches of packed token rows (``TokenBatch``) over a mixture of token sources, resumable
    mid-epoch at any world size. ``sources`` (in the mixture's order) default to opening each
    mixture source's ``path``; other keyword arguments override config fields."""

    def __init__(self, sources: Sequence[TokenSource] | None = None,
                 config: TokenLoaderConfig | dict | None = None, *, rank: int = 0, world_size: int = 1,
                 **overrides: Any):
        cfg = config if isinstance(config, TokenLoaderConfig) else TokenLoaderConfig.model_validate(config or {})
        if overrides:
            cfg = TokenLoaderConfig.model_validate({**dict(cfg), **overrides})
        if not 0 <= rank < world_size:
            raise LoaderError(f"rank {rank} is outside world size {world_size}")
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
        self.eot = int(srcs[0].eot)
        self.tokens = [np.asarray(s.tokens) for s in srcs]  # plain ndarray views of the memmaps
        self.offsets = [np.asarray(s.offsets, dtype=np.int64) for s in srcs]
        for k, off in enumerate(self.offsets):
            if off.ndim != 1 or len(off) < 2 or off[0] != 0 or off[-1] != len(self.tokens[k]) \
                    or (np.diff(off) < 0).any():
                raise LoaderError(f"token source {mix.names[k]!r}: offsets must rise from 0 to its "
                                  f"{len(self.tokens[k])} tokens")
        n_docs = np.array([len(o) - 1 for o in self.offsets], np.int64)
        # a source's tokens in the stream: its documents' and an end-of-text each (weights in tokens)
        self.plan = MixturePlan(mix, n_docs.tolist(), [int(o[-1]) + int(n) for o, n in zip(self.offsets, n_docs)])
        self.doc_key_base = np.concatenate([[0], np.cumsum(n_docs)[:-1]]).astype(np.int64)
        self.n_doc_keys = int(n_docs.sum())  # keys run 0 .. n_doc_keys - 1
        self.epoch = 0
        self.position = 0  # tokens of this epoch consumed (global)
        self.lanes: int | None = None  # lanes: rows per global step the epoch began with
        self.lane_position = 0  # lanes: tokens consumed of each lane
        self.step = 0  # global steps handed out since the run began
        self.epoch_step = 0  # of them, in this epoch
        self.tokens_before = 0  # tokens consumed in earlier epochs
        self.source_tokens = np.zeros(len(srcs), np.int64)  # input tokens served per source (this rank)
        self.timings = Timings()
        self._stream: EpochStream | None = None

    # ------------------------------------------------------------------ geometry
    @property
    def names(self) -> list[str]:
        return self.plan.names

    def stream(self, epoch: int | None = None) -> EpochStream:
        """The epoch's document table (built once per epoch)."""
        e = self.epoch if epoch is None else epoch
        if self._stream is None or self._stream.epoch != e or len(self._stream.src) != self.plan.epoch_size(e):
            self._stream = build_stream(self.plan, e, self.offsets)
        return self._stream

    def seq_len_at(self, step: int, tokens: int) -> int:
        sch = self.config.seq_len_schedule
        return sch.at(step, tokens) if sch else self.config.seq_len

    def _lane_geometry(self, epoch: int) -> tuple[int, np.ndarray, np.ndarray]:
        """(lane length, each lane's first input, each lane's inputs) of the epoch's lanes."""
        end, K = self.stream(epoch).end, self.lanes or self.config.batch_size * self.world_size
        span = -(-end // K)
        first = np.arange(K, dtype=np.int64) * span
        return span, first, np.clip(end - first, 0, span)

    def _lane_steps(self, epoch: int, lane_pos: int, step: int) -> Iterator[Step]:
        """The global steps from ``lane_pos`` into every lane to the epoch's end: rank r takes
        lanes r, r + W, ... (its last rows padding where W does not divide the lanes)."""
        span, first, lens = self._lane_geometry(epoch)
        K, W, T = len(first), self.world_size, self.stream(epoch).total
        mine = np.arange(self.rank, -(-K // W) * W, W)
        real = mine < K
        lane = np.where(real, mine, 0)
        limits = np.minimum(first[lane] + lens[lane] + 1, T)
        p = lane_pos
        while p < span:
            done = int(np.minimum(p, lens).sum())
            L = self.seq_len_at(step, self.tokens_before + done)
            starts = np.where(real & (p < lens[lane]), first[lane] + p, -1)
            yield Step(epoch, done, L, int(np.minimum(p + L, lens).sum()) - done, starts, limits)
            p += L
            step += 1

    def _steps(self, epoch: int, position: int, step: int) -> Iterator[Step]:
        """The global steps from ``position`` to the epoch's end, this rank's rows of each."""
        if self.config.row_order == "lanes":
            yield from self._lane_steps(epoch, self.lane_position, step)
            return
        end, W, B = self.stream(epoch).end, self.world_size, self.config.batch_size
        while position < end:
            L = self.seq_len_at(step, self.tokens_before + position)
            rest = end - position
            rows = min(B * W, -(-rest // L))
            per = -(-rows // W)
            r = self.rank  # its rows: r, r + W, ... of the step's per·W (those from ``rows`` on: padding)
            starts = np.arange(position + r * L, position + (r + per * W) * L, W * L, dtype=np.int64)
            starts[len(range(r, rows, W)):] = -1
            adv = min(B * W * L, rest)
            yield Step(epoch, position, L, adv, starts)
            position += adv
            step += 1

    def _steps_left(self) -> int:
        """Steps from here to the epoch's end: the curriculum's stepped through one by one, then
        the fixed length's counted. The cursor is the lanes' offset (each step moves it by L) or
        the stream position (by G × L); ``trained`` turns it into the epoch's tokens consumed."""
        if self.config.row_order == "lanes":
            limit, _, lens = self._lane_geometry(self.epoch)
            x, per_step = self.lane_position, 1
            trained = lambda x: int(np.minimum(x, lens).sum())  # noqa: E731
        else:
            limit, x = self.stream().end, self.position
            per_step = self.config.batch_size * self.world_size
            trained = lambda x: x  # noqa: E731
        step, n, sch = self.step, 0, self.config.seq_len_schedule
        while x < limit:
            t = self.tokens_before + trained(x)
            L = self.seq_len_at(step, t)
            if sch is None or sch.done(step, t):
                return n + -(-(limit - x) // (per_step * L))
            x += per_step * L
            step += 1
            n += 1
        return n

    # ------------------------------------------------------------------ contract
    def __len__(self) -> int:
        """Steps in this epoch (the same on every rank): those taken and those left."""
        return self.epoch_step + self._steps_left()

    def set_epoch(self, epoch: int) -> None:
        """Go to ``epoch`` at its first token; the tokens consumed of the one left count as trained.
        The same epoch, read to its end, starts again: an evaluation re-reads the same rows."""
        if epoch != self.epoch or self.position >= self.stream().end:
            self.tokens_before += self.position
            self.epoch, self.position, self.epoch_step = int(epoch), 0, 0
            self.lanes, self.lane_position = None, 0

    def __iter__(self) -> Iterator[TokenBatch]:
        """This rank's batches from the current position to the epoch's end."""
        if self.position >= self.stream().end:  # finished: the next iteration is the next epoch
            self.set_epoch(self.epoch + 1)
        stream, cfg = self.stream(), self.config
        if self.lanes is None:  # the epoch's lanes are fixed when it begins
            self.lanes = cfg.batch_size * self.world_size

        def make() -> Iterator[tuple[Step, TokenBatch]]:
            for st in self._steps(self.epoch, self.position, self.step):
                yield st, self._batch(stream, st)
        produced = prefetched(make, cfg.prefetch, False, self.timings)
        try:
            for st, batch in produced:
                self.position += st.advance
                self.lane_position += st.seq_len
                self.step += 1
                self.epoch_step += 1
                self.source_tokens += batch.source_tokens
                yield batch
        finally:
            produced.close()

    def _batch(self, stream: EpochStream, st: Step) -> TokenBatch:
        cfg = self.config
        a = pack_rows(stream, st.starts, st.seq_len, self.tokens, self.eot, cfg.ignore_cross_document,
                      cfg.ignore_index, self.doc_key_base if cfg.doc_keys else None, cfg.fields, st.limits)
        t = {k: torch.from_numpy(v) for k, v in a.items() if k != "source_tokens"}
        return TokenBatch(**t, source_tokens=a["source_tokens"], seq_len=st.seq_len)

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
        ``source_tokens``): resuming yields the very next token, at any world size, batch or
        sequence length."""
        sch = self.config.seq_len_schedule
        return {"kind": "tokens", "epoch": self.epoch, "position": self.position,
                "row_order": self.config.row_order, "lanes": self.lanes, "lane_position": self.lane_position,
                "end": self.stream().end, "step": self.step, "epoch_step": self.epoch_step,
                "tokens_before": self.tokens_before, "seed": self.config.seed,
                "world_size": self.world_size, "rank": self.rank, "batch_size": self.config.batch_size,
                "seq_len": self.config.seq_len, "seq_len_schedule": sch.model_dump() if sch else None,
                "mixture": self.plan.state_dict(self.epoch),
                "source_tokens": self.source_tokens.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (written at any world size): the rest of its epoch over the
        counts it began with, then the config's mixture."""
        if state.get("kind") != "tokens":
            raise LoaderError(f"not a token loader state (kind={state.get('kind')!r})")
        if state.get("seed") != self.config.seed:
            raise LoaderError(f"token loader state has seed={state.get('seed')}, this loader "
                              f"{self.config.seed}: another order")
        epoch, pos = int(state["epoch"]), int(state["position"])
        if epoch < 0 or pos < 0:
            raise LoaderError(f"token loader state has epoch {epoch}, position {pos}: not a position")
        order = state.get("row_order", "consecutive")
        if pos > 0 and order != self.config.row_order:
            raise LoaderError(f"epoch {epoch} began with row_order {order!r} and this loader has "
                              f"{self.config.row_order!r}: resume at an epoch boundary to change it")
        self.plan.load_state_dict(state["mixture"], begun=pos > 0)
        self.epoch, self.position, self._stream = epoch, pos, None
        self.lanes = int(state["lanes"]) if pos > 0 and state.get("lanes") else None
        self.lane_position = int(state.get("lane_position", 0)) if pos > 0 else 0
        self.step, self.epoch_step = int(state["step"]), int(state["epoch_step"])
        self.tokens_before = int(state["tokens_before"])
        end = self.stream().end
        if pos > 0 and int(state["end"]) != end:
            raise LoaderError(f"epoch {epoch} of the saved state ends at token {state['end']}, "
                              f"rebuilt here at {end}: the sources are not those it began over")
        if pos > end:
            raise LoaderError(f"token loader state is at token {pos} of an epoch of {end}")
        if state.get("world_size") == self.world_size and state.get("rank") == self.rank \
                and "source_tokens" in state:
            self.source_tokens = np.asarray(state["source_tokens"], np.int64)

    @property
    def mixture_changes(self) -> list[dict[str, Any]]:
        """Each change of the mixture's counts: ``{"epoch", "old", "new"}`` (for the run report)."""
        return self.plan.changes

    def served_by_source(self) -> dict[str, Any]:
        """Input tokens this rank served per source over the run, and the mixture's recorded
        changes (the trainer sums them over ranks into the run summary)."""
        return {"unit": "tokens", "served": dict(zip(self.names, self.source_tokens.tolist())),
                "changes": self.mixture_changes}
