"""Completion records of a stage's parts, and the strict merge that reads them.

A part (one tar shard, wherever it ran: this process, the local pool, a Prefect task runner, a
Ray node) publishes its files atomically and then, last, a small record beside its main file:
the plan it carried out (a hash of everything that decides its bytes) and what it produced.
The record is what makes a part count as done, as datatrove's completion markers do: a rerun
reuses a part whose record matches its plan and whose files are whole, and the merge that builds
the manifest reads every planned part's record from storage rather than trusting what the
engine handed back. It refuses, naming the part, one that is missing (after a bounded wait, for
storage that shows files late: it never hangs), partial (a file gone or of another size than
recorded) or foreign (its record carries another plan).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from sluice.errors import ShardError
from sluice.storage import atomic
from sluice.storage.fingerprint import hash_obj

SUFFIX = ".done.json"
FORMAT = 1


class PartRefused(ShardError):
    """The merge found a planned part missing, partial or written for another plan."""


def record_path(target: str | Path) -> Path:
    """Where the completion record of the part whose main file is ``target`` lives."""
    target = Path(target)
    return target.with_name(target.name + SUFFIX)


def plan_id(plan: Any) -> str:
    """The identity of a part's plan: everything (as plain data) that decides its bytes."""
    return hash_obj(plan)


def finish(target: str | Path, plan: str, result: dict[str, Any], files: Sequence[str | Path]) -> None:
    """Record the part as done, once every file in ``files`` is published: their sizes, so a
    file that later loses bytes is seen as partial."""
    sizes = {Path(f).name: Path(f).stat().st_size for f in files}
    atomic.write_json(record_path(target), {"format": FORMAT, "plan": plan, "files": sizes, "result": result})


def _check(target: Path, plan: str) -> tuple[str, dict[str, Any] | None]:
    """('done', result), ('missing', None), ('partial', why) or ('foreign', why) for one part."""
    path = record_path(target)
    try:
        rec = json.loads(path.read_text())
    except FileNotFoundError:
        return "missing", None
    except (OSError, ValueError) as e:
        return "partial", {"why": f"its completion record {path.name} cannot be read ({e})"}
    if not isinstance(rec, dict) or rec.get("format") != FORMAT or not isinstance(rec.get("files"), dict):
        return "partial", {"why": f"its completion record {path.name} is not one this version writes"}
    if rec.get("plan") != plan:
        return "foreign", {"why": f"its completion record {path.name} is for plan {str(rec.get('plan'))[:12]}, "
                                  f"not this run's {plan[:12]}"}
    for name, size in rec["files"].items():
        f = target.with_name(name)
        try:
            have = f.stat().st_size
        except FileNotFoundError:
            return "partial", {"why": f"{name} is gone"}
        if have != size:
            return "partial", {"why": f"{name} holds {have} bytes, its record says {size}"}
    return "done", rec["result"]


def reusable(target: str | Path, plan: str) -> dict[str, Any] | None:
    """The recorded result of a part an earlier run finished for this very plan, else None
    (never recorded, partial or of another plan: the part is written again)."""
    state, result = _check(Path(target), plan)
    return result if state == "done" else None


def merge(parts: Sequence[tuple[str | Path, str]], wait_s: float, name: Callable[[Path], str] = str,
          poll_s: float = 0.2) -> list[dict[str, Any]]:
    """Every planned part's recorded result, in the order given: ``parts`` is (main file, plan).
    A part without a record is waited for up to ``wait_s`` seconds; then, or at once for a
    partial or foreign part, ``PartRefused`` names every part that is not done (``name`` turns
    a main file into the name it is reported by)."""
    deadline = time.monotonic() + max(0.0, wait_s)
    results: dict[int, dict[str, Any]] = {}
    while True:
        bad: list[str] = []
        missing: list[int] = []
        for i, (target, plan) in enumerate(parts):
            if i in results:
                continue
            state, result = _check(Path(target), plan)
            if state == "done":
                results[i] = result  # type: ignore[assignment]
            elif state == "missing":
                missing.append(i)
            else:
                bad.append(f"{name(Path(target))}: {state}, {result['why']}")  # type: ignore[index]
        if not missing and not bad:
            return [results[i] for i in range(len(parts))]
        if bad or time.monotonic() >= deadline:
            lines = bad + [f"{name(Path(parts[i][0]))}: missing, no completion record after {wait_s:g} s"
                           for i in missing]
            shown = "\n  ".join(lines[:10]) + (f"\n  ... and {len(lines) - 10} more" if len(lines) > 10 else "")
            raise PartRefused(f"the merge refused {len(lines)} of {len(parts)} parts:\n  {shown}")
        time.sleep(poll_s)
