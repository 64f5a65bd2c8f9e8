"""Batches of images from a weighted mixture of image dataset artifacts, resumable mid-epoch at
any world size: the image ``Loader``'s pipeline over several artifacts, in a ``MixturePlan``'s order.

    from sluice.stages.load.image_mixture import MixtureLoader
    loader = MixtureLoader({"sources": [{"path": "data/web", "weight": 0.7},
                                        {"path": "data/studio", "weight": 0.3}], "epoch_size": 50_000},
                           split="train", batch_size=256)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for batch in loader:                 # a MixtureBatch: (images, labels, indices) as the Loader's
            images, labels, indices = batch  # uint8 NCHW (float when augmented), int64, int64
            batch.sources                    # int64 (B,): each sample's source (per-source metrics)

The order. Epoch e is the plan's order (``mixture.py``: per-source counts from ``weight`` /
``repeat`` / ``choose``, the draws, the stratified interleave; a pure function of (seed, e,
counts)), cut into global batches and dealt to the ranks by ``epochs.EpochCursor`` exactly as the
``Loader`` deals one split's order: rank r takes every world-th sample of each global batch. An
epoch's length is the plan's for that epoch, so it may change between epochs when weights change.

Indices. Every sample has one index over all sources: source i's split index j is
``offsets[i] + j``, ``offsets`` the cumulative split counts in the mixture's order (removed
samples of a version keep their indices, so an index names one stored sample; the plan draws only
live ones). ``locate(indices)`` turns them back into (source, split index). They name a sample
within a run's set of source versions: a source that grows between runs shifts the later ones.

Reading. Each source is read by its own backend (``memory``, ``webdataset``, ``ffcv``: the
``Loader``'s, chosen per source by ``resolve_backend``), each over its own part of this rank's
order, in order, a batch at a time; a mixture batch takes its next samples from each source's
stream and lays them out in the mixture's order. A sample a backend drops (``on_corrupt: skip``)
is dropped from the mixture batch. Then decode, transfer, augmentation and prefetch are the
``Loader``'s (``finish_batches``, ``prefetch``). The sources must agree on image shape (a fixed
one), channels and classes; DALI (which augments inside its own pipeline) and ``decode: device``
are refused.

State. ``state_dict`` holds the cursor's global position, the plan's state (the counts the epoch
began with and the change log) and each source's fingerprint. Resuming mid-epoch finishes that
epoch over the counts and versions it began with, at any world size; new weights (or new source
versions) take over at the next epoch, and each change is recorded (``mixture_changes``, and
``served_by_source()["changes"]`` in the run summary).
"""
from __future__ import annotations

import collections
import os
import time
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from sluice.errors import ArtifactError, LoaderError
from sluice.stages.contracts import Batch
from sluice.stages.host import workers_or_cores
from sluice.stages.load.augment import TorchAugment
from sluice.stages.load.backends import LOADER_BACKENDS, Backend, Timings
from sluice.stages.load.canvas import Canvas, Encoded
from sluice.stages.load.choice import resolve_backend
from sluice.stages.load.config import LoaderConfig, loader_device
from sluice.stages.load.epochs import EpochCursor
from sluice.stages.load.finish_batches import BatchFinisher, OnStream, check_resolution
from sluice.stages.load.mixture import MixtureConfig, MixturePlan
from sluice.stages.load.prefetch import prefetched
from sluice.stages.load.profile import bottleneck, gather_profile, profile_report
from sluice.storage.artifact import DatasetArtifact, open_artifact

__all__ = ["MixtureLoader", "MixtureBatch", "check_compatible"]

ORDERED_BY_PLAN = ("shuffle", "sequential")  # sampler kinds a mixture accepts: its order is the plan's


