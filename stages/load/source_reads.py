"""Reading several image artifacts as one backend: each source read by its own backend (``memory``,
``webdataset``, ``ffcv``), each over its own part of this rank's order, in order, a batch at a
time; a batch of the loader takes its next samples from each source's stream and lays them out
in the mixture's order (``MixtureReads``). A sample a backend drops (``on_corrupt: skip``) is
dropped from the batch. The sources must agree on image shape (a fixed one), channels and
classes (``check_compatible``); DALI, which augments inside its own pipeline, is refused by the
loader. One source needs none of this: the loader reads it through its backend directly.
"""
from __future__ import annotations

import collections
import time
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from sluice.errors import LoaderError
from sluice.stages.load.backends import Backend, Timings
from sluice.stages.load.canvas import Canvas, Encoded
from sluice.storage.artifact import DatasetArtifact

__all__ = ["MixtureReads", "check_compatible", "kept_of"]


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
