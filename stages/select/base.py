"""The selection-method registry, the base selector, and the pieces every method shares.

The hook: ``selector(model, images, labels, indices) -> SelectedBatch`` (``contracts.Selector``).
Images are on the model's device, float, normalised; labels int64; indices int64 = the stable
index within the split (IL scores and noise masks are aligned to it). A method that
``picks_subset`` returns exactly ``n_select`` samples per call, so DDP ranks do equal work;
each rank selects from its own candidates.

Add a method: a new file with a ``BaseSelector`` subclass registered by
``@SELECTION_METHODS.register(name)``, plus one import line in ``select/__init__.py`` (outside
Sluice: the same decorator in your module, or an entry point in group
``sluice.selection_methods`` for the training workers); then ``selection.method: name``.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, field_validator

from sluice.errors import SelectionError
from sluice.plugins import EntryParams, PluginRegistry
from sluice.stages.contracts import SelectedBatch, SelectionStats, SelectorHooks

if TYPE_CHECKING:  # the config module imports this registry; no runtime cycle
    from sluice.stages.select.config import SelectionConfig
    from sluice.storage.scores import Scores

SELECTION_METHODS: PluginRegistry[type["BaseSelector"]] = PluginRegistry(
    "selection_methods", "selection method")
# A method's form for packed token rows, by method name (``infobatch``: ``infobatch_tokens``),
# registered beside the form's code; a method without one refuses token rows, saying why.
ROW_FORMS: dict[str, Callable[["BaseSelector"], "BaseSelector"]] = {}


class MethodParams(EntryParams):
    """A selection method's own knobs (``selection.params``); the base has none."""


class ScoringParams(MethodParams):
    """Knobs of the methods that score candidates with a no-grad forward pass."""
    score_mode: Literal["train", "eval"] = Field(
        "train", description="mode of the no-grad scoring pass (the paper scores in train mode)")
    score_chunk: int | None = Field(
        None, ge=1, description="score the candidates this many at a time: on CPU a no-grad pass "
        "over 64 samples costs ~25% less per sample than one over 384 (cache-sized activations); "
        "in train mode each chunk gets its own BatchNorm batch statistics. None = one pass")
    label_noise: float | Literal["auto"] = Field(
        0.0, description="score the candidates' loss under a uniform label-noise likelihood "
        "(1-a) p + a/K, as the IL model trained on noisy labels implicitly does: a target trained "
        "on filtered data otherwise grows more confident than the IL model and mislabelled "
        "samples win rho_loss's top-k. Rank-preserving for loss/selective_backprop. 'auto': a = "
        "1 - the IL model's accuracy on its holdout (from the IL scores record). 0 = plain CE")

    @field_validator("label_noise")
    @classmethod
    def _rate(cls, v: float | str) -> float | str:
        if v != "auto" and not 0 <= v < 1:
            raise ValueError("label_noise must be 'auto' or a rate in [0, 1)")
        return v


@dataclasses.dataclass
class SelectorContext:
    """What ``build_selector`` checked and prepared for a method: n_b, the split size, and the
    per-sample tables (IL scores, known-noise mask) aligned to split indices."""
    n_select: int | None = None
    split_size: int | None = None
    il: torch.Tensor | None = None
    noise: torch.Tensor | None = None
    device: torch.device | str | None = None
    sampler: object | None = None  # importance: a prepared ImportanceSampler
    # a per-sample table carried from an earlier run (InfoBatch: "loss", "seen"), split-aligned
    carried: dict[str, torch.Tensor] | None = None


