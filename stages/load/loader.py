"""One loader over FFCV, DALI, WebDataset or RAM, with samplers, device-side augmentation,
prefetching and exact mid-epoch resume.

    from sluice.stages.load import Loader
    loader = Loader("sluice-data/fashion-mnist", split="train", batch_size=256, backend="ffcv",
                    augment=AugmentSpec.standard())
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for images, labels, indices in loader:   # float32 NCHW on the device, int64, int64
            ...

Importing this module imports neither FFCV nor DALI; a backend is imported when asked for, and a
missing one raises ``MissingDependency`` naming the pip package.

The loader is a pipeline of parts, one module each: order (``order``: sampler and cursor) →
read → decode (the backend, ``backends/``; ``remote`` fetches a remote artifact's shards ahead)
→ decode, transfer, augment (``finish_batches``) → prefetch (``prefetch``); ``profile`` beside it says where the time
went. Where processes may fork is ``sluice.process_rules``.
"""
from __future__ import annotations

import os
import time
from typing import Any, Iterator

import numpy as np
import torch

from sluice.errors import ArtifactError
from sluice.stages.contracts import Batch, Sampler
from sluice.stages.load.augment import TorchAugment
from sluice.stages.load.backends import LOADER_BACKENDS, Backend, Timings
from sluice.stages.load.choice import resolve_backend
from sluice.stages.load.canvas import stored_channels
from sluice.stages.load.config import LoaderConfig, loader_device
from sluice.stages.load.device_decode import choose_decode
from sluice.stages.load.finish_batches import BatchFinisher, OnStream, check_resolution
from sluice.stages.load.order import EpochOrder, check_state
from sluice.stages.load.prefetch import prefetched
from sluice.stages.load.profile import bottleneck, gather_profile, profile_report
from sluice.stages.load.remote import prefetch_shards
from sluice.storage.artifact import DatasetArtifact, open_artifact
from sluice.stages.host import workers_or_cores

__all__ = ["Loader"]


