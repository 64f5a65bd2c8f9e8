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

import contextlib
import os
import queue
import threading
import time
from typing import Any, Iterator, NamedTuple

import numpy as np
import torch

from sluice.errors import ArtifactError, LoaderError
from sluice.stages.contracts import Batch, Sampler
from sluice.stages.load.augment import TorchAugment, batch_seed
from sluice.stages.load.backends import LOADER_BACKENDS, Backend, Timings
from sluice.stages.load.choice import resolve_backend
from sluice.stages.load.config import LoaderConfig
from sluice.stages.load.epochs import EpochCursor
from sluice.stages.load.samplers import LiveSampler, build_sampler
from sluice.storage.artifact import DatasetArtifact, open_artifact


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
        self._check_resolution()
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(cfg.device)
        self.workers = cfg.workers if cfg.workers is not None else (os.cpu_count() or 1)
        self._scores, self._custom = scores, custom_sampler is not None
        self._shard_sizes = [sh.count for sh in m.splits[cfg.split].shards]
        # A version that removed samples keeps their indices: no order may hold them.
        self._live = self.artifact.live(cfg.split) if m.splits[cfg.split].removed else None
        if custom_sampler is not None and self._live is not None:
            custom_sampler = LiveSampler(custom_sampler, self._live, self.n)
        self.sampler = custom_sampler or build_sampler(cfg.sampler, self.n, cfg.batch_size * world_size, scores,
                                                       self._shard_sizes, self._live)
        if len(self.sampler) == 0:
            raise LoaderError("the sampler yields no samples")
        # the epoch position, global so a resume at another world size continues the epoch
        self.cursor = EpochCursor(self._order_for, len(self.sampler), rank=rank, world=world_size,
                                  batch=cfg.batch_size, drop_last=cfg.drop_last,
                                  mode=cfg.sampler.partition)
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
        if state.get("fingerprint") != self.artifact.fingerprint:
            raise LoaderError("loader state belongs to another dataset version "
                             f"({str(state.get('fingerprint'))[:16]} vs {self.artifact.fingerprint[:16]})")
        if state.get("split") != self.config.split:
            raise LoaderError(f"loader state has split={state.get('split')!r}, this loader {self.config.split!r}")
        epoch, nxt, world, batch = (state.get(k) for k in ("epoch", "next_batch", "world_size", "batch_size"))
        if not _is_int(epoch) or epoch < 0:
            raise LoaderError(f"loader state has epoch={epoch!r}; it must be an integer >= 0")
        if not _is_int(world) or world < 1 or not _is_int(batch) or batch < 1:
            raise LoaderError(f"loader state has world_size={world!r}, batch_size={batch!r}; both must be integers >= 1")
        if not _is_int(nxt) or nxt < 0 or (world == self.world_size and batch == self.config.batch_size
                                            and nxt > len(self)):
            raise LoaderError(f"loader state has next_batch={nxt!r}; it must be an integer from 0 to "
                              f"the batches in an epoch ({len(self)} at this world size and batch)")
        self.cursor.load_state_dict(state, world=int(world), batch=int(batch))

    def _order_for(self, epoch: int, global_batch: int) -> np.ndarray:
        """The sampler's global order of ``epoch`` as ordered for ``global_batch`` (only a
        curriculum's pacing depends on it: an epoch begun at another world size keeps its order)."""
        if global_batch == self.config.batch_size * self.world_size or self._custom \
                or self.config.sampler.kind != "curriculum":
            return self.sampler.epoch_order(epoch)
        return build_sampler(self.config.sampler, self.n, global_batch, self._scores,
                             self._shard_sizes, self._live).epoch_order(epoch)

    def epoch_indices(self, epoch: int | None = None) -> np.ndarray:
        """This rank's index order for an epoch (what the batches will carry, in order)."""
        return self.cursor.rank_order(epoch)[0]

    def resolution(self, epoch: int | None = None) -> int | None:
        r = self.config.resolution
        return r.at(self.epoch if epoch is None else epoch) if r else None

    def __iter__(self) -> Iterator[Batch]:
        epoch, start = self.epoch, self.cursor.next_batch
        if start >= len(self):  # the epoch was finished: the next iteration is the next epoch
            self.cursor.set_epoch(epoch + 1)
            epoch, start = self.epoch, 0
        order, drop_last = self.cursor.rank_order(epoch)
        self.backend()  # built here, in the caller's thread: backends fork workers, never from a thread
        advance = self._prefetch_shards(order, start)
        t0 = self._iter_t0 = time.perf_counter()
        produced = self._produce(order, epoch, start, drop_last)
        try:
            for b, batch in enumerate(produced, start):
                if isinstance(batch, _OnStream):
                    batch = batch.hand_over(self.device)
                self.cursor.advance()
                self.samples_seen += len(batch.labels)
                advance(b)
                yield batch
        finally:
            close = getattr(produced, "close", None)
            if close:
                close()
            self.wall_s += time.perf_counter() - t0
            self._iter_t0 = None

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

    def _prefetch_shards(self, order: np.ndarray, start: int):
        """For an artifact on object storage, fetch the shards this epoch needs into the cache
        ahead of need, in the order it needs them; returns ``advance(batch)``."""
        cache = self.artifact.cache
        if cache is None or not self.backend().reads_shards:
            return lambda b: None
        shards = self.artifact.manifest.split(self.config.split).shards
        firsts = np.array([sh.first_index for sh in shards])
        bs = self.config.batch_size
        of = np.searchsorted(firsts, order[start * bs:], side="right") - 1
        plan, first_at = np.unique(of, return_index=True)
        by_need = np.argsort(first_at, kind="stable")
        need_batch = first_at[by_need] // bs + start  # the batch that first needs plan[k]
        cache.prefetch([shards[int(s)].tar for s in plan[by_need]])
        return lambda b: cache.advance(int(np.searchsorted(need_batch, b, side="right")) - 1)

    def backend(self) -> Backend:
        """The backend, opened on first use (in the caller's thread: backends fork workers)."""
        if self._backend is None:
            cls = LOADER_BACKENDS.get(self.backend_name)
            self._backend = cls.open(self.artifact, self.config.split, self.config, self.device,
                                     self.workers)
        return self._backend

    def _batches(self, order: np.ndarray, epoch: int, start: int, drop_last: bool) -> Iterator[Batch]:
        be = self.backend()
        cfg = self.config
        res = self.resolution(epoch)
        if be.augments:  # DALI: augmentation and transfer happen inside, with the same draws
            yield from (Batch(*b) for b in be.epoch(order, cfg.batch_size, drop_last, start,
                                                   resolution=res, epoch=epoch))
            return
        pin = self.device.type == "cuda"
        # CUDA: copy and augment on a side stream, overlapping the caller's compute (_OnStream)
        stream = torch.cuda.Stream(self.device) if pin else None
        b = start
        for imgs, labels, idx in be.epoch(order, cfg.batch_size, drop_last, start):
            with torch.cuda.stream(stream) if pin else contextlib.nullcontext():
                t = time.perf_counter()
                x = torch.as_tensor(imgs)
                y = torch.as_tensor(labels, dtype=torch.int64)
                i = torch.as_tensor(idx, dtype=torch.int64)
                if pin:
                    x = x.pin_memory().to(self.device, non_blocking=True)
                    y = y.pin_memory().to(self.device, non_blocking=True)
                    i = i.pin_memory().to(self.device, non_blocking=True)
                t1 = time.perf_counter()
                self.timings.add("transfer", t1 - t)
                # Seeded per (epoch, batch), as on every backend: a resumed run augments its
                # batches exactly as before.
                self.augment.reseed(batch_seed(cfg.seed, epoch, b))
                x = self.augment(x, res)
                self.timings.add("augment", time.perf_counter() - t1)
            b += 1
            batch = Batch(x, y, i)
            yield batch if stream is None else _OnStream(batch, stream.record_event())

    def _produce(self, order: np.ndarray, epoch: int, start: int, drop_last: bool) -> Iterator[Batch]:
        """Run the pipeline in a background thread, ``prefetch`` batches ahead of the caller.

        Backends that fork worker processes per epoch (DataLoader workers, DALI's parallel
        external source) prefetch on their own and run in the caller's thread: forking from a
        thread can deadlock the child on locks another thread held.
        """
        if self.config.prefetch == 0 or self.backend().forks_per_epoch:
            yield from self._timed(self._batches(order, epoch, start, drop_last))
            return
        q: queue.Queue = queue.Queue(maxsize=self.config.prefetch)
        stop = threading.Event()
        DONE = object()

        def work():
            try:
                for batch in self._batches(order, epoch, start, drop_last):
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
        """Seconds spent per stage so far (storage ``read``, ``decode``, ``augment``,
        ``transfer``, ``gather``, and the caller's ``wait`` for data), with ``samples`` seen and
        ``wall`` (seconds inside iteration): where the loading time goes."""
        be = self._backend
        out = dict(be.timings) if be is not None else {}
        out.update(self.timings)
        out.update({"corrupt_skipped": float(be.guard.skipped)} if getattr(be, "guard", None) else {})  # skip
        out["samples"] = float(self.samples_seen)
        out["wall"] = self.wall_s + (time.perf_counter() - self._iter_t0 if self._iter_t0 else 0.0)
        return out

    def bottleneck(self) -> dict[str, Any]:
        """Which resource bounds the loader (``verdict``: storage-, decode- or compute-bound) and
        how long the caller waited for data; see ``bottleneck``."""
        return bottleneck(self.profile())

    def profile_report(self) -> str:
        p = self.profile()
        n, wall, bad = p.pop("samples", 0), p.pop("wall", 0.0), int(p.pop("corrupt_skipped", 0))
        lines = [f"loader profile ({self.backend_name}, {int(n)} samples, {wall:.1f} s):",
                 f"  backend      {self.backend_reason}"] + ([f"  damaged      {bad} samples skipped"] if bad else [])
        for k, v in sorted(p.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {k:<14} {v:8.3f} s" + (f"  {v / n * 1e6:8.1f} µs/sample" if n else ""))
        cache = self.artifact.cache
        if cache is not None:
            st = cache.stats
            lines.append(f"  cache        {st['fetched']} files fetched ({st['fetched_bytes'] / 1e6:.1f} MB, "
                         f"{st['retried']} retried), {st['hits']} hits, {st['evicted']} evicted "
                         "(by this process: worker processes count their own)")
        lines.append(f"  verdict      {self.bottleneck()['summary']}")
        return "\n".join(lines)


# Each profiled stage is work of one kind: storage reads, decoding, or our own compute.
STAGE_KINDS = {"read": "storage", "decode": "decode", "decode+augment": "decode",
               "read+decode": "storage+decode", "augment": "compute", "transfer": "compute",
               "gather": "compute", "check": "compute"}


def bottleneck(profile: dict[str, float]) -> dict[str, Any]:
    """The verdict from a loader profile: the kind of work (storage reads, decode, or compute —
    augmentation, transfer, gathers) that took the most seconds, its share of the loader's work,
    and the share of the caller's time spent waiting for data (low: the loader keeps up, and
    the caller's own work sets the pace)."""
    kinds: dict[str, float] = {}
    for k, v in profile.items():
        if k in STAGE_KINDS:
            kinds[STAGE_KINDS[k]] = kinds.get(STAGE_KINDS[k], 0.0) + v
    total = sum(kinds.values())
    wall, wait = profile.get("wall", 0.0), profile.get("wait", 0.0)
    wait_share = wait / wall if wall > 0 else None
    if total <= 0:
        return {"verdict": "unknown", "shares": {}, "wait_share": wait_share,
                "summary": "unknown: nothing loaded yet"}
    shares = {k: v / total for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}
    top = next(iter(shares))
    verdict = f"{top}-bound"
    others = ", ".join(f"{k} {100 * v:.0f}%" for k, v in shares.items() if k != top)
    summary = f"{verdict}: {top} {100 * shares[top]:.0f}% of the loader's work" + (f" ({others})" if others else "")
    if wait_share is not None:
        summary += f"; the caller waited for data {100 * wait_share:.0f}% of its time"
        if wait_share < 0.1:
            summary += " (the loader keeps up: the caller's own work sets the pace)"
    return {"verdict": verdict, "shares": shares, "wait_share": wait_share, "summary": summary}


class _OnStream(NamedTuple):
    """A CUDA batch made on the loader's side stream, and the event (``ready``) marking it done."""
    batch: Batch
    ready: Any

    def hand_over(self, device: torch.device) -> Batch:
        """The batch for the caller's stream: it waits for ``ready``; the memory outlives its use."""
        cur = torch.cuda.current_stream(device)
        cur.wait_event(self.ready)
        for t in self.batch:
            t.record_stream(cur)
        return self.batch


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))