class BaseSelector(SelectorHooks):
    """Shared state and helpers: n_b, the IL scores and noise mask, RNG, statistics."""
    picks_subset: ClassVar[bool] = True   # trains n_b of the n_B candidates (ratio applies)
    needs_il: ClassVar[bool] = False      # refuses to build without irreducible-loss scores
    carries_table: ClassVar[bool] = False  # starts from SelectorContext.carried when given
    token_rows: ClassVar[bool] = False    # selects packed token rows (``for_token_rows``)
    Params: ClassVar[type[MethodParams]] = MethodParams  # this method's knobs (selection.params)

    def __init__(self, config: "SelectionConfig", ctx: SelectorContext):
        self.config = config
        self.params = config.method_params
        self.n_select = ctx.n_select
        self._il = ctx.il
        self._noise = ctx.noise
        self.generator = torch.Generator().manual_seed(config.seed)

    @classmethod
    def build(cls, config: "SelectionConfig", ctx: SelectorContext) -> "BaseSelector":
        """The selector for ``config`` (override to check or prepare more)."""
        return cls(config, ctx)

    @classmethod
    def resolve_auto(cls, config: "SelectionConfig",
                     il_scores: "np.ndarray | Scores | None") -> "SelectionConfig":
        """``config`` with this method's ``auto`` knobs given values, from what the selector is
        built with (default: none to resolve)."""
        return config

    @classmethod
    def for_training_stage(cls, config: "SelectionConfig") -> "SelectionConfig":
        """The config this method runs with inside the training stage, whose loader hands it
        uniform candidate batches (importance sampling redraws from them)."""
        return config

    def __call__(self, model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor,
                 indices: torch.Tensor) -> SelectedBatch:
        raise NotImplementedError

    def for_token_rows(self) -> "BaseSelector":
        """This method's selector for packed token rows (the language-model task asks before
        training: its indices are each token's document, ``doc_keys`` (B, L), and it observes
        per-token losses): its registered row form (``ROW_FORMS``), or a refusal saying why
        (``token_rows_refusal``)."""
        form = ROW_FORMS.get(self.config.method) if self.token_rows else None
        if form is None:
            raise SelectionError(token_rows_refusal(self.config.method)
                                 or f"{self.config.method} registers no form for token rows (ROW_FORMS)")
        return form(self)

    def _n(self, n_candidates: int) -> int:
        n = self.config.n_select_for(n_candidates)
        if self.n_select is not None and n != self.n_select:
            raise SelectionError(f"candidate batch of {n_candidates} gives n_b = {n}, but this "
                                 f"selector was built for n_b = {self.n_select}; every step "
                                 "(and rank) must train the same count")
        return n

    def _lookup(self, table: torch.Tensor | None, indices: torch.Tensor) -> torch.Tensor | None:
        if table is None:
            return None
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= table.numel()):
            raise SelectionError(f"sample index {int(indices.max())} outside the scored split of "
                                 f"{table.numel()} samples: scores and loader disagree")
        if table.device != indices.device:  # move both tables once, to the batch's device
            self._il = None if self._il is None else self._il.to(indices.device)
            self._noise = None if self._noise is None else self._noise.to(indices.device)
            table = table.to(indices.device)
        return table[indices]

    def _stats(self, indices: torch.Tensor, pos: torch.Tensor,
               loss: torch.Tensor | None) -> SelectionStats:
        """Selected-vs-candidate statistics: counts as floats, means as float32 device tensors
        (unread: the training loop reads them with its metrics record)."""
        stats = SelectionStats({"n_candidates": float(indices.numel()), "n_selected": float(pos.numel())})
        il = self._lookup(self._il, indices)
        noise = self._lookup(self._noise, indices)
        series = {"loss": loss, "il": il,
                  "reducible": (loss - il) if loss is not None and il is not None else None}
        for name, t in series.items():
            if t is not None:
                stats[f"cand_{name}_mean"] = t.detach().float().mean()
                stats[f"sel_{name}_mean"] = t.detach()[pos].float().mean()
        if noise is not None:
            stats["cand_noisy"], stats["sel_noisy"] = noise.float().sum(), noise[pos].float().sum()
        return stats

    def observe(self, indices: torch.Tensor, losses: torch.Tensor) -> None:
        """Per-sample losses of the trained samples after the step (default: ignored)."""

    def state_dict(self) -> dict:
        """What a resumed run needs to select as the uninterrupted one would (tensors and plain
        values only: checkpoints load with ``weights_only=True``)."""
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


