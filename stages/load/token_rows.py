"""An epoch's packed token stream as a table of documents, and rows of it gathered into arrays
(``pack_rows``): the token loader's hot path, kept apart from its bookkeeping (``tokens``).

A batch costs the passes over its tokens, so rows are built from *pieces* (one document's part
of one row, or of the batch's one span when its rows follow each other, as they do on one
rank): a few hundred per batch, where the tokens are tens of thousands. The gather index is one
``repeat`` over the pieces plus a shared ``arange``; the tokens come in with one ``take`` from
the source holding most of them (the other sources' few pieces copied as slices) and one cast
to int64; the end-of-text slots are set by a scatter over the pieces, not a compare over every
token. Consecutive rows are one span of m·L + 1 tokens whose inputs and targets are two views,
one token apart; rows elsewhere are one (m, L + 1) buffer, viewed the same way, the targets
copied only where something changes them (padding, ``ignore_cross``). The per-token fields
(``segment_ids``, ``position_ids``, ``sources``, ``doc_keys``) cost a pass or two each and are
built only when asked for. Long pieces (documents longer than rows) are copied as slices.

The index reads pieces scattered over the sources' (memory-mapped) arrays, each a cache miss:
touching one token a cache line first (a cheap strided ``take``) lets those misses overlap.
"""
from __future__ import annotations

import dataclasses
from typing import Collection, Sequence

import numpy as np

from sluice.stages.load.mixture import MixturePlan

ROW_FIELDS = ("segment_ids", "position_ids", "sources")  # the per-token annotations pack_rows can add
SLICE_PIECES = 512  # mean tokens a piece from which slices beat an index over every token
SLICE_FEW = 32  # the other sources' pieces up to which they are copied as slices (else indexed)
TOUCH = 16  # the touch's stride in tokens: a 64-byte line holds 32 of 2 bytes; 16 catches short pieces

_ARANGE = np.arange(0, dtype=np.int64)


def _arange(n: int) -> np.ndarray:
    """``np.arange(n)`` (int64) as a read-only view of one shared array: made once, not per batch."""
    global _ARANGE
    a = _ARANGE
    if len(a) < n:
        a = np.arange(max(n, 2 * len(a)), dtype=np.int64)
        a.flags.writeable = False
        _ARANGE = a
    return a[:n]


@dataclasses.dataclass(frozen=True)
class EpochStream:
    """An epoch's packed stream as a table of documents in order (never the tokens)."""
    epoch: int
    src: np.ndarray  # source of each document in order
    doc: np.ndarray  # index within its source
    file_start: np.ndarray  # where its tokens start in its source's array
    lens: np.ndarray  # tokens in the stream: its own + the end-of-text
    cum: np.ndarray  # stream start of each document, and T at the end
    shift: np.ndarray = dataclasses.field(init=False, repr=False)  # source index - stream position

    def __post_init__(self) -> None:
        object.__setattr__(self, "shift", self.file_start - self.cum[:-1])

    @property
    def total(self) -> int:
        return int(self.cum[-1])

    @property
    def end(self) -> int:
        """Input positions of the epoch: every token but the last (which is only a target)."""
        return max(self.total - 1, 0)


def build_stream(plan: MixturePlan, epoch: int, offsets: Sequence[np.ndarray]) -> EpochStream:
    """The epoch's document table: the mixture's order, where each document lies, how long."""
    src, doc = plan.order(epoch)
    file_start = np.empty(len(src), np.int64)
    lens = np.empty(len(src), np.int64)
    for s, off in enumerate(offsets):
        m = src == s
        d = doc[m]
        file_start[m] = off[d]
        lens[m] = off[d + 1] - off[d] + 1
    cum = np.zeros(len(src) + 1, np.int64)
    np.cumsum(lens, out=cum[1:])
    return EpochStream(epoch, src, doc, file_start, lens, cum)


@dataclasses.dataclass
class _Pieces:
    """Stream windows cut at document boundaries, in order: piece i is ``plen[i]`` tokens of a
    document of source ``src[i]``, ending at ``cend[i]`` in the pieces' compact concatenation,
    where compact position c holds that source's token ``delta[i] + c``; ``eot_at``: the compact
    positions of the end-of-text slots. Per window, also each piece's ``row`` and stream ``doc``;
    for one span, ``first``: the stream document of its first piece (the rest follow)."""
    src: np.ndarray
    delta: np.ndarray
    plen: np.ndarray
    cend: np.ndarray
    eot_at: np.ndarray
    row: np.ndarray | None = None
    doc: np.ndarray | None = None
    first: int = 0

    @property
    def n(self) -> int:
        return int(self.cend[-1]) if len(self.cend) else 0


