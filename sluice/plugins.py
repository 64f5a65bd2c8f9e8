"""Registries of pluggable parts: one per axis of variation, each a name → implementation map.

Sluice's axes are sources, loader backends, augmentation ops, selection methods, compression
hooks and models. A built-in entry is one file that registers itself with its axis's decorator,
plus one import line in its package's ``__init__``. Code outside Sluice extends an axis the same
way, in either of two explicit forms:

* in-process: ``@SELECTION_METHODS.register("mine")`` in the user's own module, imported by the
  user's own script (a plain training loop, a notebook);
* for the processes Sluice starts itself (the torchrun training workers, Prefect workers): an
  entry point of the installed package, in group ``sluice.<axis>``::

      [project.entry-points."sluice.selection_methods"]
      mine = "mypkg.selection:MySelector"

Configs name entries, never import paths: an unknown name fails when the config is validated,
before anything runs, and no process ever imports code named by a config string (a Prefect API
caller can choose among registered names only).
"""
from __future__ import annotations

import threading
from importlib import metadata
from typing import Callable, Generic, Iterator, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from sluice.errors import ConfigError

T = TypeVar("T")
ENTRY_POINT_PREFIX = "sluice."


class PluginRegistry(Generic[T]):
    """Names → implementations for one axis (``axis`` is also the entry-point group suffix)."""

    def __init__(self, axis: str, what: str):
        self.axis, self.what = axis, what
        self._entries: dict[str, T] = {}
        self._lock = threading.Lock()

    @property
    def group(self) -> str:
        return ENTRY_POINT_PREFIX + self.axis

    def register(self, name: str, *, replace: bool = False) -> Callable[[T], T]:
        """Decorator: ``@REGISTRY.register("name")`` on a class or function."""
        if not name or not name.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"a {self.what} name must be letters, digits, '_' or '-'; got {name!r}")

        def deco(obj: T) -> T:
            with self._lock:
                if name in self._entries and self._entries[name] is not obj and not replace:
                    raise ConfigError(f"{self.what} {name!r} is already registered "
                                      f"({self._entries[name]!r}); pass replace=True to override")
                self._entries[name] = obj
            return obj
        return deco

    def get(self, name: str) -> T:
        """The entry called ``name``, loading it from an installed entry point if needed."""
        entry = self._entries.get(name)
        if entry is not None:
            return entry
        for ep in self._entry_points():
            if ep.name == name:
                self.register(name)(ep.load())
                return self._entries[name]
        raise ConfigError(f"unknown {self.what} {name!r}; known: {', '.join(self.names())}. "
                          f"Register one with {self.axis.upper()}.register({name!r}) in-process, "
                          f"or as an entry point in group {self.group!r} of an installed package")

    def validate(self, name: str) -> str:
        """``name`` if it is registered (for config validators), else a ConfigError."""
        self.get(name)
        return name

    def names(self) -> list[str]:
        """Every known name: registered ones and installed entry points (not loaded)."""
        return sorted(set(self._entries) | {ep.name for ep in self._entry_points()})

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.names()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def _entry_points(self) -> list[metadata.EntryPoint]:
        return list(metadata.entry_points(group=self.group))

    def __repr__(self) -> str:
        return f"PluginRegistry({self.axis!r}: {', '.join(self.names())})"


class EntryParams(BaseModel):
    """An entry's own knobs (a method's ``selection.params``, a hook's ``train.comm.params``, a
    backend's ``loader.backend_params.<name>``), declared next to its code as the entry's
    ``Params``, a subclass of this. This base has none: an entry without knobs refuses any."""
    model_config = ConfigDict(extra="forbid")


def params_model(entry: object) -> type[EntryParams]:
    """The params model an entry declares (``EntryParams``, no knobs, when it declares none)."""
    return getattr(entry, "Params", EntryParams)


def entry_params(entry: object, name: str, params: dict, what: str) -> dict:
    """``params`` checked against the entry's params model, defaults filled in (so a resolved
    config shows every knob). Raises ValueError naming the bad knob and the ones the entry takes."""
    model = getattr(entry, "Params", None)
    if model is None:  # an entry that declares no params model at all
        if params:
            raise ValueError(f"{what} {name!r} takes no params, got {sorted(params)}")
        return {}
    try:
        return model.model_validate(params).model_dump(mode="json")
    except ValidationError as e:
        takes = ", ".join(model.model_fields) or "none"
        problems = "; ".join(f"params.{'.'.join(map(str, err['loc']))}: "
                             f"{'unknown key' if err['type'] == 'extra_forbidden' else err['msg']}"
                             for err in e.errors())
        raise ValueError(f"{what} {name!r}: {problems} (it takes: {takes})") from None
