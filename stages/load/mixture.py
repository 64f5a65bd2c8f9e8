"""Weighted mixtures of sources: how many samples each source gives an epoch, which ones, and in
what global order — a pure function of (seed, epoch, counts), so every rank builds the same order
and a position in it means the same samples at any world size.

Counts (Mosaic's semantics). Either every source has a ``weight`` (``proportion``): source i
gives ``c_i`` of ``epoch_size`` samples (default Σ n_i), the quotas ``q_i = w_i / Σw ×
epoch_size`` rounded by the largest-remainder (Hamilton) rule: ``floor(q_i)`` each, then one more
to the sources with the largest fractional parts (ties to the earlier source) until Σ c_i =
epoch_size. Each ``c_i`` is ``floor(q_i)`` or ``ceil(q_i)``, and equals ``round(q_i)`` whenever
the rounded quotas already sum to the epoch size. Quotas are computed in exact fractions, so no
float rounding decides a count. Or every source has an absolute count: ``repeat: r`` gives
``round(r × n_i)`` (half up), ``choose: k`` gives ``k``; the epoch is their sum. Weights in
tokens (``weight_unit: tokens``, a token loader's mixture: a language model's mixtures are
stated in tokens, and documents differ in length by orders of magnitude across sources): the
quotas are of ``epoch_size`` tokens (default all of them) and each becomes
``round(q_i × n_i / t_i)`` documents, ``t_i`` the source's tokens.

Draws. ``c_i ≤ n_i``: ``c_i`` distinct samples, a fresh seeded choice each epoch. ``c_i > n_i``:
whole passes, each a fresh permutation of the source, the last pass partial (every sample
``floor`` or ``ceil`` of ``c_i / n_i`` times). Seeds are (seed, epoch, crc32(name), pass), so
reordering the sources in the config changes no source's draw. A source's ``n_i`` samples are
the ones it may give (``SeededDraw.items``: a version's live samples, or the ``subset`` a warm
run trains on). A source may bring a draw of its own instead (``MixturePlan(draws=...)``: the
image loader's one source is ordered by its sampler, shuffle, curriculum or weighted alike).

Interleave. ``stratified`` (default): item j of source i gets the key ``(j + u) / c_i`` with
``u ~ U(0, 1)``, and the epoch is sorted by key: every prefix of the order holds each source
within about one sample of its share, so every global batch is near the mixture. ``shuffle``:
a seeded permutation of the source labels.

Changes between runs. The counts in force for an epoch are fixed once it has begun: resuming
mid-epoch with new weights finishes that epoch with the OLD counts (recorded in the loader
state), and the next epoch follows the new ones. Every change is recorded as
``{"epoch", "old", "new"}`` (``old``/``new``: per source name, its spec and count) in
``MixturePlan.changes``, carried in the state from run to run.
"""
from __future__ import annotations

import dataclasses
import zlib
from fractions import Fraction
from pathlib import PurePath
from typing import Any, Literal, Protocol, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from sluice.errors import LoaderError


class SourceSpec(BaseModel):
    """One source of a mixture: where it is, its name, and exactly one of weight / repeat / choose."""
    model_config = ConfigDict(extra="forbid")
    path: str | None = Field(None, description="where the source lives (a token split's root, an artifact)")
    name: str | None = Field(None, description="unique; default: the path's last part, else source<i>")
    weight: float | None = Field(None, gt=0, description="proportion: a share of epoch_size")
    repeat: float | None = Field(None, gt=0, description="absolute: round(repeat × the source's size)")
    choose: int | None = Field(None, ge=0, description="absolute: exactly this many per epoch")
    subset: str | None = Field(None, description=".npy of the source's split indices (documents, images) "
                               "to draw from: a warm run's new and replayed samples; default: all of them")

    @model_validator(mode="after")
    def _one_rule(self) -> "SourceSpec":
        given = [k for k in ("weight", "repeat", "choose") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"a mixture source needs exactly one of weight, repeat, choose; got "
                             f"{given or 'none'} (source {self.name or self.path!r})")
        return self

    @property
    def rule(self) -> tuple[str, float]:
        k = next(k for k in ("weight", "repeat", "choose") if getattr(self, k) is not None)
        return k, getattr(self, k)


