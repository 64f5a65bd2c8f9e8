"""Models, by name (``train.model``, ``selection.il.architecture``): one file per built-in.

Add one: a new file that registers a factory with ``@MODELS.register("name")``, plus one import
line below (or, outside Sluice, an entry point in group ``sluice.models``).
"""
from sluice.stages.models.base import MODELS, build_model, min_input_size, model_task
from sluice.stages.models import bn_cnn, gpt, resnet_small, small_cnn  # noqa: F401  (each registers itself)
from sluice.stages.models.bn_cnn import BNCNN
from sluice.stages.models.gpt import GPT
from sluice.stages.models.resnet_small import ResNetSmall
from sluice.stages.models.small_cnn import SmallCNN

__all__ = ["MODELS", "build_model", "min_input_size", "model_task", "BNCNN", "GPT", "SmallCNN", "ResNetSmall"]
