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
"""
from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, Iterator

import numpy as np
import torch

from sluice.errors import ArtifactError, LoaderError
from sluice.stages.contracts import Batch, Sampler
from sluice.stages.load.augment import TorchAugment, batch_seed
from sluice.stages.load.backends import LOADER_BACKENDS, Backend, Timings
from sluice.stages.load.backends.memory import MemoryBackend, available_memory
from sluice.stages.load.config import LoaderConfig
from sluice.stages.load.samplers import build_sampler, partition
from sluice.storage.artifact import DatasetArtifact, open_artifact


def _resolve_backend(name: str, artifact: DatasetArtifact, split: str, budget: int | None) -> str:
    if name != "auto":
        return name
    shape = artifact.manifest.fields.image.shape
    n = artifact.manifest.split(split).count
    if shape is not None:
        need = n * int(np.prod(shape))
        if need <= (budget if budget is not None else available_memory() // 4):
            return MemoryBackend.name
    return "ffcv" if artifact.manifest.split(split).ffcv else "webdataset"


class Loader:
    """Batches ``(images, labels, indices)`` of one split, in the sampler's order, on the device.

    ``rank``/``world_size`` give this process a disjoint, equal-length slice of every epoch.
    ``scores`` supplies the weighted/curriculum sampler's per-sample array (else
    ``sampler.scores``); ``custom_sampler`` (any object with ``__len__`` and ``epoch_order``)
    replaces the configured sampler outright. Other keyword arguments override config fields.
    """

    def __init__(self, artifact: str | os.PathLike | DatasetArtifact, config: LoaderConfig | dict | None = None, *,
                 rank: int = 0, world_size: int = 1, scores: np.ndarray | None = None,
                 custom_sampler: Sampler | None = None, **overrides: Any):
        cfg = config if isinstance(config, LoaderConfig) else LoaderConfig.model_validate(config or {})
        if overrides:
            cfg = cfg.model_copy(update=overrides)
            cfg = LoaderConfig.model_validate(cfg.model_dump())
        self.config = cfg
        self.artifact = artifact if isinstance(artifact, DatasetArtifact) else open_artifact(artifact)
        m = self.artifact.manifest
        if cfg.split not in m.splits:
            raise ArtifactError(f"split {cfg.split!r} is not in {self.artifact.root}; it has {sorted(m.splits)}")
        self.n = m.splits[cfg.split].count
        if self.n == 0:
            raise ArtifactError(f"split {cfg.split!r} of {self.artifact.root} is empty")
        if cfg.verify != "none":
            self.artifact.verify([cfg.split], deep=cfg.verify == "full")
        self._check_resolution()
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(cfg.device)
        self.workers = cfg.workers if cfg.workers is not None else (os.cpu_count() or 1)
        self.sampler = custom_sampler or build_sampler(cfg.sampler, self.n, cfg.batch_size * world_size, scores)
        if len(self.sampler) == 0:
            raise LoaderError("the sampler yields no samples")
        self.backend_name = _resolve_backend(cfg.backend, self.artifact, cfg.split, cfg.memory_budget_bytes)
        self._backend: Backend | None = None
        # On CPU batches a leading RRC(+flip) runs in OpenCV over `workers` threads (same draws as
        # the torch path); CUDA batches take the torch path on the device.
        self.augment = TorchAugment(cfg.augment, cfg.seed, fast_cpu=True, threads=max(1, self.workers))
        self.epoch = 0
        self._next_batch = 0  # batches of the current epoch already handed to the caller
        self.timings = Timings()
        self.samples_seen = 0

    # ------------------------------------------------------------------ contract
    def __len__(self) -> int:
        n, w = len(self.sampler), self.world_size  # partition's length, without building it
        per_rank = -(-n // w) if self.config.sampler.partition == "pad" else n // w
        bs = self.config.batch_size
        return per_rank // bs if self.config.drop_last else -(-per_rank // bs)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self._next_batch = epoch, 0

    def state_dict(self) -> dict[str, Any]:
        """Where the caller is: resuming from this yields exactly the next batch."""
        return {"epoch": self.epoch, "next_batch": self._next_batch, "rank": self.rank,
                "world_size": self.world_size, "fingerprint": self.artifact.fingerprint,
                "split": self.config.split, "batch_size": self.config.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("fingerprint") != self.artifact.fingerprint:
            raise LoaderError("loader state belongs to another dataset version "
                             f"({str(state.get('fingerprint'))[:16]} vs {self.artifact.fingerprint[:16]})")
        for k in ("split", "batch_size", "world_size"):
            if state.get(k) != self.state_dict()[k]:
                raise LoaderError(f"loader state has {k}={state.get(k)!r}, this loader {self.state_dict()[k]!r}")
        epoch, nxt = state.get("epoch"), state.get("next_batch")
        if not _is_int(epoch) or epoch < 0:
            raise LoaderError(f"loader state has epoch={epoch!r}; it must be an integer >= 0")
        if not _is_int(nxt) or not 0 <= nxt <= len(self):
            raise LoaderError(f"loader state has next_batch={nxt!r}; it must be an integer from 0 to "
                              f"{len(self)} (the batches in an epoch)")
        self.epoch, self._next_batch = int(epoch), int(nxt)

    def epoch_indices(self, epoch: int | None = None) -> np.ndarray:
        """This rank's index order for an epoch (what the batches will carry, in order)."""
        e = self.epoch if epoch is None else epoch
        return partition(self.sampler.epoch_order(e), self.rank, self.world_size, self.config.sampler.partition)

    def resolution(self, epoch: int | None = None) -> int | None:
        r = self.config.resolution
        return r.at(self.epoch if epoch is None else epoch) if r else None

    def __iter__(self) -> Iterator[Batch]:
        epoch, start = self.epoch, self._next_batch
        total = len(self)
        if start >= total:  # the epoch was finished: the next iteration is the next epoch
            self.epoch, self._next_batch = epoch + 1, 0
            epoch, start = self.epoch, 0
        order = self.epoch_indices(epoch)
        self.backend()  # built here, in the caller's thread: backends fork workers, never from a thread
        produced = self._produce(order, epoch, start)
        try:
            for batch in produced:
                self._next_batch += 1
                self.samples_seen += len(batch.labels)
                yield batch
        finally:
            close = getattr(produced, "close", None)
            if close:
                close()

    # ------------------------------------------------------------------ internals
    def _check_resolution(self) -> None:
        cfg, shape = self.config, self.artifact.manifest.fields.image.shape
        wanted = [cfg.resolution.end] if cfg.resolution else []
        if cfg.augment:
            wanted += [op.size for op in cfg.augment.ops if getattr(op, "size", None) and op.op == "random_resized_crop"]
        if shape is not None:
            for w in wanted:
                if w > max(shape[0], shape[1]):
                    raise LoaderError(f"requested resolution {w} is above the stored {shape[0]}×{shape[1]}; "
                                      "re-shard at a higher resolution")

    def backend(self) -> Backend:
        """The backend, opened on first use (in the caller's thread: backends fork workers)."""
        if self._backend is None:
            cls = LOADER_BACKENDS.get(self.backend_name)
            self._backend = cls.open(self.artifact, self.config.split, self.config, self.device,
                                     self.workers)
        return self._backend

    def _batches(self, order: np.ndarray, epoch: int, start: int) -> Iterator[Batch]:
        be = self.backend()
        cfg = self.config
        res = self.resolution(epoch)
        if be.augments:  # DALI: augmentation and transfer happen inside, with the same draws
            yield from (Batch(*b) for b in be.epoch(order, cfg.batch_size, cfg.drop_last, start,
                                                   resolution=res, epoch=epoch))
            return
        pin = self.device.type == "cuda"
        b = start
        for imgs, labels, idx in be.epoch(order, cfg.batch_size, cfg.drop_last, start):
            t = time.perf_counter()
            x = torch.as_tensor(imgs)
            y = torch.as_tensor(labels, dtype=torch.int64)
            i = torch.as_tensor(idx, dtype=torch.int64)
            if pin:
                x = x.pin_memory().to(self.device, non_blocking=True)
                y = y.pin_memory().to(self.device, non_blocking=True)
                i = i.to(self.device, non_blocking=True)
            t1 = time.perf_counter()
            self.timings.add("transfer", t1 - t)
            # Seeded per (epoch, batch), as on every backend: a resumed run augments its
            # batches exactly as before.
            self.augment.reseed(batch_seed(cfg.seed, epoch, b))
            x = self.augment(x, res)
            self.timings.add("augment", time.perf_counter() - t1)
            b += 1
            yield Batch(x, y, i)

    def _produce(self, order: np.ndarray, epoch: int, start: int) -> Iterator[Batch]:
        """Run the pipeline in a background thread, ``prefetch`` batches ahead of the caller.

        Backends that fork worker processes per epoch (DataLoader workers, DALI's parallel
        external source) prefetch on their own and run in the caller's thread: forking from a
        thread can deadlock the child on locks another thread held.
        """
        if self.config.prefetch == 0 or self.backend().forks_per_epoch:
            yield from self._timed(self._batches(order, epoch, start))
            return
        q: queue.Queue = queue.Queue(maxsize=self.config.prefetch)
        stop = threading.Event()
        DONE = object()

        def work():
            try:
                for batch in self._batches(order, epoch, start):
                    while not stop.is_set():
                        try:
                            q.put(batch, timeout=0.1)
                            break
                        except queue.Full:
                            pass
                    if stop.is_set():
                        return
                q.put(DONE)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                q.put(e)

        th = threading.Thread(target=work, name="sluice-loader", daemon=True)
        th.start()
        try:
            while True:
                t = time.perf_counter()
                item = q.get()
                self.timings.add("wait", time.perf_counter() - t)
                if item is DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            while th.is_alive():
                try:
                    q.get_nowait()
                except queue.Empty:
                    th.join(0.05)

    def _timed(self, it: Iterator[Batch]) -> Iterator[Batch]:
        while True:
            t = time.perf_counter()
            try:
                b = next(it)
            except StopIteration:
                return
            self.timings.add("wait", time.perf_counter() - t)
            yield b

    def profile(self) -> dict[str, float]:
        """Seconds spent per stage so far (backend read/decode, transfer, augment, and the
        caller's wait for data), with samples seen: where the loading time goes."""
        be = self._backend
        out = dict(be.timings) if be is not None else {}
        out.update(self.timings)
        out["samples"] = float(self.samples_seen)
        return out

    def profile_report(self) -> str:
        p = self.profile()
        n = p.pop("samples", 0)
        lines = [f"loader profile ({self.backend_name}, {int(n)} samples):"]
        for k, v in sorted(p.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {k:<12} {v:8.3f} s" + (f"  {v / n * 1e6:8.1f} µs/sample" if n else ""))
        return "\n".join(lines)


def split_arrays(artifact: str | os.PathLike | DatasetArtifact, split: str) -> tuple[np.ndarray, np.ndarray]:
    """The whole split as (uint8 NHWC images, int64 labels), index-aligned: for scorers such as
    the irreducible-loss model that want every sample at once."""
    art = artifact if isinstance(artifact, DatasetArtifact) else open_artifact(artifact)
    be = MemoryBackend(art, split, os.cpu_count() or 1)
    return be.images, be.labels


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))
