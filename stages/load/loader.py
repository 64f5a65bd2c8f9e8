"""One loader for image artifacts: one artifact, or a weighted mixture of several, read over
FFCV, DALI, WebDataset or RAM, with samplers, device-side augmentation, prefetching and exact
mid-epoch resume at any world size.

    from sluice.stages.load import Loader
    loader = Loader("sluice-data/datasets/fashion-mnist", split="train", batch_size=256,
                    augment=AugmentSpec.standard())
    mixed = Loader(mixture={"sources": [{"path": "data/web", "weight": 0.7},
                                        {"path": "data/studio", "weight": 0.3}], "epoch_size": 50_000},
                   split="train", batch_size=256)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for images, labels, indices in loader:   # float32 NCHW on the device, int64, int64
            ...

One source is a mixture of one. Every epoch's order is a ``MixturePlan``'s (``mixture``: how many
samples each source gives, which, and interleaved how), over one index space: source i's split
index j is ``offsets[i] + j`` (``locate`` turns it back). A single source is drawn by its sampler
(``loader.sampler``: shuffle, sequential, curriculum, weighted, ...), several by the plan's
seeded draws (their sampler only says ``partition``). The order is cut into global batches and
dealt to the ranks by ``epochs.EpochCursor``: rank r takes every world-th sample of each global
batch, so a position is global and resumes at any world size.

Reading: one source through its backend (``backends/``, chosen by ``choice``; ``remote`` fetches
a remote artifact's shards ahead), several through ``source_reads.MixtureReads`` (each source's
backend over its part of the order, interleaved); then decode, transfer, augmentation
(``finish_batches``) and prefetch (``prefetch``). With several sources a batch carries each
sample's ``sources`` and ``source_counts`` (per-source metrics); the sources must agree on image
shape, channels and classes, and DALI (which augments inside its own pipeline) and ``decode:
device`` are refused for them.

State: the cursor's global position, the plan's state (the counts the epoch began with and the
change log) and each source's fingerprint. Resuming mid-epoch finishes that epoch over the counts
and versions it began with; new weights (or new source versions) take over at the next epoch,
and each change is recorded (``mixture_changes``).

Importing this module imports neither FFCV nor DALI; a backend is imported when asked for, and a
missing one raises ``MissingDependency`` naming the pip package.
"""
from __future__ import annotations

import os
from pathlib import PurePath
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from sluice.errors import ArtifactError, LoaderError
from sluice.stages.contracts import Batch, Sampler
from sluice.stages.host import workers_or_cores
from sluice.stages.load.augment import TorchAugment
from sluice.stages.load.backends import LOADER_BACKENDS, Backend, Timings
from sluice.stages.load.base import LoaderBase, as_device
from sluice.stages.load.canvas import stored_channels
from sluice.stages.load.choice import resolve_backend
from sluice.stages.load.config import LoaderConfig, loader_device
from sluice.stages.load.device_decode import choose_decode
from sluice.stages.load.epochs import EpochCursor
from sluice.stages.load.finish_batches import BatchFinisher, OnStream, check_resolution
from sluice.stages.load.mixture import MixtureConfig, MixturePlan, SeededDraw, source_key
from sluice.stages.load.order import SamplerOrder, check_state
from sluice.stages.load.prefetch import prefetched
from sluice.stages.load.remote import prefetch_shards
from sluice.stages.load.source_reads import MixtureReads, check_compatible
from sluice.storage.artifact import DatasetArtifact, open_artifact

__all__ = ["Loader"]

ORDERED_BY_PLAN = ("shuffle", "sequential")  # sampler kinds several sources accept: their order is the plan's
Source = str | os.PathLike | DatasetArtifact