def token_rows_refusal(method: str) -> str | None:
    """Why selection method ``method`` cannot select packed token rows (None: it can). A packed
    row is no stable sample: the token loader re-packs the stream every epoch, so a row's index
    names other tokens each epoch; only a method keying its table by document can follow it."""
    if method == "none":
        return None
    cls = SELECTION_METHODS.get(method)
    if cls.token_rows:
        return None
    why = ("it needs irreducible-loss scores per sample, from an IL model trained on a holdout of images"
           if cls.needs_il else
           "it scores or draws candidates as whole samples by their split index (a scoring pass with one "
           "label per sample, or a per-sample table), and a packed token row is no stable sample: the "
           "token loader re-packs every epoch")
    return (f"selection method {method!r} cannot select packed token rows: {why}. On a language model "
            "use infobatch (its table is keyed by document) or none")


# ---------------------------------------------------------------- scoring and checks

def select_top(scores: torch.Tensor, n: int) -> torch.Tensor:
    """Positions of the ``n`` highest scores (exactly ``n``; NaN/inf refused)."""
    check_finite(scores, "selection scores")
    if not 1 <= n <= scores.numel():
        raise SelectionError(f"cannot select {n} of {scores.numel()} candidates")
    return torch.topk(scores, n, sorted=False).indices


def check_finite(t: torch.Tensor, what: str, indices: torch.Tensor | None = None) -> None:
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        where = (indices if indices is not None else torch.arange(t.numel(), device=t.device))[bad]
        raise SelectionError(f"{what}: {int(bad.sum())} NaN/inf values (sample indices "
                             f"{where[:5].tolist()}); check the learning rate and the inputs")


def check_indices(idx: torch.Tensor, n: int) -> torch.Tensor:
    """``idx`` (CPU) when every index lies in a split of ``n`` samples, else a clear error."""
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise SelectionError(f"sample index {int(idx.max())} outside the split of {n} samples")
    return idx


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP/compile wrappers, so scoring triggers no collective."""
    return getattr(model, "module", None) or getattr(model, "_orig_mod", None) or model


@torch.no_grad()
def candidate_losses(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor,
                     mode: str = "train", chunk: int | None = None,
                     label_noise: float = 0.0) -> torch.Tensor:
    """Per-sample training loss of the candidates from a no-grad forward pass (in chunks of
    ``chunk`` samples when given), under a uniform label-noise rate ``label_noise``."""
    m = _unwrap(model)
    was_training = m.training
    m.train(mode == "train")
    try:
        parts = images.split(chunk) if chunk else (images,)
        logits = torch.cat([m(part).float() for part in parts])
    finally:
        m.train(was_training)
    if not label_noise:
        return F.cross_entropy(logits, labels, reduction="none")
    p = logits.softmax(1).gather(1, labels.unsqueeze(1)).squeeze(1)
    return -torch.log((1 - label_noise) * p + label_noise / logits.shape[1])


def as_table(values, what: str, length: int | None, dtype=torch.float32,
             device: str | torch.device | None = None) -> torch.Tensor | None:
    """A per-sample array as a 1-D tensor, its length and finiteness checked."""
    if values is None:
        return None
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise SelectionError(f"{what} must be 1-D, one value per sample; got shape {arr.shape}")
    if length is not None and arr.shape[0] != length:
        raise SelectionError(f"{what} has {arr.shape[0]} values but the split has {length} samples")
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise SelectionError(f"{what} contains NaN/inf (first at index "
                             f"{int(np.flatnonzero(~np.isfinite(arr))[0])})")
    return torch.as_tensor(arr.astype(np.float32 if dtype == torch.float32 else bool),
                           device=device)
