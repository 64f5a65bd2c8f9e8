"""The NVIDIA DALI loader backend: any sampler's order, decoded and augmented by DALI operators.

DALI's own readers can only shuffle, so this backend feeds the pipeline through one batch-mode
``fn.external_source``: for each batch of the requested order it ``pread``s the samples' image
members out of the WebDataset shards (``SampleIndex``, via the DALI index offsets) and hands DALI
the raw pixels (npy) or the encoded bytes (png/jpg, decoded by ``fn.decoders.image``: "mixed" on
CUDA, "cpu" otherwise).

Augmentation randomness is drawn on the host, per batch, from ``(seed, epoch_seed, batch)`` with
the very sampling code ``TorchAugment`` uses (``rrc_boxes`` etc.), and passed to the DALI
operators as per-sample tensor arguments (crop ROI of ``fn.resize``, ``fn.flip(horizontal=)``,
``fn.slice`` start for translate, ``fn.erase`` box for cutout, brightness/contrast factors). So:
the distribution is that of ``TorchAugment`` by construction; a run is reproducible; resuming at
``start_batch`` gives exactly the batches a full epoch would have given; and the pipeline is built
once and reused for every epoch, order and resolution (sizes are tensor arguments too).

Importing this module does not import DALI; constructing a ``DaliBackend`` does, and raises
``MissingDependency`` naming ``nvidia-dali-cuda120`` when it is not installed.
"""
from __future__ import annotations

import io
import time
from typing import Iterator

import numpy as np
import torch

from sluice.stages.load.augment import (AugmentSpec, BrightnessContrast, Cutout, Flip, Normalize,
                            RandomResizedCrop, Translate, rrc_boxes)
from sluice.errors import require
from sluice.stages.load.sample_index import SampleIndex
from sluice.storage.artifact import DatasetArtifact


def _image_hwc(data: bytes, encoding: str) -> tuple[int, int, int]:
    """(H, W, C) of an encoded image from its header only (no decode)."""
    from PIL import Image
    with Image.open(io.BytesIO(data)) as im:
        w, h = im.size
        c = 1 if im.mode in ("L", "1", "I", "I;16", "F") else 3
    return h, w, c


def batch_seed(seed: int, epoch_seed: int, batch: int) -> int:
    """The torch seed of batch ``batch``'s augmentation draws: ``TorchAugment(spec)`` reseeded
    with it draws the very same parameters (same ops, same order of draws)."""
    ss = np.random.SeedSequence([int(seed), int(epoch_seed), int(batch)])
    return int(ss.generate_state(1, np.uint64)[0] >> np.uint64(1))


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


