"""The optimizer over a model's parameters, shared by the IL model (``select``) and the training
loop (``train``) so the two never drift."""
from __future__ import annotations

from typing import Literal

import torch

from sluice.errors import ConfigError

OptimizerName = Literal["sgd", "adam", "adamw"]


def build_optimizer(name: str, model: torch.nn.Module, lr: float, *, momentum: float = 0.9,
                    weight_decay: float = 0.0, nesterov: bool = True,
                    betas: tuple[float, float] = (0.9, 0.999)) -> torch.optim.Optimizer:
    """``name`` over ``model``'s trainable parameters, with no weight decay on norms and biases
    (every parameter of at most one dimension), which only shrinks them toward zero. ``betas``
    are Adam's (a language model's recipe wants a shorter memory of the squared gradient than
    torch's default 0.999); SGD ignores them."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0)
    if name in ("adam", "adamw"):
        return (torch.optim.AdamW if name == "adamw" else torch.optim.Adam)(groups, lr=lr, betas=tuple(betas))
    raise ConfigError(f"unknown optimizer {name!r}; use sgd, adam or adamw")