class MixtureConfig(BaseModel):
    """``sources: [{path, name, weight | repeat | choose}]``; ``epoch_size`` only with weights."""
    model_config = ConfigDict(extra="forbid")
    sources: list[SourceSpec] = Field(min_length=1)
    epoch_size: int | None = Field(None, ge=1, description="proportion: samples per epoch (default Σ sizes); "
                                   "tokens per epoch with weight_unit tokens (default Σ tokens)")
    weight_unit: Literal["samples", "tokens"] = Field(
        "samples", description="what a weight is a share of: samples (documents, images: Mosaic's "
        "proportion) or tokens (a token loader: each source gets its share of the epoch's tokens)")
    seed: int = 0
    interleave: Literal["stratified", "shuffle"] = "stratified"

    @model_validator(mode="after")
    def _check(self) -> "MixtureConfig":
        for i, s in enumerate(self.sources):
            if s.name is None:
                s.name = PurePath(s.path).name if s.path else f"source{i}"
        names = [s.name for s in self.sources]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"mixture source names must be unique; repeated: {dup}")
        weighted = [s.weight is not None for s in self.sources]
        if any(weighted) and not all(weighted):
            raise ValueError("a mixture is either all proportions (weight) or all absolute counts "
                             "(repeat/choose), as in Mosaic's streams; it mixes both")
        if self.epoch_size is not None and not all(weighted):
            raise ValueError("epoch_size applies to weights; with repeat/choose the epoch is their sum")
        if self.weight_unit == "tokens" and not all(weighted):
            raise ValueError("weight_unit tokens applies to weights; repeat/choose count samples")
        return self

    @property
    def proportional(self) -> bool:
        return self.sources[0].weight is not None

    @property
    def names(self) -> list[str]:
        return [str(s.name) for s in self.sources]

    @classmethod
    def once_each(cls, n_sources: int, seed: int = 0) -> "MixtureConfig":
        """Every sample of every source once per epoch (``repeat: 1``): the no-mixture default."""
        return cls(sources=[SourceSpec(name=f"source{i}", repeat=1.0) for i in range(n_sources)], seed=seed)