class Loader(LoaderBase):
    """Batches of one split of one or several image artifacts, in the plan's order, on the
    device (see the module docstring).

    ``artifact``: one artifact (a version, or a dataset root with LATEST), or a list of them
    (each read once an epoch); or ``mixture`` (a ``MixtureConfig`` or its dict: each source's
    ``path`` and ``weight``/``repeat``/``choose``), with ``artifacts`` opened already where given.
    ``rank``/``world_size`` give this process a disjoint, equal-length slice of every epoch.
    ``scores`` supplies the weighted/curriculum sampler's per-sample array (else
    ``sampler.scores``); ``custom_sampler`` (any object with ``__len__`` and ``epoch_order``)
    replaces the configured sampler (one source). ``device`` is the training device the loader
    feeds, anything ``torch.device`` accepts (what ``device: auto`` follows). Other keyword
    arguments override config fields.
    """

    def __init__(self, artifact: Source | Sequence[Source] | None = None, config: LoaderConfig | dict | None = None,
                 *, mixture: MixtureConfig | dict | None = None, artifacts: Sequence[Source] | None = None,
                 rank: int = 0, world_size: int = 1, scores: np.ndarray | None = None,
                 custom_sampler: Sampler | None = None, device: str | torch.device | None = None,
                 **overrides: Any):
        cfg = config if isinstance(config, LoaderConfig) else LoaderConfig.model_validate(config or {})
        if overrides:  # validated as fields (a dict for `cache` or `sampler` becomes its model)
            cfg = LoaderConfig.model_validate({**dict(cfg), **overrides})
        if not 0 <= rank < world_size:
            raise LoaderError(f"rank {rank} is outside world size {world_size}")
        mix, given = _sources(artifact, mixture, artifacts, cfg.seed)
        self.config, self.mixture, self.rank, self.world_size = cfg, mix, rank, world_size
        self.names = mix.names
        self.artifacts = [self._open(name, a, cfg) for name, a in zip(self.names, given)]
        self.artifact = self.artifacts[0]
        split, one = cfg.split, len(self.artifacts) == 1
        if not one:
            _check_mixture_settings(cfg, custom_sampler, scores)
        self.device = loader_device(cfg.device, as_device(device) if device is not None else None)
        self.workers = workers_or_cores(cfg.workers)
        encoding = self.artifact.manifest.fields.image.encoding
        # Where JPEG bytes become pixels: the backend's workers, or one batched call here (decode: device)
        self.decoding = choose_decode(cfg.decode if one else "cpu", self.device, encoding, max(1, self.workers))
        self.image = check_compatible(self.artifacts, self.names) if not one else \
            tuple(self.artifact.manifest.fields.image.shape or (1, 1, stored_channels(self.artifact)))
        counts = [a.manifest.splits[split].count for a in self.artifacts]
        self.n = int(sum(counts))
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        # A version that removed samples keeps their indices: no order may hold them.
        self.live = [a.live(split) if a.manifest.splits[split].removed else None for a in self.artifacts]
        self.sampler, draws = self._draws(custom_sampler, scores)
        self.plan = MixturePlan(mix, draws=draws)
        self.cursor = EpochCursor(self.order_for, self.plan.epoch_size(0), rank=rank, world=world_size,
                                  batch=cfg.batch_size, drop_last=cfg.drop_last, mode=cfg.sampler.partition,
                                  length=self.plan.epoch_size)
        self.backend_names = [resolve_backend(a, cfg) for a in self.artifacts]
        if not one:
            for name, (be, _) in zip(self.names, self.backend_names):
                if LOADER_BACKENDS.get(be).augments:
                    raise LoaderError(f"mixture source {name!r} would be read by {be}, which augments inside "
                                      "its own pipeline; a mixture interleaves decoded batches: use memory, "
                                      "webdataset or ffcv")
        self.backend_name = "+".join(dict.fromkeys(be for be, _ in self.backend_names))
        self.backend_reason = self.backend_names[0][1] if one else \
            "; ".join(f"{n}: {why}" for n, (_, why) in zip(self.names, self.backend_names)) \
            + "; decode: cpu (a mixture interleaves decoded batches)"
        self._labels: np.ndarray | None = None
        self._backend: Backend | MixtureReads | None = None
        # On CPU batches a leading RRC(+flip) runs in OpenCV over `workers` threads (same draws as
        # the torch path); CUDA batches take the torch path on the device.
        self.augment = TorchAugment(cfg.augment, cfg.seed, fast_cpu=True, threads=max(1, self.workers))
        self.timings = Timings()
        self._offsets_on: dict[torch.device, torch.Tensor] = {}

    @staticmethod
    def _open(name: str, a: Source, cfg: LoaderConfig) -> DatasetArtifact:
        c = cfg.cache
        art = a if isinstance(a, DatasetArtifact) else open_artifact(a, c.dir, c.max_bytes, c.retries, c.prefetch_shards)
        m = art.manifest
        if cfg.split not in m.splits:
            raise ArtifactError(f"source {name!r}: split {cfg.split!r} is not in {art.root}; it has {sorted(m.splits)}")
        if m.splits[cfg.split].count == 0:
            raise ArtifactError(f"source {name!r}: split {cfg.split!r} of {art.root} is empty")
        if cfg.verify != "none":
            art.verify([cfg.split], deep=cfg.verify == "full")
        check_resolution(cfg, art)
        return art

    def _draws(self, custom_sampler: Sampler | None, scores: np.ndarray | None) -> tuple[Sampler | None, list]:
        """Each source's draw: one source its sampler's order; several the plan's seeded draws over
        each one's live samples (or the subset a warm run trains on)."""
        cfg, split = self.config, self.config.split
        if len(self.artifacts) == 1:
            spec = self.mixture.sources[0]
            sampler = cfg.sampler if spec.subset is None else cfg.sampler.model_copy(update={"subset": spec.subset})
            shards = [sh.count for sh in self.artifact.manifest.splits[split].shards]
            order = SamplerOrder(sampler, cfg.batch_size, self.n, shards, self.live[0], world_size=self.world_size,
                                 scores=scores, custom_sampler=custom_sampler)
            return order.sampler, [order]
        draws = []
        for spec, live, n in zip(self.mixture.sources, self.live, np.diff(self.offsets)):
            items = live
            if spec.subset is not None:
                subset = np.load(spec.subset, allow_pickle=False).astype(np.int64)
                items = np.intersect1d(subset, live) if live is not None else np.unique(subset)
            size = int(n) if items is None else len(items)
            draws.append(SeededDraw(size, self.mixture.seed, source_key(str(spec.name)), items))
        return None, draws

    # ------------------------------------------------------------------ order
    def order_for(self, epoch: int, global_batch: int = 0) -> np.ndarray:
        """The epoch's global order in the loader's index space (``offsets[source] + split index``)."""
        src, idx = self.plan.order(epoch, global_batch)
        return self.offsets[src] + idx if len(self.artifacts) > 1 else idx

    def locate(self, indices: np.ndarray | torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """(source number, split index within it) of each index."""
        flat = np.asarray(indices.cpu() if isinstance(indices, torch.Tensor) else indices, np.int64)
        src = np.searchsorted(self.offsets, flat, side="right") - 1
        return src, flat - self.offsets[src]

    def sources_of(self, indices: torch.Tensor) -> torch.Tensor:
        """Each index's source number, on the indices' device (no sync)."""
        off = self._offsets_on.get(indices.device)
        if off is None:
            off = self._offsets_on[indices.device] = torch.as_tensor(self.offsets[1:-1]).to(indices.device)
        return torch.searchsorted(off, indices, right=True)

    def epoch_counts(self, epoch: int | None = None) -> dict[str, int]:
        """Samples each source gives an epoch (over all ranks, before padding to the world)."""
        return dict(zip(self.names, self.plan.counts_for(self.epoch if epoch is None else epoch).tolist()))

    def epoch_indices(self, epoch: int | None = None) -> np.ndarray:
        """This rank's index order for an epoch (what the batches will carry, in order)."""
        return self.cursor.rank_order(epoch)[0]

    def labels(self) -> np.ndarray:
        """Every sample's label in the loader's index space."""
        if self._labels is None:
            self._labels = np.concatenate([np.asarray(a.labels(self.config.split), np.int64) for a in self.artifacts])
        return self._labels

    def resolution(self, epoch: int | None = None) -> int | None:
        r = self.config.resolution
        return r.at(self.epoch if epoch is None else epoch) if r else None

    # ------------------------------------------------------------------ reading
    def backend(self) -> Backend | MixtureReads:
        """What reads the batches: one source's backend, or every source's as one; opened on first
        use in the caller's thread (it may fork workers, never from a helper thread:
        ``sluice.process_rules``, rule 2)."""
        if self._backend is not None:
            return self._backend
        if len(self.artifacts) == 1:
            cls = LOADER_BACKENDS.get(self.backend_names[0][0])
            config = self.config.model_copy(update={"decode": self.decoding.mode})  # auto resolved
            self._backend = be = cls.open(self.artifact, self.config.split, config, self.device, self.workers)
            if self.decoding.mode == "device":
                self.backend_reason += f"; {self.decoding.reason}" if be.hands_encoded else \
                    f"; decode: device does not apply to the {self.backend_name} backend (it decodes itself)"
            if be.placement:  # where the backend keeps what it holds (the GPU or pinned RAM), and why
                self.backend_reason = f"{self.backend_reason}; {be.placement}"
            return be
        k, cfg = len(self.artifacts), self.config.model_copy(update={"decode": "cpu"})
        shared = self.workers if self.workers == 0 else max(1, self.workers // k)  # streaming sources share workers
        opened = [LOADER_BACKENDS.get(be).open(a, cfg.split, cfg, self.device, self.workers if be == "memory" else shared)
                  for a, (be, _) in zip(self.artifacts, self.backend_names)]
        self._backend = MixtureReads(self.names, opened, self.offsets, self.labels(), self.image,
                                     pin=self.device.type == "cuda")
        return self._backend

    def _reads(self) -> Backend | MixtureReads | None:
        return self._backend

    def _produce(self, epoch: int, start: int) -> Iterator[Batch]:
        """order → read → decode (the backend) → augment → prefetch, from batch ``start``."""
        order, drop_last = self.cursor.rank_order(epoch)
        cfg, reads = self.config, self.backend()
        several = len(self.artifacts) > 1
        advance = (lambda b: None) if several else \
            prefetch_shards(self.artifact, cfg.split, reads, order, start, cfg.batch_size)  # a remote artifact
        finisher = BatchFinisher(self.device, self.augment, cfg.seed, cfg.batch_size, self.timings,
                                 self.decoding.decoder, self.image)
        res = self.resolution(epoch)
        produced = prefetched(lambda: finisher.batches(reads, order, epoch, start, drop_last, res),
                              cfg.prefetch, reads.forks_per_epoch, self.timings)
        try:
            for b, batch in enumerate(produced, start):
                if isinstance(batch, OnStream):
                    batch = batch.hand_over(self.device)
                if several:
                    batch.sources = self.sources_of(batch.indices)
                    batch.source_counts = torch.bincount(batch.sources, minlength=len(self.artifacts))
                self.cursor.advance()
                advance(b)
                yield batch
        finally:
            produced.close()

    def _counts_sources(self) -> bool:
        return len(self.artifacts) > 1

    def _cache(self) -> Any:
        return next((a.cache for a in self.artifacts if a.cache is not None), None)

    @property
    def mixture_changes(self) -> list[dict[str, Any]]:
        return self.plan.changes

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()
            self._backend = None

    # ------------------------------------------------------------------ state
    def fingerprints(self) -> dict[str, str]:
        return {n: a.fingerprint for n, a in zip(self.names, self.artifacts)}

    def state_dict(self) -> dict[str, Any]:
        """Where the caller is (global but for ``rank`` and the per-rank ``served``): resuming
        from it yields exactly the next batch, at this world size or another."""
        return {**self.cursor.state_dict(), "kind": "images", "rank": self.rank, "world_size": self.world_size,
                "split": self.config.split, "batch_size": self.config.batch_size,
                "fingerprints": self.fingerprints(), "mixture": self.plan.state_dict(self.cursor.epoch),
                **self._served_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (written at any world size): the rest of its epoch over the
        counts and source versions it began with, then the config's mixture. A state at an
        epoch's start or end is a boundary: the config's mixture (and sources) take over there."""
        if state.get("kind", "images") not in ("images", "image_mixture"):  # image_mixture: a state from before
            raise LoaderError(f"not an image loader state (kind={state.get('kind')!r})")
        world, batch = check_state(state, split=self.config.split, world_size=self.world_size,
                                   batch_size=self.config.batch_size, batches=len(self))
        old = state.get("fingerprints") or ({self.names[0]: state["fingerprint"]} if "fingerprint" in state else {})
        epoch, consumed = int(state["epoch"]), int(state.get("consumed", 1))
        finished = "end" in state and consumed >= int(state["end"])
        mixture = state.get("mixture")
        if finished:  # the next epoch starts fresh, under this config
            if mixture is not None:
                self.plan.load_state_dict({**mixture, "epoch": epoch + 1}, begun=False)
            self.cursor.restart(epoch + 1)
        elif consumed == 0:  # not begun: this epoch follows this config
            if mixture is not None:
                self.plan.load_state_dict(mixture, begun=False)
            self.cursor.restart(epoch)
        else:
            now = self.fingerprints()
            moved = {n: f"{str(old.get(n))[:12]} -> {now[n][:12]}" for n in now if n in old and old[n] != now[n]}
            if moved or set(old) != set(now):
                raise LoaderError(f"loader state belongs to another dataset version: epoch {epoch} began over "
                                  f"other versions of sources {moved or sorted(old)}; an epoch finishes over the "
                                  "data it began with: resume with those versions, or at an epoch boundary")
            if mixture is not None:
                self.plan.load_state_dict(mixture, begun=True)
            self.cursor.load_state_dict(state, world=world, batch=batch)
        if world == self.world_size and state.get("rank") == self.rank:
            self._restore_served(state, "source_samples")


def _sources(artifact: Source | Sequence[Source] | None, mixture: MixtureConfig | dict | None,
             given: Sequence[Source] | None, seed: int) -> tuple[MixtureConfig, list[Source]]:
    """The mixture a loader reads and its artifacts (paths or opened), in the mixture's order."""
    if mixture is not None:
        if artifact is not None:
            raise LoaderError("give a loader its artifact or a mixture, not both")
        mix = mixture if isinstance(mixture, MixtureConfig) else MixtureConfig.model_validate(mixture)
        if given is None:
            missing = [s.name for s in mix.sources if s.path is None]
            if missing:
                raise LoaderError(f"mixture sources {missing} have no path: give each an artifact path, "
                                  "or pass the artifacts")
            given = [s.path for s in mix.sources]  # type: ignore[misc]
        if len(given) != len(mix.sources):
            raise LoaderError(f"{len(given)} artifacts for a mixture of {len(mix.sources)} sources")
        return mix, list(given)
    if artifact is None:
        raise LoaderError("a loader needs an artifact (a path or an opened DatasetArtifact) or a mixture")
    arts = list(artifact) if isinstance(artifact, (list, tuple)) else [artifact]
    names = [_name(a) for a in arts]
    if len(set(names)) != len(names):
        names = [f"source{i}" for i in range(len(arts))]
    return MixtureConfig(sources=[{"path": str(a.root) if isinstance(a, DatasetArtifact) else str(a),
                                   "name": n, "repeat": 1.0} for a, n in zip(arts, names)], seed=seed), arts


def _name(a: Source) -> str:
    """A source's name: its dataset's folder (a version's parent), else the path's last part."""
    if isinstance(a, DatasetArtifact):
        return PurePath(str(a.root)).parent.name or "source0"
    return PurePath(str(a)).name or "source0"


def _check_mixture_settings(cfg: LoaderConfig, custom_sampler: Sampler | None, scores: np.ndarray | None) -> None:
    """Refuse the settings several sources cannot honour: their order is the plan's (weights,
    repeat, choose), and their batches are interleaved decoded."""
    s = cfg.sampler
    if s.kind not in ORDERED_BY_PLAN or s.scores or s.subset or custom_sampler is not None or scores is not None:
        raise LoaderError(f"the order of several sources is the mixture plan's (weights, repeat, choose); "
                          f"sampler kind {s.kind!r}" + (", scores" if s.scores or scores is not None else "")
                          + (", subset (give each source its subset)" if s.subset else "")
                          + (", a custom sampler" if custom_sampler is not None else "")
                          + " cannot apply: leave the sampler at shuffle (only its partition is used)")
    if cfg.decode == "device":
        raise LoaderError("loader.decode: device does not apply to several sources (their batches are "
                          "interleaved decoded); use auto or cpu")
