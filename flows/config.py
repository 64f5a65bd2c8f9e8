"""Load a stage or pipeline config from YAML/JSON plus ``--set a.b=value`` overrides.

Validation errors name the dotted path of the bad field, before anything runs.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from sluice.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


def read_config_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p} must hold a mapping at the top level, not {type(data).__name__}")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set ``a.b.c=value`` entries; values are parsed as YAML (numbers, lists, booleans)."""
    out = json.loads(json.dumps(data))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {key}: {part!r} is not a section")
            node = nxt
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    return out


def validate(model: type[M], data: dict[str, Any], origin: str = "config") -> M:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            path = ".".join(str(p) for p in err["loc"]) or "(top level)"
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                msg = "unknown key"
            problems.append(f"  {path}: {msg}" + (f" (got {err['input']!r})" if err["type"] != "extra_forbidden"
                                                  and not isinstance(err.get("input"), dict) else ""))
        raise ConfigError(f"invalid {origin}:\n" + "\n".join(problems)) from None


def load_config(model: type[M], path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict[str, Any] | None = None) -> M:
    data = dict(base or {})
    if path:
        data = merge(data, read_config_file(path))
    data = apply_overrides(data, overrides or [])
    return validate(model, data, origin=str(path) if path else "config")


def merge(a: dict[str, Any], b: dict[str, Any], leaves: tuple[str, ...] = ()) -> dict[str, Any]:
    """``b`` deep-merged over ``a``; keys in ``leaves`` (and non-dicts) are replaced whole."""
    out = dict(a)
    for k, v in b.items():
        nested = k not in leaves and isinstance(v, dict) and isinstance(out.get(k), dict)
        out[k] = merge(out[k], v, leaves) if nested else v
    return out
