"""The IL model's scoring pass (batch inference over every train sample) as parts that run in
any process: this one, or a Ray worker with ``engine: ray`` (``stages/data/engine.py``), on a
GPU where the cluster has them. A part is a run of whole scoring batches, so each batch is the
one a single process scores; the model travels as its weights (``torch.save`` tensors, loaded
``weights_only``), rebuilt once per process."""
from __future__ import annotations

import hashlib

import numpy as np
import torch

from sluice.stages.data.engine import Parts, kept
from sluice.stages.select.config import ILModelConfig
from sluice.stages.select.il_model import Scorer, score_hits
from sluice.stages.select.il_store import model_bytes, rebuild_model

PART_BATCHES = 16  # scoring batches a part, at most


def score_part(part: tuple[bytes, str, int, int, torch.Tensor, torch.Tensor]) -> tuple[np.ndarray, int]:
    """(weights, the resolved IL config's JSON, in_channels, num_classes, images, labels) ->
    (each image's loss, how many it got right); on this process's GPU when it has one."""
    weights, config_json, in_channels, num_classes, images, labels = part
    cfg = ILModelConfig.model_validate_json(config_json)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    model = kept("il-model", (hashlib.sha256(weights).hexdigest(), config_json, device),
                 lambda: rebuild_model(cfg, in_channels, num_classes, weights, device))
    return score_hits(model, images, labels, cfg.score_batch_size, device, cfg)


def scorer(parts: Parts, config: ILModelConfig, num_classes: int) -> Scorer:
    """A scoring pass that runs in ``parts`` (``config`` resolved): the values in order and the
    accuracy, as ``il_model`` computes them in one process."""
    def score(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> tuple[np.ndarray, float]:
        weights = model_bytes(model)
        in_channels = int(images.shape[1])
        per = PART_BATCHES * config.score_batch_size
        todo = ((weights, config.model_dump_json(), in_channels, num_classes, images[s:s + per], labels[s:s + per])
                for s in range(0, len(images), per))
        values, hits = [], 0
        for v, h in parts.ordered(score_part, todo, gpus=1 if parts.has_gpus() else 0):
            values.append(v)
            hits += h
        out = np.concatenate(values) if values else np.zeros(0, np.float32)
        return out, round(hits / max(1, len(images)), 4)
    return score

