"""``dali``: NVIDIA DALI decodes and augments, in any sampler's order.

DALI's own readers can only shuffle, so this backend feeds the pipeline through one batch-mode
``fn.external_source``: for each batch of the requested order it ``pread``s the samples' image
members out of the WebDataset shards (``SampleIndex``, via the DALI index offsets) and hands DALI
the raw pixels (npy) or the encoded bytes (png/jpg, decoded by ``fn.decoders.image``: "mixed" on
CUDA, "cpu" otherwise).

Augmentation parameters come from ``augment.draw_params`` seeded by ``batch_seed(seed, epoch, b)``
— the very draws the torch path makes — and reach each op's DALI half (``apply_dali``) as
per-sample tensor arguments (``dali_inputs``). So batch b of epoch e is augmented as on every
other backend; resuming at ``start_batch`` gives exactly the batches a full epoch would have;
and the pipeline is built once and reused for every epoch, order and resolution (sizes are
tensor arguments too).

Constructing a ``DaliBackend`` imports DALI, and raises ``MissingDependency`` naming
``nvidia-dali-cuda120`` when it is not installed.
"""
from __future__ import annotations

import collections
import io
import time
from typing import Iterator

import numpy as np
import torch

from sluice.errors import LoaderError, require
from sluice.stages.load.augment import AugmentSpec, batch_seed, draw_params
from sluice.stages.load.augment.base import one_size_ops
from sluice.stages.load.augment.torch_path import check_variable_sizes
from sluice.stages.load.backends.base import LOADER_BACKENDS, Backend
from sluice.stages.load.integrity import Guard
from sluice.stages.load.sample_index import SampleIndex
from sluice.storage.artifact import DatasetArtifact
from sluice.stages.pixels import channels_last

_DTYPES = {"uint8": "UINT8", "int32": "INT32", "int64": "INT64", "float": "FLOAT"}


def _image_hwc(data: bytes) -> tuple[int, int, int]:
    """(H, W, C) of an encoded image from its header only (no decode)."""
    from PIL import Image
    with Image.open(io.BytesIO(data)) as im:
        w, h = im.size
        c = 1 if im.mode in ("L", "1", "I", "I;16", "F") else 3
    return h, w, c


class _Source:
    """The external source's callable: yields one batch tuple per call from the current plan
    (a generator set by ``DaliBackend.epoch``); StopIteration ends the DALI epoch.
    Everything it sends is numpy: images, indices and the per-sample augmentation parameters."""

    def __init__(self, index: SampleIndex):
        self.index = index
        self.plan: Iterator[tuple] = iter(())
        self.read_s = 0.0

    def __call__(self):
        return next(self.plan)


