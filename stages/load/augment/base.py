"""The augmentation-op registry and what every op carries: its config, its random draws, and
its two halves — batched torch ops and DALI operators.

An op's ``draw`` is the *one* place its randomness comes from. ``draw_params`` runs every op's
draw in order from one generator seeded by ``batch_seed(seed, epoch, batch)``, before any pixel
is touched, and every backend applies those same parameters: so batch b of epoch e is augmented
identically whichever backend loads it, and a resumed run repeats it exactly.

Add an op: a new file with an ``AugmentOp`` subclass (a pydantic model with ``op: Literal[name]``)
registered by ``@AUGMENT_OPS.register(name)``, implementing ``draw``, ``apply_torch`` and, for
the DALI backend, ``dali_inputs``/``apply_dali``; plus one import line in ``augment/__init__.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from sluice.plugins import PluginRegistry

AUGMENT_OPS: PluginRegistry[type["AugmentOp"]] = PluginRegistry("augment_ops", "augmentation op")
Params = dict[str, torch.Tensor]


def batch_seed(seed: int, epoch: int, batch: int) -> int:
    """The torch seed of batch ``batch``'s augmentation draws in ``epoch`` (every backend)."""
    ss = np.random.SeedSequence([int(seed), int(epoch), int(batch)])
    return int(ss.generate_state(1, np.uint64)[0] >> np.uint64(1))


@dataclass
class TorchContext:
    """What the torch halves share while one batch is augmented."""
    resolution: int | None = None
    owned: bool = True      # x may be modified in place (it is not the caller's tensor)
    resized: bool = False   # an op produced the output size (no final resize)
    scaled: bool = False    # an op already mapped 0..255 to its final range (normalize)
    sizes: torch.Tensor | None = None  # (N, 2): x is a zero-padded canvas of images of these sizes


@dataclass
class DaliContext:
    """What the DALI halves share while the pipeline is built."""
    gpu: bool
    channels: int
    extra: dict[str, Any] = field(default_factory=dict)


class AugmentOp(BaseModel):
    """One augmentation op. Images reach ``apply_torch`` as float NCHW in 0..255 (until an op
    sets ``ctx.scaled``), and ``apply_dali`` as HWC DALI data nodes."""
    model_config = ConfigDict(extra="forbid")
    op: str

    # DALI: (name, dtype) of each per-sample input this op feeds through the external source,
    # dtype one of "uint8", "int32", "int64", "float"
    dali_input_types: ClassVar[tuple[tuple[str, str], ...]] = ()
    finishes_dali: ClassVar[bool] = False  # the DALI half also does the final CHW float conversion
    needs_sizes: ClassVar[bool] = False  # ``draw`` reads each image's size (variable-size data)
    # every output has one size (the op's ``size`` or the epoch's resolution) whatever the input's:
    # such an op, leading, lets images of different sizes (a zero-padded canvas) become one batch
    makes_one_size: ClassVar[bool] = False

    def draw(self, n: int, hs: np.ndarray, ws: np.ndarray, resolution: int | None,
             gen: torch.Generator) -> Params:
        """This op's random parameters for ``n`` images of sizes ``hs``×``ws`` (no draws by default)."""
        return {}

    def output_sizes(self, hs: np.ndarray, ws: np.ndarray,
                     resolution: int | None) -> tuple[np.ndarray, np.ndarray]:
        return hs, ws

    def check_channels(self, channels: int) -> None:
        """Refuse (ConfigError) before the first batch what cannot fit ``channels``-channel data."""

    def fuses_with(self, following: "AugmentOp") -> bool:
        """True when ``apply_torch`` can also apply the next op (given its params) in one pass."""
        return False

    def apply_torch(self, x: torch.Tensor, params: Params, ctx: TorchContext,
                    fused: Params | None = None) -> torch.Tensor:
        raise NotImplementedError

    def dali_inputs(self, params: Params, n: int) -> list[np.ndarray]:
        """The per-sample arrays for ``dali_input_types``, from this batch's params."""
        return []

    def apply_dali(self, x: Any, inputs: list[Any], ctx: DaliContext) -> Any:
        raise NotImplementedError(f"op {self.op!r} has no DALI half")


def one_size_ops() -> list[str]:
    """The known ops that make images of any size one size (for error messages)."""
    out = []
    for name in AUGMENT_OPS.names():
        try:
            if getattr(AUGMENT_OPS.get(name), "makes_one_size", False):
                out.append(name)
        except Exception:  # a broken plugin must not hide the error being reported
            continue
    return out


def same_size(hs: np.ndarray, ws: np.ndarray) -> bool:
    return bool((hs == hs[0]).all() and (ws == ws[0]).all())
