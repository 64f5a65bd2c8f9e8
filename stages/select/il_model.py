"""Irreducible loss (RHO-LOSS, Mindermann et al. 2022): a small model trained on the holdout
split scores every train sample once; the scores are stored and reused.

A train sample's irreducible loss (IL) is its loss under a model that never trained on it. Its
training loss minus its IL (the *reducible* loss) is high for points that are learnable and not
yet learnt, and low for noisy or already-learnt ones. Training the IL model is the expensive
part, so the array is a scores artifact keyed by the dataset fingerprint and this config; a new
dataset version carries its unchanged samples' scores by key (``il_carry.py``).
"""
from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from sluice.errors import ConfigError, SelectionError
from sluice.stages.optimizer import build_optimizer
from sluice.stages.pixels import channel_values, channels_last, normalize_uint8
from sluice.stages.precision import autocast, resolve_amp
from sluice.stages.models import build_model
from sluice.stages.select.config import ILModelConfig
from sluice.storage.scores import Scores, find_scores, save_scores

IL_KIND = "irreducible_loss"
# Fields that never change a stored value: how it is computed in batches, a progress bar, and when
# a carried IL model is retrained (a carried score is the same model's loss on the same sample).
UNKEYED = {"score_batch_size", "progress", "refresh_growth"}


def _key(config: ILModelConfig) -> dict:
    """The config fields that change IL values (scoring batch size does not; "auto" precision
    is keyed as what it resolved to)."""
    return config.model_dump(exclude=UNKEYED)


def resolved_config(config: ILModelConfig, device: str | torch.device) -> ILModelConfig:
    """``config`` with "auto" precision resolved for ``device`` (what the scores are keyed by)."""
    return config.model_copy(update={"amp": resolve_amp(config.amp, device)})


def to_float_images(images: np.ndarray | torch.Tensor, config: ILModelConfig) -> torch.Tensor:
    """NCHW float32 images: uint8 is scaled and normalised, float is taken as normalised."""
    x = torch.as_tensor(np.asarray(images) if not isinstance(images, torch.Tensor) else images)
    if x.ndim == 3:
        x = x.unsqueeze(1)
    elif x.ndim == 4 and x.shape[-1] in (1, 3) and x.shape[1] not in (1, 3):
        x = x.permute(0, 3, 1, 2)
    if x.ndim != 4:
        raise SelectionError(f"images must be (N,H,W), (N,C,H,W) or (N,H,W,C); got {tuple(x.shape)}")
    if x.dtype != torch.uint8:
        return x.float()
    c = x.shape[1]
    try:
        mean, std = channel_values(config.mean, c, what="IL mean"), channel_values(config.std, c, what="IL std")
    except ConfigError as e:
        raise SelectionError(f"{e} (selection.il.mean/std)") from None
    return normalize_uint8(x, mean, std)


def _check_labels(labels: np.ndarray, n: int, num_classes: int, what: str) -> torch.Tensor:
    y = torch.as_tensor(np.asarray(labels)).long().reshape(-1)
    if y.numel() != n:
        raise SelectionError(f"{what}: {n} images but {y.numel()} labels")
    if n and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise SelectionError(f"{what}: labels must lie in [0, {num_classes}), got "
                             f"[{int(y.min())}, {int(y.max())}]")
    return y


