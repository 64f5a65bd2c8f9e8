"""The night's mirror: every candidate in the file registry, to each tracker in
``tracking.loggers``, in the flow after promotion. A tracker that fails costs the night nothing:
its status says it is behind, and the next night's mirror (idempotent) catches up."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from sluice.errors import MissingDependency
from sluice.stages.track.config import TrackingConfig
from sluice.stages.track.registry import TRACKERS, Mirrored, Night

REPORT = "report.md"


def nights_in(registry_dir: str | Path) -> tuple[list[Night], str | None]:
    """Every model in the registry, oldest first, with its files and run folder, and the champion."""
    from sluice.storage.registry import Registry
    reg = Registry(registry_dir)
    out = []
    for rec in reg.list():
        run_dir = rec.run.get("run_dir")
        out.append(Night(record=rec, checkpoint=reg.checkpoint_path(rec), files=reg.model_files(rec),
                         run_dir=Path(run_dir) if run_dir and Path(run_dir).is_dir() else None))
    champ = reg.champion()
    return out, champ.model_id if champ else None


def mirror_registry(cfg: TrackingConfig, data_root: str | Path, registry_dir: str | Path, kind: Any, version: Any,
                    log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Bring every tracker up to date with the registry; one status per tracker, never raises."""
    if not cfg.on:
        return []
    try:
        nights, champion = nights_in(registry_dir)
    except Exception as e:  # noqa: BLE001 - an unreadable registry is promotion's to report, not the mirror's
        return [Mirrored(tracker=name, behind=f"the registry could not be read: {type(e).__name__}: {e}").to_dict()
                for name in cfg.loggers]
    out = []
    for name in cfg.loggers:
        try:
            tracker = TRACKERS.get(name)(cfg, Path(data_root), kind)
            status = tracker.mirror(nights, champion, version, log)
        except MissingDependency as e:  # not installed: said every night, nothing to catch up by waiting
            status = Mirrored(tracker=name, behind=str(e), retry=False)
        except Exception as e:  # noqa: BLE001 - a tracker never fails the night
            status = Mirrored(tracker=name, behind=f"{type(e).__name__}: {str(e)[:300]}")
        log(f"tracking: {status.line()}")
        out.append(status.to_dict())
    return out


def attach_report(cfg: TrackingConfig, data_root: str | Path, registry_dir: str | Path, kind: Any, model_id: str,
                  report: str | Path, log: Callable[[str], None]) -> dict[str, str | None]:
    """The night's report, once written, added to its run in each tracker (None: done; else why
    not: the next night's mirror adds it to a run it creates)."""
    if not cfg.on:
        return {}
    try:
        nights, _ = nights_in(registry_dir)
    except Exception as e:  # noqa: BLE001
        return {name: f"the registry could not be read: {type(e).__name__}: {e}" for name in cfg.loggers}
    night = next((n for n in nights if n.model_id == model_id), None)
    out: dict[str, str | None] = {}
    for name in cfg.loggers:
        try:
            out[name] = None if night is None else \
                TRACKERS.get(name)(cfg, Path(data_root), kind).attach(night, {REPORT: Path(report)}, log)
        except Exception as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}: {str(e)[:300]}"
    return out