def largest_remainder(weights: Sequence[float], total: int) -> np.ndarray:
    """Integer shares of ``total`` in proportion to ``weights`` summing exactly to ``total``
    (Hamilton's rule, exact fractions; ties to the earlier index)."""
    w = [Fraction(x) for x in weights]
    if not w or any(x <= 0 for x in w):
        raise LoaderError(f"weights must be > 0, got {list(weights)}")
    s = sum(w)
    quotas = [x * total / s for x in w]
    floors = [q.numerator // q.denominator for q in quotas]
    left = total - sum(floors)
    by_rest = sorted(range(len(w)), key=lambda i: (-(quotas[i] - floors[i]), i))
    for i in by_rest[:left]:
        floors[i] += 1
    return np.asarray(floors, dtype=np.int64)


def epoch_counts(config: MixtureConfig, sizes: Sequence[int], tokens: Sequence[int] | None = None) -> np.ndarray:
    """Samples each source gives one epoch (see the module docstring). ``tokens``: each source's
    tokens (a token loader's, end-of-text included), for ``weight_unit: tokens``."""
    if len(sizes) != len(config.sources):
        raise LoaderError(f"{len(sizes)} source sizes for {len(config.sources)} mixture sources")
    if any(n < 1 for n in sizes):
        empty = [s.name for s, n in zip(config.sources, sizes) if n < 1]
        raise LoaderError(f"mixture sources {empty} are empty")
    if config.proportional and config.weight_unit == "tokens":
        return _token_share_counts(config, sizes, tokens)
    if config.proportional:
        total = config.epoch_size if config.epoch_size is not None else int(sum(sizes))
        return largest_remainder([float(s.weight) for s in config.sources], total)
    out = []
    for s, n in zip(config.sources, sizes):
        if s.choose is not None:
            out.append(int(s.choose))
        else:
            q = Fraction(s.repeat) * n
            out.append(int((q + Fraction(1, 2)) // 1))
    counts = np.asarray(out, dtype=np.int64)
    if counts.sum() == 0:
        raise LoaderError("the mixture's counts sum to zero: an epoch would be empty")
    return counts


def _token_share_counts(config: MixtureConfig, sizes: Sequence[int], tokens: Sequence[int] | None) -> np.ndarray:
    """Documents per source so that each source's tokens are its weight's share of the epoch's
    (``epoch_size`` tokens, default all of them): the token quotas by the largest-remainder rule,
    each divided by its source's mean document length and rounded half up. A source's documents
    differ in length, so its tokens in an epoch match the quota in expectation over the draw
    (exactly when every document is drawn a whole number of times)."""
    if tokens is None or len(tokens) != len(sizes):
        raise LoaderError("weight_unit tokens needs each source's token count: only a token loader has them")
    if any(t < 1 for t in tokens):
        raise LoaderError(f"mixture sources {[s.name for s, t in zip(config.sources, tokens) if t < 1]} "
                          "hold no tokens")
    total = config.epoch_size if config.epoch_size is not None else int(sum(tokens))
    quotas = largest_remainder([float(s.weight) for s in config.sources], total)
    counts = np.asarray([(2 * int(q) * int(n) + int(t)) // (2 * int(t)) for q, n, t in zip(quotas, sizes, tokens)],
                        dtype=np.int64)
    if counts.sum() == 0:
        raise LoaderError(f"the mixture's token quotas ({quotas.tolist()}) are each under half a document")
    return counts


def source_key(name: str) -> int:
    """A stable number for a source's seeds: its name's crc32 (not its place in the list)."""
    return zlib.crc32(name.encode())


def draw(n: int, count: int, seed: int, epoch: int, key: int) -> np.ndarray:
    """``count`` indices of a source of ``n``: distinct when ``count <= n``, else whole passes
    (each a fresh permutation) and a partial last one."""
    full, part = divmod(int(count), int(n))
    parts = [np.random.default_rng([seed, epoch, key, p]).permutation(n) for p in range(full)]
    if part:
        parts.append(np.random.default_rng([seed, epoch, key, full]).choice(n, part, replace=False))
    return np.concatenate(parts).astype(np.int64) if parts else np.empty(0, np.int64)


class SourceDraw(Protocol):
    """Which samples of one source an epoch takes, in order: ``count`` of its ``len()`` samples,
    as the source's own indices (split indices, documents). ``fixed``: the same arguments always
    give the same draw (the plan may keep it); a sampler whose weights change between calls is not."""
    fixed: bool

    def __len__(self) -> int: ...
    def __call__(self, epoch: int, count: int, global_batch: int) -> np.ndarray: ...


@dataclasses.dataclass(frozen=True)
class SeededDraw:
    """The plan's own draw (``draw``) over ``n`` samples, seeded by (seed, epoch, the source's
    key); ``items`` maps draw positions to the source's indices (its live samples, a subset)."""
    n: int
    seed: int
    key: int
    items: np.ndarray | None = None
    fixed = True

    def __len__(self) -> int:
        return self.n

    def __call__(self, epoch: int, count: int, global_batch: int) -> np.ndarray:
        idx = draw(self.n, count, self.seed, epoch, self.key)
        return self.items[idx] if self.items is not None else idx


def mixture_order(counts: np.ndarray, sizes: Sequence[int], names: Sequence[str], seed: int,
                  epoch: int, interleave: str = "stratified", draws: Sequence[SourceDraw] | None = None,
                  global_batch: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The epoch's global order as two arrays: source number and index within that source
    (``draws``: each source's own draw; default the plan's seeded ones over ``sizes``)."""
    counts = np.asarray(counts, dtype=np.int64)
    if draws is None:
        draws = [SeededDraw(int(n), seed, source_key(nm)) for n, nm in zip(sizes, names)]
    idx = np.concatenate([d(epoch, int(c), global_batch) for d, c in zip(draws, counts)]).astype(np.int64)
    labels = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    if len(counts) == 1:  # one source: every interleave keeps its draw's order
        return labels, idx
    rng = np.random.default_rng([seed, epoch, 0x6D6978])  # "mix"
    if interleave == "shuffle":
        perm = rng.permutation(len(labels))
    elif interleave == "stratified":
        rank = np.arange(len(labels)) - np.repeat(np.cumsum(counts) - counts, counts)
        keys = (rank + rng.random(len(labels))) / np.repeat(np.maximum(counts, 1), counts)
        perm = np.argsort(keys, kind="stable")
    else:
        raise LoaderError(f"unknown interleave {interleave!r}; use stratified or shuffle")
    return labels[perm], idx[perm]


class MixturePlan:
    """The mixture in force: counts per epoch (an epoch begun under other counts keeps them) and
    each epoch's order. ``sizes``: samples (images, documents) each source may give, in config
    order (default: each draw's length); ``tokens``: their tokens, for weights in tokens;
    ``draws``: each source's own draw (default: the plan's seeded draws over ``sizes``)."""

    def __init__(self, config: MixtureConfig, sizes: Sequence[int] | None = None,
                 tokens: Sequence[int] | None = None, draws: Sequence[SourceDraw] | None = None):
        if sizes is None and draws is None:
            raise LoaderError("a mixture plan needs its sources' sizes or draws")
        self.config = config
        self.names = config.names
        self.sizes = [int(n) for n in (sizes if sizes is not None else [len(d) for d in draws])]  # type: ignore[union-attr]
        self.draws = list(draws) if draws is not None else None
        self.counts = epoch_counts(config, self.sizes, tokens)
        self.changes: list[dict[str, Any]] = []
        self._pinned: tuple[int, np.ndarray, list[str], list[int]] | None = None  # (epoch, counts, names, sizes)
        self._cache: tuple[tuple, tuple[np.ndarray, np.ndarray]] | None = None

    def counts_for(self, epoch: int) -> np.ndarray:
        """Per-source counts of ``epoch``: those of an epoch begun under older ones, else the config's."""
        if self._pinned is not None and self._pinned[0] == epoch:
            return self._pinned[1]
        return self.counts

    def epoch_size(self, epoch: int) -> int:
        return int(self.counts_for(epoch).sum())

    def order(self, epoch: int, global_batch: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(source, index) of every sample of ``epoch``, in order (``global_batch``: what the
        epoch is cut into, for a draw that paces by it, a curriculum); cached for the last asked."""
        counts = self.counts_for(epoch)
        key = (epoch, tuple(counts.tolist()), global_batch)
        if self.draws is not None and not all(d.fixed for d in self.draws):
            return mixture_order(counts, self.sizes, self.names, self.config.seed, epoch, self.config.interleave,
                                 self.draws, global_batch)
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, mixture_order(counts, self.sizes, self.names, self.config.seed, epoch,
                                              self.config.interleave, self.draws, global_batch))
        return self._cache[1]

    def _specs(self, counts: np.ndarray, names: list[str]) -> dict[str, dict[str, Any]]:
        rules = {s.name: s.rule for s in self.config.sources}
        return {n: ({rules[n][0]: rules[n][1]} if n in rules else {}) | {"count": int(c)}
                for n, c in zip(names, counts)}

    # ------------------------------------------------------------------ state
    def state_dict(self, epoch: int) -> dict[str, Any]:
        """What epoch ``epoch`` was built from, and the change log."""
        if self._pinned is not None and self._pinned[0] == epoch:
            _, counts, names, sizes = self._pinned
        else:
            counts, names, sizes = self.counts, self.names, self.sizes
        return {"epoch": int(epoch), "names": list(names), "sizes": list(sizes),
                "counts": [int(c) for c in counts], "seed": self.config.seed,
                "interleave": self.config.interleave,
                "spec": {s.name: dict([s.rule]) for s in self.config.sources},
                "changes": [dict(c) for c in self.changes]}

    def load_state_dict(self, state: dict[str, Any], *, begun: bool) -> None:
        """Continue from ``state``. ``begun``: its epoch has handed out samples, so it finishes
        with the counts it began with; the config's counts take over at the next epoch (at this
        one otherwise). A difference is recorded in ``changes``."""
        epoch = int(state["epoch"])
        if state.get("seed", self.config.seed) != self.config.seed:
            raise LoaderError(f"mixture state has seed {state['seed']}, this mixture {self.config.seed}: "
                              "another order")
        self.changes = [dict(c) for c in state.get("changes", [])]
        old_names, old_sizes = list(state["names"]), [int(n) for n in state["sizes"]]
        old_counts = np.asarray(state["counts"], dtype=np.int64)
        same = old_names == self.names and old_sizes == self.sizes and np.array_equal(old_counts, self.counts)
        if begun and (old_names != self.names or old_sizes != self.sizes):
            raise LoaderError(
                f"epoch {epoch} began over sources {dict(zip(old_names, old_sizes))} and the "
                f"mixture now has {dict(zip(self.names, self.sizes))}: an epoch can only finish "
                "over the sources it began with; resume at an epoch boundary to change them")
        self._pinned, self._cache = None, None
        if same:
            return
        at = epoch + 1 if begun else epoch
        old = {n: ({**state.get("spec", {}).get(n, {}), "count": int(c), "size": s})
               for n, c, s in zip(old_names, old_counts, old_sizes)}
        new = {n: v | {"size": s} for (n, v), s in zip(self._specs(self.counts, self.names).items(), self.sizes)}
        if not any(c.get("epoch") == at and c.get("new") == new for c in self.changes):
            self.changes.append({"epoch": at, "old": old, "new": new})
        if begun:
            self._pinned = (epoch, old_counts, old_names, old_sizes)


class MixtureSampler:
    """A mixture as a ``Sampler`` over the sources' concatenated index space (source i's sample j
    is ``offset_i + j``), for loaders that read one index space (``EpochCursor``, the image
    ``Loader``'s ``custom_sampler`` over a split that concatenates the sources). Keep its
    ``state_dict`` beside the loader's when weights may change between runs. To read several
    image artifacts as one mixture, use ``loader.Loader(mixture=...)``."""

    def __init__(self, plan: MixturePlan):
        self.plan = plan
        self.offsets = np.concatenate([[0], np.cumsum(plan.sizes)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.plan.counts.sum())

    def epoch_order(self, epoch: int) -> np.ndarray:
        src, idx = self.plan.order(epoch)
        return self.offsets[src] + idx

    def sources(self, flat: np.ndarray) -> np.ndarray:
        """The source number of each concatenated index (per-source metrics)."""
        return np.searchsorted(self.offsets, flat, side="right") - 1

    def state_dict(self, epoch: int) -> dict[str, Any]:
        return self.plan.state_dict(epoch)

    def load_state_dict(self, state: dict[str, Any], *, begun: bool) -> None:
        self.plan.load_state_dict(state, begun=begun)
