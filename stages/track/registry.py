"""The tracker axis (``TRACKERS``): where a night is mirrored. ``mlflow`` and ``tensorboard`` are
entries; a third is one more class registered with ``@TRACKERS.register(name)`` (or an entry
point in group ``sluice.trackers``), named in ``tracking.loggers``."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from sluice.plugins import PluginRegistry


@dataclass(frozen=True)
class Night:
    """One registered candidate as the trackers see it: its registry record (the resolved config,
    grades, lineage, the Prefect flow run), its files, and its run folder where it still exists
    (``metrics.jsonl``, ``report.md``)."""
    record: Any  # storage.registry.ModelRecord
    checkpoint: Path
    files: dict[str, str]
    run_dir: Path | None

    @property
    def model_id(self) -> str:
        return self.record.model_id


@dataclass
class Mirrored:
    """What one tracker did with the registry tonight: ``behind`` says why it could not finish
    (the next night catches up), ``None`` when it is up to date."""
    tracker: str
    added: list[str] = field(default_factory=list)  # model ids mirrored tonight
    champion: str | None = None  # where the alias points after tonight (model id)
    behind: str | None = None
    where: str = ""  # the store or folder, for the report
    notes: list[str] = field(default_factory=list)
    retry: bool = True  # False: the next night cannot catch up by itself (the tracker is not installed)

    def line(self) -> str:
        done = f"{len(self.added)} mirrored" + (f" ({', '.join(self.added)})" if self.added else "")
        state = (f"BEHIND: {self.behind}" + ("; the next night catches up" if self.retry else "")) \
            if self.behind else "up to date"
        return f"{self.tracker} ({self.where}): {done}; {state}"

    def to_dict(self) -> dict[str, Any]:
        return {"tracker": self.tracker, "added": self.added, "champion": self.champion, "behind": self.behind,
                "where": self.where, "notes": self.notes, "retry": self.retry}


class Tracker(Protocol):
    """Built with (tracking config, data root, the kind of data); ``mirror`` brings the tracker up
    to date with every night in the registry (idempotent: what is there already is left) and
    points its champion at ``champion``; ``attach`` adds files to one night's run afterwards.
    Neither raises for an unreachable tracker: it says so in ``Mirrored.behind``."""
    name: str

    def mirror(self, nights: list[Night], champion: str | None, version: Any,
               log: Callable[[str], None]) -> Mirrored: ...

    def attach(self, night: Night, files: dict[str, Path], log: Callable[[str], None]) -> str | None: ...


TRACKERS: PluginRegistry[type] = PluginRegistry("trackers", "tracker")