class MixtureBatch(Batch):
    """A ``Batch`` of a mixture: unpacks to ``(images, labels, indices)`` like any batch, and
    carries ``sources`` (int64 (B,), on the batch's device: each sample's source number, in the
    mixture's order) and ``source_samples`` (int64 (sources,): this batch's samples per source)."""
    sources: torch.Tensor
    source_samples: torch.Tensor

    @classmethod
    def of(cls, batch: Batch, sources: torch.Tensor, per_source: torch.Tensor) -> "MixtureBatch":
        out = cls(*batch)
        out.sources, out.source_samples = sources, per_source
        return out


def check_compatible(artifacts: Sequence[DatasetArtifact], names: Sequence[str]) -> tuple[int, int, int]:
    """The (H, W, C) every source shares; a ``LoaderError`` naming the sources that disagree on
    image shape or channels, classes or class names (one model reads every batch)."""
    def where(i: int) -> str:
        return f"{names[i]!r} ({artifacts[i].root})"
    shapes = [a.manifest.fields.image.shape for a in artifacts]
    for i, s in enumerate(shapes):
        if s is None:
            raise LoaderError(f"mixture source {where(i)} has images of variable sizes; an image mixture "
                              "needs one fixed shape (re-shard it with shard.image_size)")
    for what, get in (("image shape (H, W, C)", lambda a: tuple(a.manifest.fields.image.shape)),
                      ("number of classes", lambda a: a.manifest.fields.label.num_classes)):
        vals = [get(a) for a in artifacts]
        if len(set(vals)) > 1:
            listed = ", ".join(f"{where(i)}: {v}" for i, v in enumerate(vals))
            raise LoaderError(f"mixture sources disagree on {what}: {listed}; every source of an image "
                              "mixture must match")
    named = [(i, a.manifest.fields.label.class_names) for i, a in enumerate(artifacts)
             if a.manifest.fields.label.class_names]
    if len({tuple(c) for _, c in named}) > 1:
        listed = "; ".join(f"{where(i)}: {c}" for i, c in named)
        raise LoaderError(f"mixture sources name their classes differently ({listed}): label k must "
                          "mean the same class in every source")
    return tuple(shapes[0])  # type: ignore[return-value]


def kept_of(want: np.ndarray, got: np.ndarray) -> np.ndarray:
    """Which of ``want`` a backend returned as ``got`` (in order, the damaged ones left out)."""
    keep = np.zeros(len(want), bool)
    j = 0
    for p, w in enumerate(want.tolist()):
        if j < len(got) and int(got[j]) == w:
            keep[p] = True
            j += 1
    return keep


class _SourceStream:
    """One source's part of this rank's epoch (``want``: split indices, in order), read by its
    backend a batch at a time and handed out in the counts the mixture batches ask for."""

    def __init__(self, name: str, backend: Backend, want: np.ndarray, batch_size: int):
        self.name, self.want, self.batch = name, want, batch_size
        self.it = backend.epoch(want, batch_size, False, 0) if len(want) else iter(())
        self.kept = np.ones(len(want), bool)  # False: the backend dropped it (a damaged sample, skip)
        self.chunks: collections.deque = collections.deque()  # images read and not yet handed out
        self.head = 0  # of chunks[0], the images already handed out
        self.covered = 0  # positions of want whose backend batch has been read
        self.pos = 0  # positions of want handed out

    def take(self, k: int) -> tuple[torch.Tensor | np.ndarray | None, np.ndarray]:
        """The images of the next ``k`` positions (those the backend kept) and which it kept."""
        end = self.pos + k
        while self.covered < end:
            item = next(self.it, None)
            if item is None:
                raise LoaderError(f"mixture source {self.name!r}: its backend ended after {self.covered} "
                                  f"of the {len(self.want)} samples asked for")
            imgs, _, idx = item
            if isinstance(imgs, (Canvas, Encoded)):
                raise LoaderError(f"mixture source {self.name!r}: its backend handed over "
                                  f"{type(imgs).__name__} batches; a mixture needs decoded images of one shape")
            lo, hi = self.covered, min(self.covered + self.batch, len(self.want))
            if len(idx) != hi - lo:  # only then read the indices (on a GPU: a sync)
                got = idx.cpu().numpy() if isinstance(idx, torch.Tensor) else np.asarray(idx)
                self.kept[lo:hi] = kept_of(self.want[lo:hi], got)
            if len(idx):
                self.chunks.append(imgs)
            self.covered = hi
        mask = self.kept[self.pos:end]
        need, parts = int(mask.sum()), []
        while need:
            head = self.chunks[0]
            n = min(need, len(head) - self.head)
            parts.append(head[self.head:self.head + n])
            self.head += n
            need -= n
            if self.head == len(head):
                self.chunks.popleft()
                self.head = 0
        self.pos = end
        if not parts:
            return None, mask
        return parts[0] if len(parts) == 1 else torch.cat([torch.as_tensor(p) for p in parts]), mask

    def close(self) -> None:
        close = getattr(self.it, "close", None)
        if close is not None:
            close()