def _span_pieces(stream: EpochStream, a: int, b: int) -> _Pieces:
    """The pieces of the one stream span ``[a, b)`` (``a < b <= T``): slices of the table."""
    cum = stream.cum
    k0 = int(cum.searchsorted(a, "right")) - 1
    k1 = int(cum.searchsorted(b - 1, "right")) - 1
    tail = int(cum[k1 + 1]) - b
    plen = stream.lens[k0:k1 + 1].copy()
    plen[0] -= a - int(cum[k0])
    plen[-1] -= tail
    cend = plen.cumsum()
    return _Pieces(stream.src[k0:k1 + 1], stream.shift[k0:k1 + 1] + a, plen, cend,
                   (cend[:-1] if tail else cend) - 1, first=k0)


def _row_pieces(stream: EpochStream, a: np.ndarray, b: np.ndarray) -> _Pieces:
    """The pieces of each window ``[a[r], b[r])`` (empty where ``b <= a``), window by window."""
    cum = stream.cum
    k0 = np.searchsorted(cum, a, "right") - 1
    k1 = np.searchsorted(cum, b - 1, "right") - 1
    count = np.where(b > a, k1 - k0 + 1, 0)
    first = np.cumsum(count) - count
    row = np.repeat(np.arange(len(a)), count)
    doc = np.repeat(k0 - first, count) + _arange(len(row))
    end = cum[doc + 1]
    hi = np.minimum(end, b[row])
    plen = hi - np.maximum(cum[doc], a[row])
    cend = np.cumsum(plen)
    width = np.maximum(b - a, 0)
    at = a - (np.cumsum(width) - width)  # stream position - compact position, per window
    return _Pieces(stream.src[doc], stream.shift[doc] + at[row], plen, cend, (cend - 1)[hi == end], row, doc)


def _source_counts(pc: _Pieces, n_sources: int) -> np.ndarray:
    """The pieces' tokens per source."""
    if n_sources == 1:
        return np.array([pc.n], np.int64)
    return np.bincount(pc.src, weights=pc.plen, minlength=n_sources).astype(np.int64)


def _copy_slices(vals: np.ndarray, pc: _Pieces, tokens: Sequence[np.ndarray],
                 which: np.ndarray | slice) -> None:
    """Copy pieces ``which`` as slices (an end-of-text slot may reach past its source's end: the
    slice comes out short, and the slot is set afterwards)."""
    pl = pc.plen[which]
    cs = pc.cend[which] - pl
    for k, f, c, ln in zip(pc.src[which].tolist(), (pc.delta[which] + cs).tolist(), cs.tolist(), pl.tolist()):
        x = tokens[k][f:f + ln]
        vals[c:c + len(x)] = x


def _gather(pc: _Pieces, tokens: Sequence[np.ndarray], eot: int, counts: np.ndarray) -> np.ndarray:
    """The pieces' tokens, concatenated (in the sources' dtype), end-of-text slots included.
    ``counts``: the pieces' tokens per source."""
    n, P = pc.n, len(pc.plen)
    used = [k for k in counts.nonzero()[0].tolist() if len(tokens[k])]  # an empty source: end-of-text only
    dtype = np.result_type(*(tokens[k].dtype for k in used)) if used else tokens[0].dtype
    if not used or n >= SLICE_PIECES * P:  # long pieces: a slice each
        vals = np.empty(n, dtype)
        _copy_slices(vals, pc, tokens, slice(None))
    else:  # one index over every piece; the tokens taken from the source with the most
        major = max(used, key=counts.__getitem__)
        idx = np.repeat(pc.delta, pc.plen)
        idx += _arange(n)
        t = tokens[major]
        t.take(idx[::TOUCH], mode="clip")  # one token a cache line first: their misses overlap
        vals = t.take(idx, mode="clip")  # clip: end-of-text slots, other sources' pieces past the end
        if len(used) > 1:  # the other sources' pieces, read again from their own arrays
            vals = vals.astype(dtype, copy=False)
            minor = (pc.src != major).nonzero()[0]
            if len(minor) <= SLICE_FEW:
                _copy_slices(vals, pc, tokens, minor)
            else:
                for k in used:
                    if k != major:
                        sel = pc.src == k
                        pl = pc.plen[sel]
                        ce = np.cumsum(pl)
                        dest = np.repeat(pc.cend[sel] - ce, pl)
                        dest += _arange(int(ce[-1]))
                        vals[dest] = tokens[k].take(dest + np.repeat(pc.delta[sel], pl), mode="clip")
    vals[pc.eot_at] = eot
    return vals


