"""Recipes: the pipeline's defaults in one YAML file each (``flows/recipes/<name>.yaml``).

A pipeline config is built in layers, each deep-merged over the one before: the stage configs'
own neutral defaults, then the recipe the config names (``recipe: default`` unless given), then
the user's config file, then ``--set`` overrides. A recipe may ``extends:`` another. Two values
may be ``auto`` in any layer and are resolved here, once, where the config is built:
``train.batch_size`` (the per-rank batch measured best for the host class),
``train.log_every_steps`` (1 on CPUs; 50 on CUDA, where reading a step's metrics waits for
the device) and
``data.ingest.holdout_fraction`` (0.1 when the selection method trains an irreducible-loss
model on a holdout, else 0). ``sluice config show`` prints the result.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from sluice.errors import ConfigError
from sluice.flows.config import merge
from sluice.stages.host import defaults_for

RECIPES_DIR = Path(__file__).resolve().parent / "recipes"
_NAME = re.compile(r"^[A-Za-z0-9_-]+$")
# replaced whole, never merged key by key: another model's keyword arguments do not mix
LEAVES = ("model_kwargs",)
# (section, the key naming an entry, what belongs to that entry): a layer naming another entry
# without giving its own drops the layer below's, which were meant for the entry it replaces
_ENTRY_KEYS = (("train", "model", "model_kwargs"), ("selection.il", "architecture", "model_kwargs"),
               ("selection", "method", "params"), ("train.comm", "mode", "params"))


def available() -> list[str]:
    """The recipes shipped with Sluice, by name."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def load_recipe(name: str = "default", _seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """The recipe ``name`` with what it extends merged under it (a plain dict, unvalidated)."""
    if not _NAME.match(name or ""):
        raise ConfigError(f"recipe {name!r}: a recipe is named by letters, digits, '-' and '_' "
                          f"(one of: {', '.join(available())})")
    path = RECIPES_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown recipe {name!r}; the recipes are: {', '.join(available())}")
    if name in _seen:
        raise ConfigError(f"recipe {name!r} extends itself (through {' -> '.join(_seen)})")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping")
    parent = data.pop("extends", None)
    return overlay(load_recipe(parent, (*_seen, name)), data) if parent else data


def overlay(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` deep-merged over ``base``: model_kwargs replaced whole, a layer naming another
    model, selection method or compression hook without its knobs drops the lower layer's, and a
    layer naming another kind of data replaces the lower layer's data section whole (its shape is
    the kind's)."""
    base = _drop_stale_entry_knobs(base, top)
    kind = _at(top, "data.kind")
    if kind is not None and kind != _at(base, "data.kind"):
        base = {k: v for k, v in base.items() if k != "data"}
    return merge(base, top, leaves=LEAVES)


def _drop_stale_entry_knobs(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = base
    for section, key, knobs in _ENTRY_KEYS:
        b, t = _at(base, section), _at(top, section)
        if isinstance(t, dict) and isinstance(b, dict) and key in t and knobs not in t \
                and t[key] != b.get(key) and b.get(knobs):
            out = _with(out, section, {k: v for k, v in b.items() if k != knobs})
    return out


def _at(d: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def _with(d: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    head, _, rest = dotted.partition(".")
    out = dict(d)
    out[head] = _with(out.get(head) or {}, rest, value) if rest else value
    return out


def resolve_auto(data: dict[str, Any], *, needs_il: bool, wants_cuda: bool) -> dict[str, Any]:
    """The config with its ``auto`` batch size, log interval and holdout share replaced by what they mean here."""
    out = data
    host = defaults_for("cuda" if wants_cuda else "cpu")
    if _at(out, "train.batch_size") == "auto":
        out = _with(out, "train.batch_size", host.batch_per_rank)
    if _at(out, "train.log_every_steps") == "auto":
        out = _with(out, "train.log_every_steps", host.log_every_steps)
    if _at(out, "data.ingest.holdout_fraction") == "auto":
        out = _with(out, "data.ingest.holdout_fraction", 0.1 if needs_il else 0.0)
    return out