class _Guards:
    """The sources' damage guards as one (what the profile reads)."""

    def __init__(self, backends: Sequence[Backend]):
        self.backends = backends

    @property
    def skipped(self) -> int:
        return sum(int(getattr(getattr(b, "guard", None), "skipped", 0)) for b in self.backends)


class MixtureReads:
    """The sources' backends as one backend over the mixture's index space: ``epoch`` takes this
    rank's order (mixture indices), reads each source's part with its own backend and yields raw
    NHWC batches in the mixture's order, with the mixture's labels and indices."""
    augments = False
    reads_shards = False

    def __init__(self, names: Sequence[str], backends: Sequence[Backend], offsets: np.ndarray,
                 labels: np.ndarray, image: tuple[int, int, int], pin: bool):
        self.names, self.backends, self.offsets, self.labels = list(names), list(backends), offsets, labels
        self.image, self.pin = image, pin
        self.forks_per_epoch = any(getattr(b, "forks_per_epoch", False) for b in backends)
        self.guard = _Guards(self.backends)
        self.own = Timings()  # the interleave's own seconds ("gather")

    @property
    def timings(self) -> Timings:
        out = Timings()
        for b in self.backends:
            out.merge(b.timings)
        out.merge(self.own)
        return out

    def sample_file(self, index: int) -> str:
        s = int(np.searchsorted(self.offsets, index, side="right") - 1)
        return self.backends[s].sample_file(int(index - self.offsets[s]))

    def epoch(self, order: np.ndarray, batch_size: int, drop_last: bool, start_batch: int = 0, *,
              resolution: int | None = None, epoch: int = 0) -> Iterator[tuple[Any, np.ndarray, np.ndarray]]:
        """Batches of ``order[start_batch * batch_size:]`` (mixture indices), in order."""
        stop = (len(order) // batch_size) * batch_size if drop_last else len(order)
        order = np.asarray(order[start_batch * batch_size:stop], np.int64)
        src = np.searchsorted(self.offsets, order, side="right") - 1
        local = order - self.offsets[src]
        streams = [_SourceStream(n, b, local[src == i], batch_size)
                   for i, (n, b) in enumerate(zip(self.names, self.backends))]
        try:
            for lo in range(0, len(order), batch_size):
                yield self._batch(streams, order[lo:lo + batch_size], src[lo:lo + batch_size])
        finally:
            for s in streams:
                s.close()

    def _batch(self, streams: list[_SourceStream], win: np.ndarray,
               src: np.ndarray) -> tuple[Any, np.ndarray, np.ndarray]:
        keep = np.ones(len(win), bool)
        pieces = []
        for i in np.unique(src).tolist():
            pos = np.flatnonzero(src == i)
            imgs, kept = streams[i].take(len(pos))
            keep[pos[~kept]] = False
            if imgs is not None:
                pieces.append((pos[kept], imgs))
        t = time.perf_counter()
        idx = win[keep]
        if len(pieces) == 1 and len(pieces[0][0]) == len(idx):  # one source: as its backend gave it
            images = pieces[0][1]
        else:
            images = self._interleave(pieces, np.cumsum(keep) - 1, len(idx))
        self.own.add("gather", time.perf_counter() - t)
        return images, self.labels[idx], idx

    def _interleave(self, pieces: list, dest: np.ndarray, m: int) -> torch.Tensor:
        """The sources' images laid out in the mixture's order (``dest``: each kept position's place)."""
        ts = [(p, torch.as_tensor(x)) for p, x in pieces]
        cuda = next((t.device for _, t in ts if t.device.type == "cuda"), None)
        dev = cuda or torch.device("cpu")
        out = torch.empty((m, *self.image), dtype=torch.uint8, device=dev,
                          pin_memory=self.pin and cuda is None)
        for p, t in ts:
            where = torch.as_tensor(dest[p], dtype=torch.int64)
            if cuda is not None:
                t, where = t.to(dev, non_blocking=True), where.to(dev, non_blocking=True)
            out[where] = t
        return out

    def close(self) -> None:
        for b in self.backends:
            b.close()


class MixtureLoader:
    """Batches (``MixtureBatch``) of a weighted mixture of image artifacts' ``split``, in the
    plan's order, on the device; see the module docstring. ``mixture``: a ``MixtureConfig`` (or its
    dict); ``artifacts`` (in the mixture's order) default to opening each source's ``path``.
    ``config`` and keyword overrides are the ``Loader``'s (its ``sampler`` only for ``partition``:
    the order is the plan's)."""

    def __init__(self, mixture: MixtureConfig | dict, config: LoaderConfig | dict | None = None, *,
                 artifacts: Sequence[str | os.PathLike | DatasetArtifact] | None = None,
                 rank: int = 0, world_size: int = 1, device: torch.device | None = None, **overrides: Any):
        cfg = config if isinstance(config, LoaderConfig) else LoaderConfig.model_validate(config or {})
        if overrides:
            cfg = LoaderConfig.model_validate({**dict(cfg), **overrides})
        mix = mixture if isinstance(mixture, MixtureConfig) else MixtureConfig.model_validate(mixture)
        if not 0 <= rank < world_size:
            raise LoaderError(f"rank {rank} is outside world size {world_size}")
        _check_order_settings(cfg)
        self.config, self.rank, self.world_size = cfg, rank, world_size
        self.artifacts = self._open(mix, cfg, artifacts)
        self.image = check_compatible(self.artifacts, mix.names)
        split = cfg.split
        counts = [a.manifest.splits[split].count for a in self.artifacts]
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.live = [a.live(split) if a.manifest.splits[split].removed else None for a in self.artifacts]
        self.plan = MixturePlan(mix, [len(lv) if lv is not None else n for lv, n in zip(self.live, counts)])
        self.labels = np.concatenate([np.asarray(a.labels(split), np.int64) for a in self.artifacts])
        self.device = loader_device(cfg.device, device)
        self.workers = workers_or_cores(cfg.workers)
        self.backend_names = [resolve_backend(a, cfg) for a in self.artifacts]
        for name, (be, _) in zip(mix.names, self.backend_names):
            if LOADER_BACKENDS.get(be).augments:
                raise LoaderError(f"mixture source {name!r} would be read by {be}, which augments inside "
                                  "its own pipeline; a mixture interleaves decoded batches: use memory, "
                                  "webdataset or ffcv")
        self.backend_name = "+".join(dict.fromkeys(be for be, _ in self.backend_names))
        self.backend_reason = "; ".join(f"{n}: {why}" for n, (_, why) in zip(mix.names, self.backend_names)) \
            + "; decode: cpu (a mixture interleaves decoded batches)"
        self.cursor = EpochCursor(self.order_for, self.plan.epoch_size(0), rank=rank, world=world_size,
                                  batch=cfg.batch_size, drop_last=cfg.drop_last, mode=cfg.sampler.partition,
                                  length=self.plan.epoch_size)
        self.augment = TorchAugment(cfg.augment, cfg.seed, fast_cpu=True, threads=max(1, self.workers))
        self.timings = Timings()
        self.samples_seen = 0
        self.wall_s = 0.0
        self._iter_t0: float | None = None
        self._reads: MixtureReads | None = None
        self._served_before = np.zeros(len(self.artifacts), np.int64)  # restored from a state
        self._served: torch.Tensor | None = None  # counted on the batches' device: no sync per batch
        self._offsets_on: dict[torch.device, torch.Tensor] = {}

    @staticmethod
    def _open(mix: MixtureConfig, cfg: LoaderConfig,
              given: Sequence[str | os.PathLike | DatasetArtifact] | None) -> list[DatasetArtifact]:
        if given is None:
            missing = [s.name for s in mix.sources if s.path is None]
            if missing:
                raise LoaderError(f"mixture sources {missing} have no path: give each an artifact path, "
                                  "or pass the artifacts")
            given = [s.path for s in mix.sources]  # type: ignore[misc]
        if len(given) != len(mix.sources):
            raise LoaderError(f"{len(given)} artifacts for a mixture of {len(mix.sources)} sources")
        c, out = cfg.cache, []
        for name, a in zip(mix.names, given):
            art = a if isinstance(a, DatasetArtifact) else open_artifact(a, c.dir, c.max_bytes, c.retries,
                                                                          c.prefetch_shards)
            m = art.manifest
            if cfg.split not in m.splits:
                raise ArtifactError(f"mixture source {name!r}: split {cfg.split!r} is not in {art.root}; "
                                    f"it has {sorted(m.splits)}")
            if m.splits[cfg.split].count == 0:
                raise ArtifactError(f"mixture source {name!r}: split {cfg.split!r} of {art.root} is empty")
            if cfg.verify != "none":
                art.verify([cfg.split], deep=cfg.verify == "full")
            check_resolution(cfg, art)
            out.append(art)
        return out

    # ------------------------------------------------------------------ order
    @property
    def names(self) -> list[str]:
        return self.plan.names

    @property
    def epoch(self) -> int:
        return self.cursor.epoch

    def order_for(self, epoch: int, global_batch: int = 0) -> np.ndarray:
        """The epoch's global order as mixture indices (``offsets[source] + split index``)."""
        src, j = self.plan.order(epoch)
        idx = j.copy()
        for i, lv in enumerate(self.live):
            if lv is not None:
                m = src == i
                idx[m] = lv[j[m]]
        return self.offsets[src] + idx

    def locate(self, indices: np.ndarray | torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """(source number, split index within it) of each mixture index."""
        flat = np.asarray(indices.cpu() if isinstance(indices, torch.Tensor) else indices, np.int64)
        src = np.searchsorted(self.offsets, flat, side="right") - 1
        return src, flat - self.offsets[src]

    def sources_of(self, indices: torch.Tensor) -> torch.Tensor:
        """Each mixture index's source number, on the indices' device (no sync)."""
        if len(self.offsets) == 2:
            return torch.zeros_like(indices)
        off = self._offsets_on.get(indices.device)
        if off is None:
            off = self._offsets_on[indices.device] = torch.as_tensor(self.offsets[1:-1]).to(indices.device)
        return torch.searchsorted(off, indices, right=True)

    def epoch_counts(self, epoch: int | None = None) -> dict[str, int]:
        """Samples each source gives an epoch (over all ranks, before padding to the world)."""
        e = self.epoch if epoch is None else epoch
        return dict(zip(self.names, self.plan.counts_for(e).tolist()))

    def epoch_indices(self, epoch: int | None = None) -> np.ndarray:
        """This rank's mixture indices for an epoch, in order (what the batches will carry)."""
        return self.cursor.rank_order(epoch)[0]

    # ------------------------------------------------------------------ contract
    def __len__(self) -> int:
        return self.cursor.batches()

    def set_epoch(self, epoch: int) -> None:
        """Go to ``epoch``; the same epoch, read to its end, starts again (an evaluation re-reads it)."""
        if epoch == self.cursor.epoch and self.cursor.next_batch >= len(self):
            self.cursor.restart(epoch)
        self.cursor.set_epoch(epoch)

    def resolution(self, epoch: int | None = None) -> int | None:
        r = self.config.resolution
        return r.at(self.epoch if epoch is None else epoch) if r else None

    def backend(self) -> MixtureReads:
        """Every source's backend, opened on first use in the caller's thread (they may fork
        workers: ``sluice.process_rules``, rule 2); streaming backends share the workers."""
        if self._reads is None:
            k, cfg = len(self.artifacts), self.config.model_copy(update={"decode": "cpu"})
            shared = self.workers if self.workers == 0 else max(1, self.workers // k)
            opened = []
            for a, (be, _) in zip(self.artifacts, self.backend_names):
                opened.append(LOADER_BACKENDS.get(be).open(a, cfg.split, cfg, self.device,
                                                           self.workers if be == "memory" else shared))
            self._reads = MixtureReads(self.names, opened, self.offsets, self.labels, self.image,
                                       pin=self.device.type == "cuda")
        return self._reads

    def __iter__(self) -> Iterator[MixtureBatch]:
        """This rank's batches from the cursor's position to the epoch's end."""
        epoch, start = self.cursor.iteration_start()  # a finished epoch: the next one
        order, drop_last = self.cursor.rank_order(epoch)
        cfg, reads = self.config, self.backend()
        t0 = self._iter_t0 = time.perf_counter()
        res = self.resolution(epoch)
        finisher = BatchFinisher(self.device, self.augment, cfg.seed, cfg.batch_size, self.timings, None,
                                 self.image)

        def batches() -> Iterator[Batch | OnStream]:
            return finisher.batches(reads, order, epoch, start, drop_last, res)  # type: ignore[arg-type]
        produced = prefetched(batches, cfg.prefetch, reads.forks_per_epoch, self.timings)
        k = len(self.artifacts)
        try:
            for batch in produced:
                if isinstance(batch, OnStream):
                    batch = batch.hand_over(self.device)
                src = self.sources_of(batch.indices)
                per = torch.bincount(src, minlength=k)
                self._served = per if self._served is None else self._served + per
                self.cursor.advance()
                self.samples_seen += len(batch.labels)
                yield MixtureBatch.of(batch, src, per)
        finally:
            produced.close()
            self.wall_s += time.perf_counter() - t0
            self._iter_t0 = None

    # ------------------------------------------------------------------ what was served
    @property
    def source_samples(self) -> np.ndarray:
        """Samples this rank served per source (padding repeats included), since the run began."""
        now = self._served.cpu().numpy().astype(np.int64) if self._served is not None else 0
        return self._served_before + now

    def served_by_source(self) -> dict[str, Any]:
        """Samples this rank served per source over the run, and the mixture's recorded changes
        (the trainer sums them over ranks into the run summary)."""
        return {"unit": "samples", "served": dict(zip(self.names, self.source_samples.tolist())),
                "changes": self.mixture_changes}

    @property
    def mixture_changes(self) -> list[dict[str, Any]]:
        """Each change of the mixture's counts: ``{"epoch", "old", "new"}`` (for the run report)."""
        return self.plan.changes

    # ------------------------------------------------------------------ state
    def fingerprints(self) -> dict[str, str]:
        return {n: a.fingerprint for n, a in zip(self.names, self.artifacts)}

    def state_dict(self) -> dict[str, Any]:
        """Where the caller is (global but for ``rank`` and the per-rank ``source_samples``):
        resuming from it yields exactly the next batch, at this world size or another."""
        return {**self.cursor.state_dict(), "kind": "image_mixture", "rank": self.rank,
                "world_size": self.world_size, "split": self.config.split,
                "batch_size": self.config.batch_size, "fingerprints": self.fingerprints(),
                "mixture": self.plan.state_dict(self.cursor.epoch),
                "source_samples": self.source_samples.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (written at any world size): the rest of its epoch over the
        counts and source versions it began with, then the config's mixture. A state at an
        epoch's start or end is a boundary: the config's mixture (and sources) take over there."""
        if state.get("kind") != "image_mixture":
            raise LoaderError(f"not an image mixture loader state (kind={state.get('kind')!r})")
        if state.get("split") != self.config.split:
            raise LoaderError(f"loader state has split={state.get('split')!r}, this loader {self.config.split!r}")
        try:
            epoch, nxt, world, batch = (int(state[k]) for k in ("epoch", "next_batch", "world_size", "batch_size"))
            consumed, end = int(state["consumed"]), int(state["end"])
        except (KeyError, TypeError, ValueError) as e:
            raise LoaderError(f"image mixture loader state lacks or garbles {e}") from None
        if min(epoch, nxt, consumed) < 0 or world < 1 or batch < 1 or not 0 <= consumed <= end:
            raise LoaderError(f"image mixture loader state has epoch {epoch}, next_batch {nxt}, "
                              f"{consumed} of {end} samples consumed: not a position")
        if consumed >= end:  # finished: the next epoch starts fresh, under this config
            self.plan.load_state_dict({**state["mixture"], "epoch": epoch + 1}, begun=False)
            self.cursor.restart(epoch + 1)
        elif consumed == 0:  # not begun: this epoch follows this config
            self.plan.load_state_dict(state["mixture"], begun=False)
            self.cursor.restart(epoch)
        else:
            old, now = state.get("fingerprints", {}), self.fingerprints()
            moved = {n: f"{str(old.get(n))[:12]} -> {now[n][:12]}" for n in now if n in old and old[n] != now[n]}
            if moved:
                raise LoaderError(f"epoch {epoch} began over other versions of mixture sources {moved}; "
                                  "an epoch finishes over the data it began with: resume with those "
                                  "versions, or at an epoch boundary")
            self.plan.load_state_dict(state["mixture"], begun=True)
            self.cursor.load_state_dict(state, world=world, batch=batch)
        if world == self.world_size and state.get("rank") == self.rank and "source_samples" in state:
            self._served_before = np.asarray(state["source_samples"], np.int64)
            self._served = None

    # ------------------------------------------------------------------ profiling
    def profile(self) -> dict[str, float]:
        """Seconds per stage over every source's backend and the loader's own work, as the
        ``Loader``'s ``profile``."""
        wall = self.wall_s + (time.perf_counter() - self._iter_t0 if self._iter_t0 else 0.0)
        return gather_profile(self._reads, self.timings, self.samples_seen, wall)  # type: ignore[arg-type]

    def bottleneck(self) -> dict[str, Any]:
        return bottleneck(self.profile())

    def profile_report(self) -> str:
        cache = next((a.cache for a in self.artifacts if a.cache is not None), None)
        return profile_report(self.profile(), self.bottleneck(), self.backend_name, self.backend_reason, cache)

    def close(self) -> None:
        if self._reads is not None:
            self._reads.close()
            self._reads = None


def _check_order_settings(cfg: LoaderConfig) -> None:
    """Refuse the sampler settings a mixture cannot honour (its order is the plan's), and
    ``decode: device`` (the sources' batches are interleaved decoded)."""
    s = cfg.sampler
    if s.kind not in ORDERED_BY_PLAN or s.scores or s.subset:
        raise LoaderError(f"an image mixture's order is the mixture plan's (weights, repeat, choose); "
                          f"sampler kind {s.kind!r}" + (", scores" if s.scores else "")
                          + (", subset" if s.subset else "") + " cannot apply: leave the sampler at "
                          "shuffle (only its partition is used)")
    if cfg.decode == "device":
        raise LoaderError("loader.decode: device does not apply to an image mixture (the sources' "
                          "batches are interleaved decoded); use auto or cpu")