def train_il_model(config: ILModelConfig, images: torch.Tensor, labels: torch.Tensor,
                   num_classes: int, device: str | torch.device = "cpu") -> torch.nn.Module:
    """Train the IL model on the holdout split (deterministic for a seed on one device)."""
    torch.manual_seed(config.seed)
    model = build_model(config.architecture, in_channels=images.shape[1], num_classes=num_classes,
                        **config.model_kwargs).to(device)
    opt = build_optimizer(config.optimizer, model, config.lr, momentum=config.momentum,
                          weight_decay=config.weight_decay, nesterov=False)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=config.lr, total_steps=config.epochs * -(-len(images) // config.batch_size))
    gen = torch.Generator().manual_seed(config.seed)
    model = channels_last(model)
    model.train()
    bar = tqdm(total=config.epochs * len(images), desc="IL model: training on holdout", unit="sample",
               disable=not config.progress, dynamic_ncols=True, leave=False)
    for _ in range(config.epochs):
        for idx in torch.randperm(len(images), generator=gen).split(config.batch_size):
            bar.update(len(idx))
            if len(idx) < 2:  # BatchNorm needs two samples in train mode
                continue
            x = images[idx].to(device)
            if config.flip:
                flip = torch.rand(len(idx), generator=gen) < 0.5
                x[flip] = x[flip].flip(-1)
            with _amp(config, device):
                out = model(channels_last(x))
            loss = F.cross_entropy(out.float(), labels[idx].to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    bar.close()
    return model.eval()


def _amp(config: ILModelConfig, device: str | torch.device):
    return autocast(resolve_amp(config.amp, device), device)


@torch.no_grad()
def per_sample_loss(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor,
                    batch_size: int = 1024, device: str | torch.device = "cpu",
                    config: ILModelConfig | None = None) -> np.ndarray:
    """Cross-entropy of every sample under ``model`` in eval mode, as float32."""
    return _score(model, images, labels, batch_size, device, config)[0]


def _score(model, images, labels, batch_size, device, config) -> tuple[np.ndarray, float]:
    """Per-sample cross-entropy and the accuracy, from one pass."""
    values, hits = score_hits(model, images, labels, batch_size, device, config)
    return values, round(hits / max(1, len(images)), 4)


@torch.no_grad()
def score_hits(model, images, labels, batch_size, device, config) -> tuple[np.ndarray, int]:
    """Per-sample cross-entropy and how many the model got right, batch after batch (a part of
    the scoring pass run anywhere: ``il_parts``)."""
    model.eval()
    config = config or ILModelConfig(amp="none")
    out, hits = [], 0
    for s in range(0, len(images), batch_size):
        with _amp(config, device):
            logits = model(channels_last(images[s:s + batch_size].to(device))).float()
        y = labels[s:s + batch_size].to(device)
        out.append(F.cross_entropy(logits, y, reduction="none").cpu())
        hits += int((logits.argmax(1) == y).sum())
    values = torch.cat(out).numpy().astype(np.float32) if out else np.zeros(0, np.float32)
    return values, hits


def compute_irreducible_loss(config: ILModelConfig, holdout_images: np.ndarray | torch.Tensor,
                             holdout_labels: np.ndarray, train_images: np.ndarray | torch.Tensor,
                             train_labels: np.ndarray, fingerprint: str,
                             scores_root: str | os.PathLike | None = None, *,
                             num_classes: int | None = None, split: str = "train",
                             device: str | torch.device = "cpu") -> np.ndarray:
    """IL of every ``split`` sample (aligned to its index), reused from ``scores_root`` when the
    dataset fingerprint and IL config match, else trained on the holdout split and stored."""
    return irreducible_loss_scores(config, holdout_images, holdout_labels, train_images,
                                   train_labels, fingerprint, scores_root, num_classes=num_classes,
                                   split=split, device=device).values


def irreducible_loss_scores(config: ILModelConfig, holdout_images, holdout_labels, train_images,
                            train_labels, fingerprint: str,
                            scores_root: str | os.PathLike | None = None, *,
                            num_classes: int | None = None, split: str = "train",
                            device: str | torch.device = "cpu") -> Scores:
    """Like ``compute_irreducible_loss`` but returns the Scores record (with its cost in
    ``extra``: ``train_seconds``, ``score_seconds``, ``reused``)."""
    num_classes = check_inputs(holdout_images, holdout_labels, train_images, train_labels, split, num_classes)
    config = resolved_config(config, device)
    key = score_key(config, num_classes)
    if scores_root is not None:
        found = find_scores(scores_root, fingerprint=fingerprint, kind=IL_KIND, split=split,
                            config=key, length=len(train_labels))
        if found is not None:
            return Scores(found.values, found.fingerprint, found.kind, found.split, found.config,
                          found.config_hash, found.created, found.path,
                          {**found.extra, "reused": True})
    values, extra, _ = fit_and_score(config, holdout_images, holdout_labels, train_images, train_labels,
                                     num_classes, split, device)
    if scores_root is None:
        return Scores(values, fingerprint, IL_KIND, split, key, "", "", "", {**extra, "reused": False})
    s = save_scores(scores_root, values, fingerprint=fingerprint, kind=IL_KIND, split=split,
                    config=key, extra=extra)
    return Scores(s.values, s.fingerprint, s.kind, s.split, s.config, s.config_hash, s.created,
                  s.path, {**extra, "reused": False})


def score_key(config: ILModelConfig, num_classes: int) -> dict:
    """The scores' config key for a resolved ``config``."""
    return {**_key(config), "num_classes": num_classes}


def check_inputs(holdout_images, holdout_labels, train_images, train_labels, split: str,
                 num_classes: int | None) -> int:
    """Raise SelectionError unless both splits are non-empty and aligned; the class count (the
    largest label + 1 when not given)."""
    n_hold, n_train = len(holdout_labels), len(train_labels)
    if n_hold == 0:
        raise SelectionError("the holdout split is empty: RHO-LOSS needs held-out samples to "
                             "train the irreducible-loss model (set ingest holdout_fraction > 0)")
    if n_train == 0:
        raise SelectionError(f"split {split!r} is empty: nothing to score")
    if len(holdout_images) != n_hold or len(train_images) != n_train:
        raise SelectionError(f"images/labels length mismatch: holdout {len(holdout_images)}/"
                             f"{n_hold}, {split} {len(train_images)}/{n_train}")
    if num_classes is None:
        num_classes = int(max(np.max(np.asarray(holdout_labels)), np.max(np.asarray(train_labels)))) + 1
    return num_classes


Scorer = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], tuple[np.ndarray, float]]


