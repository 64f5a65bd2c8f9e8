"""Augmentation as data: ``AugmentSpec`` (an ordered list of registered ops), executed as batched
torch ops on the device (``TorchAugment``) or as DALI operators (the ``dali`` backend), with the
same random parameters on both (``draw_params``, seeded per batch by ``batch_seed``).

Ops, one file each: ``random_resized_crop`` (crop), ``center_crop`` (center), ``flip``,
``translate``, ``cutout``, ``brightness_contrast`` (color), ``normalize``. Add one: a new file
registering an ``AugmentOp`` subclass with ``@AUGMENT_OPS.register(name)``, plus one import line
below.
"""
from sluice.stages.load.augment import center, color, crop, cutout, flip, normalize, translate  # noqa: F401
from sluice.stages.load.augment.base import AUGMENT_OPS, AugmentOp, batch_seed
from sluice.stages.load.augment.center import CenterCrop, center_boxes, eval_resize
from sluice.stages.load.augment.color import BrightnessContrast
from sluice.stages.load.augment.crop import RandomResizedCrop, crop_resize, rrc_boxes
from sluice.stages.load.augment.cutout import Cutout
from sluice.stages.load.augment.flip import Flip
from sluice.stages.load.augment.normalize import Normalize
from sluice.stages.load.augment.spec import AugmentSpec, draw_params
from sluice.stages.load.augment.torch_path import TorchAugment
from sluice.stages.load.augment.translate import Translate

__all__ = ["AUGMENT_OPS", "AugmentOp", "AugmentSpec", "TorchAugment", "batch_seed", "draw_params",
           "RandomResizedCrop", "CenterCrop", "Flip", "Translate", "Cutout", "BrightnessContrast",
           "Normalize", "rrc_boxes", "crop_resize", "center_boxes", "eval_resize"]