class Loader:
    """Batches ``(images, labels, indices)`` of one split, in the sampler's order, on the device.

    ``rank``/``world_size`` give this process a disjoint, equal-length slice of every epoch.
    ``scores`` supplies the weighted/curriculum sampler's per-sample array (else
    ``sampler.scores``); ``custom_sampler`` (any object with ``__len__`` and ``epoch_order``)
    replaces the configured sampler outright. ``device`` is the training device the loader feeds
    (what ``device: auto`` follows; the trainer's worker passes the rank's). Other keyword
    arguments override config fields.
    """

    def __init__(self, artifact: str | os.PathLike | DatasetArtifact, config: LoaderConfig | dict | None = None, *,
                 rank: int = 0, world_size: int = 1, scores: np.ndarray | None = None,
                 custom_sampler: Sampler | None = None, device: torch.device | None = None,
                 **overrides: Any):
        cfg = config if isinstance(config, LoaderConfig) else LoaderConfig.model_validate(config or {})
        if overrides:  # validated as fields (a dict for `cache` or `sampler` becomes its model)
            cfg = LoaderConfig.model_validate({**dict(cfg), **overrides})
        self.config = cfg
        c = cfg.cache
        self.artifact = artifact if isinstance(artifact, DatasetArtifact) else \
            open_artifact(artifact, c.dir, c.max_bytes, c.retries, c.prefetch_shards)
        m = self.artifact.manifest
        if cfg.split not in m.splits:
            raise ArtifactError(f"split {cfg.split!r} is not in {self.artifact.root}; it has {sorted(m.splits)}")
        self.n = m.splits[cfg.split].count
        if self.n == 0:
            raise ArtifactError(f"split {cfg.split!r} of {self.artifact.root} is empty")
        if cfg.verify != "none":
            self.artifact.verify([cfg.split], deep=cfg.verify == "full")
        check_resolution(cfg, self.artifact)
        self.rank, self.world_size = rank, world_size
        self.device = loader_device(cfg.device, device)
        self.workers = workers_or_cores(cfg.workers)
        # Where JPEG bytes become pixels: the backend's workers, or one batched call here (decode: device)
        self.decoding = choose_decode(cfg.decode, self.device, m.fields.image.encoding, max(1, self.workers))
        self.image = m.fields.image.shape or (1, 1, stored_channels(self.artifact))
        # A version that removed samples keeps their indices: no order may hold them.
        live = self.artifact.live(cfg.split) if m.splits[cfg.split].removed else None
        self.order = EpochOrder(cfg, self.n, [sh.count for sh in m.splits[cfg.split].shards], live,
                                rank=rank, world_size=world_size, scores=scores, custom_sampler=custom_sampler)
        self.sampler, self.cursor = self.order.sampler, self.order.cursor
        self.backend_name, self.backend_reason = resolve_backend(self.artifact, cfg)
        self._backend: Backend | None = None
        # On CPU batches a leading RRC(+flip) runs in OpenCV over `workers` threads (same draws as
        # the torch path); CUDA batches take the torch path on the device.
        self.augment = TorchAugment(cfg.augment, cfg.seed, fast_cpu=True, threads=max(1, self.workers))
        self.timings = Timings()
        self.samples_seen = 0
        self.wall_s = 0.0  # time inside iteration, the caller's own work included
        self._iter_t0: float | None = None  # start of the iteration in progress (a caller may stop mid-epoch)

    # ------------------------------------------------------------------ contract
    @property
    def epoch(self) -> int:
        return self.cursor.epoch

    def __len__(self) -> int:
        return self.cursor.batches()

    def set_epoch(self, epoch: int) -> None:
        self.cursor.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where the caller is: resuming from this yields exactly the next batch — at this world
        size, or at another one (the rest of the epoch, re-cut; see ``epochs``)."""
        return {**self.cursor.state_dict(), "rank": self.rank, "world_size": self.world_size,
                "fingerprint": self.artifact.fingerprint, "split": self.config.split,
                "batch_size": self.config.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        world, batch = check_state(state, fingerprint=self.artifact.fingerprint, split=self.config.split,
                                   world_size=self.world_size, batch_size=self.config.batch_size,
                                   batches=len(self))
        self.cursor.load_state_dict(state, world=world, batch=batch)

    def epoch_indices(self, epoch: int | None = None) -> np.ndarray:
        """This rank's index order for an epoch (what the batches will carry, in order)."""
        return self.cursor.rank_order(epoch)[0]

    def resolution(self, epoch: int | None = None) -> int | None:
        r = self.config.resolution
        return r.at(self.epoch if epoch is None else epoch) if r else None

    def backend(self) -> Backend:
        """The backend, opened on first use in the caller's thread (it may fork workers, never
        from a helper thread: ``sluice.process_rules``, rule 2)."""
        if self._backend is None:
            cls = LOADER_BACKENDS.get(self.backend_name)
            config = self.config.model_copy(update={"decode": self.decoding.mode})  # auto resolved
            self._backend = cls.open(self.artifact, self.config.split, config, self.device, self.workers)
            if self.decoding.mode == "device":
                hands = getattr(self._backend, "hands_encoded", False)
                self.backend_reason += f"; {self.decoding.reason}" if hands else \
                    f"; decode: device does not apply to the {self.backend_name} backend (it decodes itself)"
            placement = getattr(self._backend, "placement", "")
            if placement:  # where the backend keeps what it holds (the GPU or pinned RAM), and why
                self.backend_reason = f"{self.backend_reason}; {placement}"
        return self._backend

    # ------------------------------------------------------------------ the pipeline
    def __iter__(self) -> Iterator[Batch]:
        """order → read → decode (the backend) → augment → prefetch, from the cursor's position."""
        epoch, start = self.cursor.iteration_start()  # a finished epoch: the next one
        order, drop_last = self.cursor.rank_order(epoch)
        cfg, be = self.config, self.backend()
        advance = prefetch_shards(self.artifact, cfg.split, be, order, start, cfg.batch_size)
        t0 = self._iter_t0 = time.perf_counter()
        res = self.resolution(epoch)

        finisher = BatchFinisher(self.device, self.augment, cfg.seed, cfg.batch_size, self.timings,
                                 self.decoding.decoder, self.image)

        def batches() -> Iterator[Batch | OnStream]:
            return finisher.batches(be, order, epoch, start, drop_last, res)
        produced = prefetched(batches, cfg.prefetch, be.forks_per_epoch, self.timings)
        try:
            for b, batch in enumerate(produced, start):
                if isinstance(batch, OnStream):
                    batch = batch.hand_over(self.device)
                self.cursor.advance()
                self.samples_seen += len(batch.labels)
                advance(b)
                yield batch
        finally:
            produced.close()
            self.wall_s += time.perf_counter() - t0
            self._iter_t0 = None

    # ------------------------------------------------------------------ profiling
    def profile(self) -> dict[str, float]:
        """Seconds spent per stage so far (storage ``read``, ``decode``, ``augment``,
        ``transfer``, ``gather``, and the caller's ``wait`` for data), with ``samples`` seen and
        ``wall`` (seconds inside iteration): where the loading time goes."""
        wall = self.wall_s + (time.perf_counter() - self._iter_t0 if self._iter_t0 else 0.0)
        return gather_profile(self._backend, self.timings, self.samples_seen, wall)

    def bottleneck(self) -> dict[str, Any]:
        """Which resource bounds the loader (``verdict``: storage-, decode- or compute-bound) and
        how long the caller waited for data; see ``profile.bottleneck``."""
        return bottleneck(self.profile())

    def profile_report(self) -> str:
        p = self.profile()
        return profile_report(p, self.bottleneck(), self.backend_name, self.backend_reason, self.artifact.cache)
