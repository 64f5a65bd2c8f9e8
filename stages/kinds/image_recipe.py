"""What the image kind fills in from the data where the train config says ``auto``: the side
images are trained and evaluated at (``train.input_size``), the model (``train.model``) and the
normalisation (``train.normalize_mean``/``normalize_std``), each with the reason ``sluice config
show`` prints.

The facts come from the night's artifacts (``ImageVersion.stats``: the train split's per-channel
mean and std and its size summary, recorded when it was sharded; ``stages/data/stats.py``):

* **input size**: images that are all one size no larger than the host's side (``HOST_SIDE``)
  are trained as stored (Fashion-MNIST: 28 px, no resize at all); anything else at the median
  short side, capped at the host's side. A CPU trains small images: 32 px is where the photo
  benchmark (``benchmarks/photos.py``) met its accuracy goal in its time budget. The CUDA side
  (64 px) was chosen without a GPU to measure it on, and says so wherever it shows.
* **resizing**: a size other than the stored one trains on ``random_resized_crop`` (scale
  ``CROP_SCALE``), then the section's own ops (flip), and evaluates on the whole image resized to
  the square (``center_crop`` in ``squash`` mode: ``augment.eval_resize``).
* **model**: ``bn_cnn`` up to ``SMALL_MODEL_UP_TO`` px (the small BN CNN), ``resnet_small`` above.
* **normalisation**: the train split's per-channel mean and std, to three decimals (Fashion-MNIST
  gives 0.286 and 0.353, the values the recipe hard-coded before).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sluice.errors import ConfigError
from sluice.stages.load.augment import AugmentOp, RandomResizedCrop
from sluice.stages.train.config import TrainConfig
from sluice.storage.manifest import ImageStats

HOST_SIDE = {"cpu": 32, "cuda": 64}
# chosen by a recorded sweep of the plain photo loop over the crop's lower bound (`python -m
# benchmarks.photos --sweep`, docs/results.md): photos framed to their object lose it to small crops
CROP_SCALE = (0.85, 1.0)
SMALL_MODEL_UP_TO = 32  # px: bn_cnn at or below, resnet_small above


@dataclass
class ImageRecipe:
    """The train config's ``auto`` settings resolved for one night's images, and why."""
    updates: dict[str, Any]  # train config fields -> resolved values
    notes: list[str] = field(default_factory=list)  # one line a resolved setting


def resolve(train: TrainConfig, stats: ImageStats | None, shape: tuple[int, int] | None,
            device: str) -> ImageRecipe:
    """``train``'s ``auto`` settings for images whose train split ``stats`` describes (all of
    size ``shape`` (h, w), or None where sizes vary), trained on ``device`` (cpu or cuda)."""
    out = ImageRecipe(updates={})
    side = train.input_size
    if side == "auto":
        side = _side(stats, shape, device, out.notes)
    elif side is not None and shape == (side, side):
        side = None  # already that size: nothing to resize
    out.updates["input_size"] = side
    at = side or (max(shape) if shape else None)
    if train.model == "auto":
        small = at is not None and at <= SMALL_MODEL_UP_TO
        model = "bn_cnn" if small else "resnet_small"
        out.updates["model"] = model
        out.notes.append(f"train.model: auto -> {model} ({at} px, "
                         + (f"at most {SMALL_MODEL_UP_TO}: the small BN CNN)" if small
                            else f"above {SMALL_MODEL_UP_TO}: the small ResNet)"))
    if "auto" in (train.normalize_mean, train.normalize_std):
        if stats is None:
            raise ConfigError("train.normalize_mean/std: auto takes the train split's statistics, and this "
                              "version has none (an empty train split?); give the values")
        for name, values, floor in (("normalize_mean", stats.mean, 0.0), ("normalize_std", stats.std, 1e-3)):
            if getattr(train, name) == "auto":
                out.updates[name] = [max(round(v, 3), floor) for v in values]
        out.notes.append(f"train.normalize_mean/std: auto -> {out.updates.get('normalize_mean', train.normalize_mean)}"
                         f" / {out.updates.get('normalize_std', train.normalize_std)} (the train split's "
                         f"{stats.samples:,} images, per channel)")
    return out


def train_ops(ops: list[AugmentOp], side: int | None) -> list[AugmentOp]:
    """The training augmentation for images resized to ``side`` (None: as stored): the section's
    ops after a random resized crop to that side, unless they start with an op that makes one
    size already (then given the side where it has none)."""
    if side is None:
        return list(ops)
    if ops and ops[0].makes_one_size:
        first = ops[0] if getattr(ops[0], "size", None) else ops[0].model_copy(update={"size": side})
        return [first, *ops[1:]]
    return [RandomResizedCrop(size=side, scale=CROP_SCALE), *ops]


def _side(stats: ImageStats | None, shape: tuple[int, int] | None, device: str, notes: list[str]) -> int | None:
    """``auto``'s side (None: as stored), with a note saying why."""
    host = "cuda" if device == "cuda" else "cpu"
    cap = HOST_SIDE[host]
    unmeasured = " (chosen without a GPU to measure it on)" if host == "cuda" else ""
    if shape is not None and max(shape) <= cap:
        notes.append(f"train.input_size: auto -> as stored ({shape[0]}x{shape[1]} px: one size, at most the "
                     f"{cap} px a {host.upper()} trains at{unmeasured})")
        return None
    if stats is None:
        notes.append(f"train.input_size: auto -> {cap} (no size summary; the {host.upper()}'s side{unmeasured})")
        return cap
    median = int(stats.sizes.short_side.median)
    side = max(min(median, cap), 1)
    sizes = "sizes vary" if shape is None else f"all {shape[0]}x{shape[1]} px"
    notes.append(f"train.input_size: auto -> {side} ({sizes}, median short side {median} px, at most {cap} px on a "
                 f"{host.upper()}{unmeasured}): random resized crops to train, the whole image resized to evaluate")
    return side