def fit_and_score(config: ILModelConfig, holdout_images, holdout_labels, train_images, train_labels,
                  num_classes: int, split: str = "train", device: str | torch.device = "cpu",
                  score: Scorer | None = None) -> tuple[np.ndarray, dict, torch.nn.Module]:
    """Train the IL model on the holdout and score every ``split`` sample: the values, the cost
    and sanity figures (``extra``), and the model (``config`` resolved). ``score(model, images,
    labels)``: where the scoring pass runs (``il_parts.scorer``: on the engine), else here."""
    hx = to_float_images(holdout_images, config)
    hy = _check_labels(holdout_labels, len(holdout_labels), num_classes, "holdout")
    tx = to_float_images(train_images, config)
    ty = _check_labels(train_labels, len(train_labels), num_classes, split)
    t0 = time.perf_counter()
    model = train_il_model(config, hx, hy, num_classes, device)
    t1 = time.perf_counter()
    values, scored_acc = score(model, tx, ty) if score is not None else \
        _score(model, tx, ty, config.score_batch_size, device, config)
    t2 = time.perf_counter()
    # holdout_accuracy is on the IL model's own training data (a sanity figure, and what
    # label_noise="auto" reads); scored_accuracy is on the split it scores, which it never saw.
    extra = {"train_seconds": round(t1 - t0, 3), "score_seconds": round(t2 - t1, 3),
             "holdout_size": len(hy), "holdout_accuracy": _accuracy(model, hx, hy, config, device),
             "scored_split": split, "scored_accuracy": scored_acc}
    return values, extra, model


def score_with(model: torch.nn.Module, config: ILModelConfig, images, labels, num_classes: int,
               split: str = "train", device: str | torch.device = "cpu",
               score: Scorer | None = None) -> tuple[np.ndarray, float]:
    """A trained IL model's loss on each of ``images`` (and its accuracy on them)."""
    x = to_float_images(images, config)
    y = _check_labels(labels, len(labels), num_classes, split)
    return score(model, x, y) if score is not None else _score(model, x, y, config.score_batch_size, device, config)


@torch.no_grad()
def _accuracy(model, x, y, config: ILModelConfig, device) -> float:
    """Training accuracy on the holdout (a sanity figure: near 0 or 1/num_classes means trouble)."""
    hits = 0
    for s in range(0, len(x), config.score_batch_size):
        with _amp(config, device):
            pred = model(channels_last(x[s:s + config.score_batch_size].to(device))).argmax(1)
        hits += int((pred.cpu() == y[s:s + config.score_batch_size]).sum())
    return round(hits / max(1, len(x)), 4)