class DaliBackend:
    """Batches ``(images float32 NCHW on device, labels int64, indices int64)`` in any order."""

    name = "dali"
    augments = True  # decodes, augments and places batches itself: the loader only forwards them

    def __init__(self, artifact: DatasetArtifact, split: str, augment: AugmentSpec | None,
                 device: torch.device, workers: int, seed: int = 0):
        require("nvidia.dali", "nvidia-dali-cuda120", "dali", "the dali loader backend")
        self.artifact = artifact
        self.split = split
        self.spec = augment or AugmentSpec()
        self.device = torch.device(device)
        self.workers = max(1, int(workers))
        self.seed = int(seed)
        self.index = SampleIndex(artifact, split)
        self.encoding = self.index.encoding
        self.labels = np.asarray(artifact.labels(split), dtype=np.int64)
        self.shape = tuple(self.index.shape) if self.index.shape else None
        if self.shape is not None:
            self.channels = int(self.shape[2])
        elif self.index.count:
            self.channels = _image_hwc(self.index.read(0), self.encoding)[2]
        else:
            self.channels = 3
        ops = self.spec.ops
        norm_at = [k for k, op in enumerate(ops) if isinstance(op, Normalize)]
        if len(norm_at) > 1 or (norm_at and norm_at[0] != len(ops) - 1):
            raise ValueError("the dali backend runs normalize as the last op (fused with the "
                             "HWC->CHW float conversion); put it last and only once")
        self._norm = ops[norm_at[0]] if norm_at else None
        if self._norm is not None:
            for name in ("mean", "std"):
                v = getattr(self._norm, name)
                if len(v) not in (1, self.channels):
                    raise ValueError(f"normalize.{name} has {len(v)} values for {self.channels} channels")
        self._has_rrc = any(isinstance(op, RandomResizedCrop) for op in ops)
        self._needs_sizes = any(isinstance(op, (RandomResizedCrop, Cutout)) for op in ops)
        self._pipes: dict[tuple[int, bool], tuple] = {}  # (max batch, final resize) -> (pipe, source)
        self._live = None  # the epoch generator currently driving a pipeline
        self.timings: dict[str, float] = {"read": 0.0, "augment": 0.0, "transfer": 0.0}

    # ---------------------------------------------------------------- the pipeline
    def _build(self, max_batch: int, final_resize: bool):
        from nvidia.dali import fn, pipeline_def, types
        import nvidia.dali.math as dmath

        gpu = self.device.type == "cuda"
        dev = "gpu" if gpu else "cpu"
        source = _Source(self.index)
        ops = self.spec.ops
        outs = ["images", "indices"]
        for k, op in enumerate(ops):
            if isinstance(op, RandomResizedCrop):
                outs += [f"roi_start{k}", f"roi_end{k}", f"size{k}"]
            elif isinstance(op, Flip):
                outs += [f"flip{k}"]
            elif isinstance(op, Translate):
                outs += [f"shift{k}"]
            elif isinstance(op, Cutout):
                outs += [f"cut_anchor{k}", f"cut_shape{k}"]
            elif isinstance(op, BrightnessContrast):
                outs += [f"bc{k}"]
        if final_resize:
            outs += ["final_size"]
        self._outs = outs
        dtypes = []
        for name in outs:
            if name == "images":
                dtypes.append(types.UINT8)
            elif name == "indices":
                dtypes.append(types.INT64)
            elif name.startswith(("flip", "shift")):
                dtypes.append(types.INT32)
            else:
                dtypes.append(types.FLOAT)
        layouts = ["HWC" if (n == "images" and self.encoding == "npy") else "" for n in outs]
        c = self.channels
        norm = self._norm
        mean = [m * 255.0 for m in (norm.mean if norm else [0.0])]
        std = [s * 255.0 for s in (norm.std if norm else [1.0])]
        if len(mean) == 1:
            mean = mean * c
        if len(std) == 1:
            std = std * c
        encoding = self.encoding

        @pipeline_def(batch_size=max_batch, num_threads=self.workers,
                      device_id=(self.device.index or 0) if gpu else None,
                      seed=self.seed, prefetch_queue_depth=2)
        def pipe():
            nodes = fn.external_source(source=source, num_outputs=len(outs), batch=True,
                                       dtype=dtypes, layout=layouts, cycle=None)
            nd = dict(zip(outs, nodes))
            x = nd["images"]
            if encoding == "npy":
                x = x.gpu() if gpu else x
            else:
                x = fn.decoders.image(x, device="mixed" if gpu else "cpu",
                                      output_type=types.GRAY if c == 1 else types.RGB)
            for k, op in enumerate(ops):
                if isinstance(op, RandomResizedCrop):
                    x = fn.resize(x, roi_start=nd[f"roi_start{k}"], roi_end=nd[f"roi_end{k}"],
                                  size=nd[f"size{k}"], interp_type=types.INTERP_LINEAR,
                                  antialias=False, dtype=types.FLOAT)
                elif isinstance(op, Flip):
                    x = fn.flip(x, horizontal=nd[f"flip{k}"], vertical=0)
                elif isinstance(op, Translate):
                    if op.pad:
                        x = fn.slice(x, start=nd[f"shift{k}"], rel_shape=[1.0, 1.0], axis_names="HW",
                                     out_of_bounds_policy="pad", fill_values=0)
                elif isinstance(op, Cutout):
                    x = fn.erase(x, anchor=nd[f"cut_anchor{k}"], shape=nd[f"cut_shape{k}"],
                                 axis_names="HW", fill_value=0)
                elif isinstance(op, BrightnessContrast):
                    bc = nd[f"bc{k}"]  # per sample [brightness, contrast*brightness]
                    b = fn.slice(bc, start=[0], shape=[1], axes=[0])
                    cb = fn.slice(bc, start=[1], shape=[1], axes=[0])
                    if gpu:
                        b, cb = b.gpu(), cb.gpu()
                    m = fn.reductions.mean(x, dtype=types.FLOAT)
                    xf = fn.cast(x, dtype=types.FLOAT)
                    x = dmath.clamp((xf - m) * cb + m * b, 0.0, 255.0)
            if final_resize:
                x = fn.resize(x, size=nd["final_size"], interp_type=types.INTERP_LINEAR,
                              antialias=True, dtype=types.FLOAT)
            if norm is None:  # x/255 exactly as torch computes it (CMN multiplies by 1/255)
                x = fn.transpose(x, perm=[2, 0, 1], output_layout="CHW")
                x = fn.cast(x, dtype=types.FLOAT) / 255.0
            else:
                x = fn.crop_mirror_normalize(x, mean=mean, std=std, output_layout="CHW",
                                             dtype=types.FLOAT, device=dev)
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
    def _batch(self, idx: np.ndarray, b: int, epoch_seed: int, resolution: int | None,
               final_resize: bool, source: _Source) -> tuple:
        t0 = time.perf_counter()
        data = [self.index.read(int(i)) for i in idx]
        if self.encoding == "npy":
            if self.index._npy_header is None:
                self.index.pixels(int(idx[0]))
            hdr = self.index._npy_header
            images = [np.frombuffer(d, np.uint8, offset=hdr).reshape(self.shape) for d in data]
        else:
            images = [np.frombuffer(d, np.uint8) for d in data]
        n = len(idx)
        if self.shape is not None:
            hs = np.full(n, self.shape[0], np.int64)
            ws = np.full(n, self.shape[1], np.int64)
        elif self._needs_sizes:
            hw = [_image_hwc(d, self.encoding)[:2] for d in data]
            hs = np.array([h for h, _ in hw], np.int64)
            ws = np.array([w for _, w in hw], np.int64)
        else:
            hs = ws = None
        source.read_s += time.perf_counter() - t0
        g = torch.Generator().manual_seed(batch_seed(self.seed, epoch_seed, b))
        out = [images, np.asarray(idx, np.int64)]
        for op in self.spec.ops:
            if isinstance(op, RandomResizedCrop):
                side = resolution or op.size
                if hs is not None and (hs == hs[0]).all() and (ws == ws[0]).all():
                    boxes = rrc_boxes(n, int(hs[0]), int(ws[0]), op.scale, op.ratio, g).numpy()
                else:
                    boxes = np.concatenate([rrc_boxes(1, int(h), int(w), op.scale, op.ratio, g).numpy()
                                            for h, w in zip(hs, ws)])
                top, left, bh, bw = boxes.T
                out += [np.stack([top, left], 1).astype(np.float32),
                        np.stack([top + bh, left + bw], 1).astype(np.float32)]
                if side:
                    hs, ws = np.full(n, side, np.int64), np.full(n, side, np.int64)
                out.append(np.stack([hs, ws], 1).astype(np.float32))
            elif isinstance(op, Flip):
                out.append((torch.rand(n, generator=g) < op.p).numpy().astype(np.int32))
            elif isinstance(op, Translate):
                if op.pad:
                    dy = torch.randint(0, 2 * op.pad + 1, (n,), generator=g).numpy()
                    dx = torch.randint(0, 2 * op.pad + 1, (n,), generator=g).numpy()
                    out.append(np.stack([dy, dx], 1).astype(np.int32) - op.pad)
                else:
                    out.append(np.zeros((n, 2), np.int32))
            elif isinstance(op, Cutout):
                # same draws as TorchAugment's _cutout: centres in [0, h) x [0, w), then p
                if (hs == hs[0]).all() and (ws == ws[0]).all():
                    cy = torch.randint(0, int(hs[0]), (n,), generator=g).numpy()
                    cx = torch.randint(0, int(ws[0]), (n,), generator=g).numpy()
                else:
                    cy = (torch.rand(n, generator=g).numpy() * hs).astype(np.int64)
                    cx = (torch.rand(n, generator=g).numpy() * ws).astype(np.int64)
                on = (torch.rand(n, generator=g) < op.p).numpy()
                half = op.size // 2
                y0, x0 = np.maximum(cy - half, 0), np.maximum(cx - half, 0)
                y1, x1 = np.minimum(cy - half + op.size, hs), np.minimum(cx - half + op.size, ws)
                sh = np.stack([np.maximum(y1 - y0, 0), np.maximum(x1 - x0, 0)], 1) * on[:, None]
                out += [np.stack([y0, x0], 1).astype(np.float32), sh.astype(np.float32)]
            elif isinstance(op, BrightnessContrast):
                bf = torch.empty(n).uniform_(1 - op.brightness, 1 + op.brightness, generator=g).numpy()
                cf = torch.empty(n).uniform_(1 - op.contrast, 1 + op.contrast, generator=g).numpy()
                out.append(np.stack([bf, bf * cf], 1).astype(np.float32))
        if final_resize:
            out.append(np.full((n, 2), resolution, np.float32))
        return tuple(out)

    # ---------------------------------------------------------------- epochs
    def epoch(self, order: np.ndarray, batch_size: int, drop_last: bool, start_batch: int = 0,
              resolution: int | None = None, epoch_seed: int = 0
              ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Yield (images float32 NCHW augmented+normalised on ``device``, labels int64, indices
        int64) for ``order[start_batch*batch_size:]`` in exactly that order, batch by batch; the
        last partial batch is yielded unless ``drop_last``. Batch ``b``'s augmentation depends
        only on (seed, epoch_seed, b), so resuming at ``start_batch`` repeats a full epoch's tail."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        order = np.ascontiguousarray(order, dtype=np.int64).reshape(-1)  # DALI refuses strided arrays
        if len(order) and (order.min() < 0 or order.max() >= self.index.count):
            raise IndexError(f"order has indices outside split {self.split!r} of {self.index.count} samples")
        n = len(order)
        n_batches = n // batch_size if drop_last else -(-n // batch_size)
        start_batch = max(0, int(start_batch))
        if self._live is not None:  # a previous epoch left unfinished: release its pipeline
            self._live.close()
            self._live = None
        if start_batch >= n_batches:
            return iter(())
        if resolution is not None and not self._has_rrc:
            final_resize = self.shape is None or self.shape[0] != resolution or self.shape[1] != resolution
        else:
            final_resize = False
        gen = self._run(order, batch_size, n_batches, start_batch, resolution, epoch_seed, final_resize)
        self._live = gen
        return gen

    def _run(self, order, batch_size, n_batches, start_batch, resolution, epoch_seed, final_resize):
        pipe, source = self._pipe(batch_size, final_resize)
        spec_cl = self.spec.channels_last
        gpu = self.device.type == "cuda"

        def plan():
            for b in range(start_batch, n_batches):
                idx = order[b * batch_size:(b + 1) * batch_size]
                yield self._batch(idx, b, epoch_seed, resolution, final_resize, source)

        source.plan = plan()
        source.read_s = 0.0
        done = False
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    images, indices = pipe.run()
                except StopIteration:
                    done = True
                    break
                t1 = time.perf_counter()
                if not images.is_dense_tensor():
                    raise ValueError("images of different sizes in one batch: add a RandomResizedCrop "
                                     "or pass a resolution to the dali backend")
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
                    x = x.contiguous(memory_format=torch.channels_last)
                lab = torch.from_numpy(self.labels[ind.numpy()])
                t2 = time.perf_counter()
                self.timings["read"] += source.read_s
                self.timings["augment"] += max(0.0, (t1 - t0) - source.read_s)
                self.timings["transfer"] += t2 - t1
                source.read_s = 0.0
                yield x, lab, ind
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

    def close(self) -> None:
        """Stop and free the pipelines (their threads end once nothing references them)."""
        if self._live is not None:
            self._live.close()
            self._live = None
        self._pipes.clear()
        self.index.close()