@LOADER_BACKENDS.register("dali")
class DaliBackend(Backend):
    """Batches ``(images float32 NCHW on device, labels int64, indices int64)`` in any order."""

    name = "dali"
    reads_shards = True
    augments = True  # decodes, augments and places batches itself: the loader only forwards them

    @classmethod
    def open(cls, artifact, split, config, device, workers) -> "DaliBackend":
        return cls(artifact, split, config.augment, device, max(1, workers), config.seed,
                   Guard.for_config(artifact, split, config))

    def __init__(self, artifact: DatasetArtifact, split: str, augment: AugmentSpec | None,
                 device: torch.device, workers: int, seed: int = 0, guard: Guard | None = None):
        require("nvidia.dali", "nvidia-dali-cuda120", "dali", "the dali loader backend")
        self.artifact, self.split = artifact, split
        self.guard = guard if guard is not None else Guard(artifact, split)
        self.spec = augment or AugmentSpec()
        self.device = torch.device(device)
        self.workers = max(1, int(workers))
        self.seed = int(seed)
        self.index = SampleIndex(artifact, split, sums=self.guard.column("tar"))
        self.encoding = self.index.encoding
        self.labels = np.asarray(artifact.labels(split), dtype=np.int64)
        self.shape = tuple(self.index.shape) if self.index.shape else None
        if self.shape is not None:
            self.channels = int(self.shape[2])
        elif self.index.count:
            self.channels = _image_hwc(self.index.read(0))[2]
        else:
            self.channels = 3
        ops = self.spec.ops
        finishing = [k for k, op in enumerate(ops) if op.finishes_dali]
        if len(finishing) > 1 or (finishing and finishing[0] != len(ops) - 1):
            names = ", ".join(ops[k].op for k in finishing)
            raise LoaderError(f"the dali backend runs {names} as the last op (fused with the "
                              "HWC->CHW float conversion); put it last and only once")
        for op in ops:  # per-channel values must fit the data before the pipeline is built
            op.check_channels(self.channels)
        self._one_size = any(op.makes_one_size for op in ops)  # random_resized_crop, center_crop
        self._needs_sizes = any(op.needs_sizes for op in ops)
        self._pipes: dict[tuple[int, bool], tuple] = {}  # (max batch, final resize) -> (pipe, source)
        self._live = None  # the epoch generator currently driving a pipeline
        # DALI decodes and augments in one pipeline: its time is "decode+augment"
        self.timings: dict[str, float] = {"read": 0.0, "decode+augment": 0.0, "transfer": 0.0}

    # ---------------------------------------------------------------- the pipeline
    def _build(self, max_batch: int, final_resize: bool):
        from nvidia.dali import fn, pipeline_def, types

        from sluice.stages.load.augment.base import DaliContext
        gpu = self.device.type == "cuda"
        source = _Source(self.index)
        ops = self.spec.ops
        body, last = (ops[:-1], ops[-1]) if ops and ops[-1].finishes_dali else (ops, None)
        names, dtypes = ["images", "indices"], [types.UINT8, types.INT64]
        for k, op in enumerate(ops):
            for name, dtype in op.dali_input_types:
                names.append(f"{name}{k}")
                dtypes.append(getattr(types, _DTYPES[dtype]))
        if final_resize:
            names.append("final_size")
            dtypes.append(types.FLOAT)
        layouts = ["HWC" if (n == "images" and self.encoding == "npy") else "" for n in names]
        ctx = DaliContext(gpu=gpu, channels=self.channels)
        encoding, c = self.encoding, self.channels

        @pipeline_def(batch_size=max_batch, num_threads=self.workers,
                      device_id=(self.device.index or 0) if gpu else None,
                      seed=self.seed, prefetch_queue_depth=2)
        def pipe():
            nodes = fn.external_source(source=source, num_outputs=len(names), batch=True,
                                       dtype=dtypes, layout=layouts, cycle=None)
            nd = dict(zip(names, nodes))
            x = nd["images"]
            if encoding == "npy":
                x = x.gpu() if gpu else x
            else:
                x = fn.decoders.image(x, device="mixed" if gpu else "cpu",
                                      output_type=types.GRAY if c == 1 else types.RGB)
            for k, op in enumerate(body):
                x = op.apply_dali(x, [nd[f"{name}{k}"] for name, _ in op.dali_input_types], ctx)
            if final_resize:
                x = fn.resize(x, size=nd["final_size"], interp_type=types.INTERP_LINEAR,
                              antialias=True, dtype=types.FLOAT)
            if last is not None:
                k = len(ops) - 1
                x = last.apply_dali(x, [nd[f"{name}{k}"] for name, _ in last.dali_input_types], ctx)
            else:  # x/255 exactly as torch computes it (CMN multiplies by 1/255)
                x = fn.transpose(x, perm=[2, 0, 1], output_layout="CHW")
                x = fn.cast(x, dtype=types.FLOAT) / 255.0
            return x, nd["indices"]

        p = pipe()
        p.build()
        return p, source

    def _pipe(self, batch_size: int, final_resize: bool):
        for (mb, fr), entry in self._pipes.items():
            if fr == final_resize and mb >= batch_size:
                return entry
        entry = self._build(batch_size, final_resize)
        self._pipes[(batch_size, final_resize)] = entry
        return entry

    # ---------------------------------------------------------------- host-side parameters
    def _batch(self, idx: np.ndarray, b: int, epoch: int, resolution: int | None,
               final_resize: bool, source: _Source) -> tuple:
        t0 = time.perf_counter()
        data, damage = self.index.read_batch(idx)  # each sample's bytes checked as read, before DALI sees them
        if damage:
            self.guard.take(damage)  # fail: raised here, before DALI runs this batch
            good = [d is not None for d in data]
            idx, data = np.asarray(idx, np.int64)[good], [d for d in data if d is not None]
            if not len(idx):  # skip, and nothing left: DALI cannot run an empty batch; the caller
                source.read_s += time.perf_counter() - t0  # yields one in its place (_run)
                return None
        if self.encoding == "npy":
            # the pixels are the member's last prod(shape) bytes: no header is parsed
            nbytes = self.index.nbytes
            images = [np.frombuffer(d, np.uint8, offset=len(d) - nbytes).reshape(self.shape) for d in data]
        else:
            images = [np.frombuffer(d, np.uint8) for d in data]
        n = len(idx)
        if self.shape is not None:
            hs, ws = np.full(n, self.shape[0], np.int64), np.full(n, self.shape[1], np.int64)
        elif self._needs_sizes:
            hw = np.array([_image_hwc(d)[:2] for d in data], np.int64)
            hs, ws = hw[:, 0], hw[:, 1]
        else:  # no op reads the sizes
            hs = ws = np.zeros(n, np.int64)
        source.read_s += time.perf_counter() - t0
        g = torch.Generator().manual_seed(batch_seed(self.seed, epoch, b))
        params = draw_params(self.spec.ops, n, hs, ws, resolution, g)
        out = [images, np.asarray(idx, np.int64)]
        for op, p in zip(self.spec.ops, params):
            out += op.dali_inputs(p, n)
        if final_resize:
            out.append(np.full((n, 2), resolution, np.float32))
        return tuple(out)

    # ---------------------------------------------------------------- epochs
    def epoch(self, order: np.ndarray, batch_size: int, drop_last: bool, start_batch: int = 0, *,
              resolution: int | None = None, epoch: int = 0
              ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Yield (images float32 NCHW augmented+normalised on ``device``, labels int64, indices
        int64) for ``order[start_batch*batch_size:]`` in exactly that order, batch by batch; the
        last partial batch is yielded unless ``drop_last``. Batch ``b``'s augmentation depends
        only on (seed, epoch, b), so resuming at ``start_batch`` repeats a full epoch's tail."""
        if batch_size < 1:
            raise LoaderError(f"batch_size must be >= 1, got {batch_size}")
        order = np.ascontiguousarray(order, dtype=np.int64).reshape(-1)  # DALI refuses strided arrays
        if len(order) and (order.min() < 0 or order.max() >= self.index.count):
            raise LoaderError(f"order has indices outside split {self.split!r} of {self.index.count} samples")
        n = len(order)
        n_batches = n // batch_size if drop_last else -(-n // batch_size)
        start_batch = max(0, int(start_batch))
        if self._live is not None:  # a previous epoch left unfinished: release its pipeline
            self._live.close()
            self._live = None
        if start_batch >= n_batches:
            return iter(())
        if resolution is not None and not self._one_size:
            final_resize = self.shape is None or self.shape[0] != resolution or self.shape[1] != resolution
        else:
            final_resize = False
        if self.shape is None and not final_resize:  # sizes vary: the torch path's rule, before DALI runs
            check_variable_sizes(self.spec.ops, resolution)
        gen = self._run(order, batch_size, n_batches, start_batch, resolution, epoch, final_resize)
        self._live = gen
        return gen

    def _run(self, order, batch_size, n_batches, start_batch, resolution, epoch, final_resize):
        pipe, source = self._pipe(batch_size, final_resize)
        spec_cl = self.spec.channels_last
        gpu = self.device.type == "cuda"

        fed: collections.deque[int] = collections.deque()  # the batches DALI was given, in order

        def plan():
            for b in range(start_batch, n_batches):
                idx = order[b * batch_size:(b + 1) * batch_size]
                out = self._batch(idx, b, epoch, resolution, final_resize, source)
                if out is not None:  # None: every sample damaged (skip); an empty batch takes its place
                    fed.append(b)
                    yield out

        source.plan = plan()
        source.read_s = 0.0
        done = False
        nxt = start_batch  # the next batch number to yield
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    images, indices = pipe.run()
                except StopIteration:
                    done = True
                    break
                b = fed.popleft()
                for _ in range(nxt, b):  # batches whose every sample was damaged: empty, as on every
                    yield self._empty(resolution, final_resize)  # backend, so ranks step alike
                nxt = b + 1
                t1 = time.perf_counter()
                if not images.is_dense_tensor():
                    raise LoaderError("images of different sizes in one batch: start the augmentation with "
                                      f"{' or '.join(one_size_ops())} (with a size), or pass a resolution "
                                      "to the dali backend")
                if gpu:
                    from nvidia.dali.plugin.pytorch import feed_ndarray
                    dense = images.as_tensor()
                    x = torch.empty(dense.shape(), dtype=torch.float32, device=self.device)
                    feed_ndarray(dense, x, cuda_stream=torch.cuda.current_stream(self.device))
                    ind = torch.from_numpy(np.array(indices.as_tensor()).reshape(-1))
                else:
                    x = torch.from_numpy(np.array(images.as_tensor()))
                    ind = torch.from_numpy(np.array(indices.as_tensor()).reshape(-1))
                if spec_cl:
                    x = channels_last(x)
                lab = torch.from_numpy(self.labels[ind.numpy()])
                t2 = time.perf_counter()
                self.timings["read"] += source.read_s
                self.timings["decode+augment"] += max(0.0, (t1 - t0) - source.read_s)
                self.timings["transfer"] += t2 - t1
                source.read_s = 0.0
                yield x, lab, ind
            for _ in range(nxt, n_batches):
                yield self._empty(resolution, final_resize)
        finally:
            try:
                if not done:  # abandoned mid-epoch: drain what DALI prefetched so the pipe is reusable
                    source.plan = iter(())
                    try:
                        while True:
                            pipe.run()
                    except StopIteration:
                        pass
                pipe.reset()
            except Exception:  # a pipeline in an unknown state is rebuilt next time
                self._pipes = {k: v for k, v in self._pipes.items() if v[0] is not pipe}

    def _empty(self, resolution: int | None, final_resize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A batch of no samples, shaped as this epoch's batches (``on_corrupt: skip`` dropped them all)."""
        hs, ws = (np.array([self.shape[0]]), np.array([self.shape[1]])) if self.shape else (np.zeros(1), np.zeros(1))
        for op in self.spec.ops:
            hs, ws = op.output_sizes(hs, ws, resolution)
        h, w = (resolution, resolution) if final_resize else (int(hs[0]), int(ws[0]))
        x = torch.empty((0, self.channels, h, w), dtype=torch.float32, device=self.device)
        if self.spec.channels_last:
            x = channels_last(x)
        return x, torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)

    def close(self) -> None:
        """Stop and free the pipelines (their threads end once nothing references them)."""
        if self._live is not None:
            self._live.close()
            self._live = None
        self._pipes.clear()
        self.index.close()