def _spread(values: np.ndarray, plen: np.ndarray, fill: np.ndarray | None, m: int, W: int,
            pad: int) -> np.ndarray:
    """Per-piece values as (m, W) per-token rows; ``fill`` (m, W): the slots the pieces cover
    (None: all), the others ``pad``."""
    flat = np.repeat(values, plen)
    if fill is None:
        return flat.reshape(m, W)
    out = np.full((m, W), pad, values.dtype)
    out[fill] = flat
    return out


def pack_rows(stream: EpochStream, starts: np.ndarray, L: int, tokens: Sequence[np.ndarray], eot: int,
              ignore_cross: bool = False, ignore_index: int = -100,
              doc_base: np.ndarray | None = None,
              fields: Collection[str] = ROW_FIELDS, limits: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Rows of ``L`` inputs (and targets) from the stream at ``starts`` (-1: a padding row),
    vectorised over the pieces (documents) the rows touch: no Python per row or token.

    Always ``input_ids``, ``targets`` (int64 (m, L)), ``sample_ids`` and ``source_tokens`` (input
    tokens per source); of ``ROW_FIELDS`` those in ``fields`` (see ``tokens``); with ``doc_base``
    (each source's first key) ``doc_keys``: each input token's document as ``doc_base[source] +
    its index in the source`` (-1 for padding). ``input_ids`` and ``targets`` may be views of one
    buffer (the targets the inputs shifted by one): copy before writing into either. ``limits``:
    per row, the stream position its tokens stop before (a lane's end + 1: the row's inputs end
    at the lane's end, its last target is the next lane's first token); a row cut short is
    padded as the epoch's last row is."""
    if fields and not set(fields) <= set(ROW_FIELDS):
        raise ValueError(f"pack_rows: unknown fields {sorted(set(fields) - set(ROW_FIELDS))}; "
                         f"known: {list(ROW_FIELDS)}")
    starts = np.asarray(starts, np.int64)
    m, W, T, K = len(starts), L + 1, stream.total, len(tokens)
    annotate = bool(fields) or doc_base is not None
    first = starts.tolist()
    s0 = first[0] if m else -1
    uncut = limits is None or bool((np.asarray(limits) >= starts + W).all())
    if s0 >= 0 and s0 + m * L + 1 <= T and uncut and first == list(range(s0, s0 + m * L, L)):
        # consecutive whole rows: one span of m·L + 1 tokens, inputs and targets views of it
        n = m * L
        pc = _span_pieces(stream, s0, s0 + n + 1)
        counts = _source_counts(pc, K)
        flat = _gather(pc, tokens, eot, counts).astype(np.int64)
        inputs, targets = flat[:n].reshape(m, L), flat[1:].reshape(m, L)
        if ignore_cross:  # the target after each document's end-of-text
            e = pc.eot_at
            targets = targets.copy()
            targets.reshape(-1)[e[:-1] if len(e) and e[-1] == n else e] = ignore_index
        counts[int(pc.src[-1])] -= 1  # the span's last token is only a target
        out = {"input_ids": inputs, "targets": targets, "sample_ids": np.array(first, np.int64),
               "source_tokens": counts}
        if annotate:
            out.update(_span_annotations(stream, pc, m, L, doc_base, fields))
        return out

    s = np.where(starts >= 0, starts, T)
    cap = T if limits is None else np.minimum(np.asarray(limits, np.int64), T)
    rlen = np.maximum(np.minimum(s + W, cap) - s, 0)  # stream tokens in the row's L + 1 slots
    full = bool((rlen == W).all())
    pc = _row_pieces(stream, s, s + rlen)
    counts = _source_counts(pc, K)
    vals = _gather(pc, tokens, eot, counts)
    fill = None if full else _arange(W)[None, :] < rlen[:, None]
    if full:
        buf = vals.astype(np.int64).reshape(m, W)
    else:
        buf = np.full((m, W), eot, np.int64)
        buf[fill] = vals
    targets = buf[:, 1:]
    beyond = None if full else _arange(L)[None, :] >= (rlen - 1)[:, None]  # no input there
    if ignore_cross or not full:
        targets = targets.copy()
    if not full:
        targets[beyond] = ignore_index
    if ignore_cross:  # the target after each document's end-of-text
        row = pc.row[np.searchsorted(pc.cend, pc.eot_at, "right")]
        col = pc.eot_at - (np.cumsum(rlen) - rlen)[row]
        keep = col < L
        targets[row[keep], col[keep]] = ignore_index
    # each row's last token is only a target
    lasts = np.cumsum(rlen)[rlen > 0] - 1
    counts -= np.bincount(pc.src[np.searchsorted(pc.cend, lasts, "right")], minlength=K)
    out = {"input_ids": buf[:, :L], "targets": targets, "sample_ids": np.where(starts >= 0, starts, -1),
           "source_tokens": counts}
    if annotate:
        out.update(_annotations(stream, pc, s, fill, beyond, m, L, doc_base, fields))
    return out


def _annotations(stream: EpochStream, pc: _Pieces, s: np.ndarray, fill: np.ndarray | None,
                 beyond: np.ndarray | None, m: int, L: int, doc_base: np.ndarray | None,
                 fields: Collection[str]) -> dict[str, np.ndarray]:
    """The per-token fields asked for, from the rows' pieces (``fill``: the slots they cover;
    ``beyond``: input slots without an input, padding)."""
    W = L + 1
    out: dict[str, np.ndarray] = {}
    if "segment_ids" in fields:  # the document's number within the row
        k0 = np.searchsorted(stream.cum, s, "right") - 1
        out["segment_ids"] = _spread((pc.doc - k0[pc.row]).astype(np.int32), pc.plen, fill, m, W, -1)
    if "position_ids" in fields:  # the offset within the document's part of the row
        pos = _arange(pc.n) - np.repeat(pc.cend - pc.plen, pc.plen)
        out["position_ids"] = pos.reshape(m, W) if fill is None else np.zeros((m, W), np.int64)
        if fill is not None:
            out["position_ids"][fill] = pos
    if "sources" in fields:
        out["sources"] = _spread(pc.src.astype(np.int16), pc.plen, fill, m, W, -1)
    if doc_base is not None:
        out["doc_keys"] = _spread((doc_base[pc.src] + stream.doc[pc.doc]).astype(np.int64), pc.plen, fill, m, W, -1)
    for k, v in out.items():
        v = v[:, :L]
        if beyond is not None:  # the stream's last token: only a target
            v[beyond] = 0 if k == "position_ids" else -1
        out[k] = v
    return out


def _span_annotations(stream: EpochStream, pc: _Pieces, m: int, L: int, doc_base: np.ndarray | None,
                      fields: Collection[str]) -> dict[str, np.ndarray]:
    """The per-token fields asked for, for consecutive whole rows from their span's pieces: per
    token of the span, then restarted at each row (its first L·m tokens are the inputs)."""
    n, P = m * L, len(pc.plen)
    out: dict[str, np.ndarray] = {}
    if "segment_ids" in fields:  # the document's number within the row
        d = np.repeat(np.arange(P, dtype=np.int32), pc.plen)[:n].reshape(m, L)
        out["segment_ids"] = d - d[:, :1]
    if "position_ids" in fields:  # within the document's part of the row: at most the column
        pos = _arange(n + 1) - np.repeat(pc.cend - pc.plen, pc.plen)
        out["position_ids"] = np.minimum(pos[:n].reshape(m, L), _arange(L), out=pos[:n].reshape(m, L))
    if "sources" in fields:
        out["sources"] = np.repeat(pc.src.astype(np.int16), pc.plen)[:n].reshape(m, L)
    if doc_base is not None:
        keys = doc_base[pc.src] + stream.doc[pc.first:pc.first + P]
        out["doc_keys"] = np.repeat(keys.astype(np.int64), pc.plen)[:n].reshape(m, L)
    return out
