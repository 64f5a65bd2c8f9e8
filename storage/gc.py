"""``sluice gc``: remove old versions of a dataset, never what a reader or a kept version uses.

A dataset root holds versions (``<root>/<version>/manifest.json`` and their files) and ``LATEST``.
A version written on top of a parent reuses the parent's files where they lie
(``FileRecord.version``), so a version's directory may hold files that newer versions read.

``collect(root, keep)`` keeps the ``keep`` newest complete versions (by their manifest's
``created_at``), the one ``LATEST`` names, and every version a reader holds (an open
``DatasetArtifact`` holds a shared lock on ``<root>/.readers/<version>.lock``; a version whose
lock cannot be taken exclusively at once is held). Every other complete version is removed:

1. its manifest goes first, with the reader's lock held exclusively, so from then on nobody can
   open it (a reader that opens it meanwhile waits for the lock, then finds no manifest); a
   marker file (``REMOVED_MARKER``) is written just before, which tells its leftovers from a
   version being written;
2. then every file under it that no kept or held version's manifest lists, then its empty
   directories. Files that a kept version still reads stay where they are, with the marker and
   without the manifest; a later collection removes them once no version lists them.

Never touched: a directory without ``manifest.json`` and without the marker (a version being
written, or a run that was killed: it may resume), dot-files and dot-directories at the root (the
locks, ``.readers``), plain files at the root (``LATEST``), symlinks at the root, and anything a
symlink inside a version points to (a symlink is removed as a link, never followed). A directory
whose writer's lock (``<root>/.<version>.lock``, the shard stage's) is held is left alone.

The whole collection runs under an exclusive lock on ``<root>/.gc.lock``; a shard run that writes a
version on top of a parent holds it shared (``gc_lock_file``), so a parent is never collected
under a version being written on top of it.
"""
from __future__ import annotations

import contextlib
import json
import os
import posixpath
import socket
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from sluice.errors import ArtifactError, ConfigError
from sluice.storage import atomic
from sluice.storage.artifact import LATEST, reader_lock_file
from sluice.storage.locking import exclusive, try_exclusive
from sluice.storage.manifest import MANIFEST_NAME, Manifest, read_manifest
from sluice.storage.tokens import TokenManifest, is_token_artifact, read_token_manifest
from sluice.storage.paths import is_local, local_path

GC_LOCK = ".gc.lock"
# Written into a version's directory just before gc removes its manifest: what is left there is
# files other versions use, not a version being written.
REMOVED_MARKER = ".sluice-gc-removed"


def gc_lock_file(root: str | os.PathLike) -> Path:
    """The lock a collection holds exclusively, and a writer of a version on top of a parent
    holds shared (``locking.shared``) while it writes."""
    return local_path(root) / GC_LOCK


def writer_lock_file(root: str | os.PathLike, version: str) -> Path:
    """The shard stage's lock while it writes ``version`` under the dataset root ``root``."""
    return local_path(root) / f".{version}.lock"


@dataclass
class GcReport:
    root: str
    keep: int
    dry_run: bool
    latest: str | None = None
    versions_kept: list[str] = field(default_factory=list)  # the newest `keep` and LATEST's, newest first
    versions_removed: list[str] = field(default_factory=list)  # manifest removed (dry run: would be)
    versions_held: list[str] = field(default_factory=list)  # would be removed, but a reader holds them
    files_removed: int = 0  # manifests and files (dry run: would be)
    bytes_freed: int = 0
    # removed versions' directories that stay because kept versions read files there: files left
    dirs_left: dict[str, int] = field(default_factory=dict)
    incomplete: list[str] = field(default_factory=list)  # no manifest: being written or killed; untouched
    busy: list[str] = field(default_factory=list)  # leftovers of removed versions a writer holds: untouched
    errors: list[str] = field(default_factory=list)  # files or directories that could not be removed
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}

    def format(self) -> str:
        verb = "would remove" if self.dry_run else "removed"
        lines = [f"sluice gc {self.root} (keep the {self.keep} newest{', dry run' if self.dry_run else ''}): "
                 f"{verb} {_n(len(self.versions_removed), 'version')}, {_n(self.files_removed, 'file')}, "
                 f"{_mb(self.bytes_freed)} {'would be ' if self.dry_run else ''}freed in {self.seconds:.1f} s"]
        for v in self.versions_kept:
            lines.append(f"  kept     {v}{'  (LATEST)' if v == self.latest else ''}")
        for v in self.versions_held:
            lines.append(f"  held     {v}  (open in a reader: kept; a later gc removes it once no reader has it)")
        for v in self.versions_removed:
            lines.append(f"  {'removing' if self.dry_run else 'removed '} {v}")
        for v, n in self.dirs_left.items():
            lines.append(f"  left     {v}: {_n(n, 'file')} that kept versions read stay there (its manifest "
                         f"{'would be ' if self.dry_run else ''}gone)")
        for v in self.incomplete:
            lines.append(f"  skipped  {v}  (no {MANIFEST_NAME}: being written, or a run that did not finish)")
        for v in self.busy:
            lines.append(f"  skipped  {v}  (a shard run is writing it)")
        for e in self.errors:
            lines.append(f"  ERROR    {e}")
        if not self.versions_removed and not self.files_removed:
            lines.append("  nothing to remove")
        return "\n".join(lines)


def _n(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


@dataclass
class _Version:
    name: str
    path: Path
    manifest: Manifest | TokenManifest
    created: datetime


def collect(root: str | os.PathLike, keep: int = 3, dry_run: bool = False, *,
            on_wait: Callable[[str], None] | None = None) -> GcReport:
    """Remove the versions under the dataset root ``root`` that are not among the ``keep`` newest,
    not named by LATEST and not held by a reader (see the module docstring); ``dry_run`` removes
    nothing and reports what would go. Waits for shard runs that write on top of a parent (and
    another collection), calling ``on_wait(holder)`` once if it has to.

    Raises ArtifactError for a root that does not exist or is not a dataset root, or that holds
    a manifest it cannot read (it could not tell which files that version uses); ConfigError for
    ``keep`` < 1."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ConfigError(f"keep must be a whole number >= 1 (the newest versions to keep), not {keep!r}")
    base = _dataset_root(root)
    t0 = time.perf_counter()
    if dry_run and not os.access(base, os.W_OK):
        lock: contextlib.AbstractContextManager = contextlib.nullcontext()  # a read-only root: look only
    else:
        lock = exclusive(base / GC_LOCK, on_wait=on_wait)
    with lock:
        report = _collect(base, keep, dry_run)
    report.seconds = time.perf_counter() - t0
    return report


def _dataset_root(root: str | os.PathLike) -> Path:
    s = os.fspath(root)
    if not is_local(s):
        raise ArtifactError(f"sluice gc works on local dataset roots; {s} is not on this machine's filesystem")
    p = local_path(s)
    if not p.exists():
        raise ArtifactError(f"no dataset root at {p}: it does not exist")
    if not p.is_dir():
        raise ArtifactError(f"{p} is not a dataset root: it is not a directory")
    p = p.resolve()
    if (p / MANIFEST_NAME).exists():
        raise ArtifactError(f"{p} is one version of a dataset (it has {MANIFEST_NAME}), not a dataset root: "
                            f"give the directory that holds the versions and LATEST, {p.parent}")
    if not (p / LATEST).is_file() and not any(e.is_dir(follow_symlinks=False) and (
            os.path.lexists(os.path.join(e.path, MANIFEST_NAME)) or
            os.path.lexists(os.path.join(e.path, REMOVED_MARKER))) for e in _entries(p)):
        raise ArtifactError(f"{p} is not a dataset root: it has no {LATEST} and no version directory with a "
                            f"{MANIFEST_NAME} (`sluice shard SOURCE --out {p}` writes one)")
    return p


def _entries(base: Path) -> list[os.DirEntry]:
    with os.scandir(base) as it:
        return sorted((e for e in it if not e.name.startswith(".")), key=lambda e: e.name)


def _read_latest(base: Path) -> str | None:
    try:
        name = (base / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name or None


def _created(m: Manifest | TokenManifest, path: Path) -> datetime:
    try:
        t = datetime.fromisoformat(m.created_at)
        return t if t.tzinfo else t.replace(tzinfo=timezone.utc)
    except ValueError:
        return datetime.fromtimestamp(path.stat().st_mtime, timezone.utc)


def _collect(base: Path, keep: int, dry_run: bool) -> GcReport:
    report = GcReport(root=str(base), keep=keep, dry_run=dry_run)
    complete: list[_Version] = []
    leftovers: list[str] = []  # directories of versions an earlier collection removed
    for e in _entries(base):
        if not e.is_dir(follow_symlinks=False):
            continue  # LATEST, other files, symlinks: never followed, never touched
        path = Path(e.path)
        if os.path.lexists(path / MANIFEST_NAME):
            try:
                m = read_token_manifest(path) if is_token_artifact(path) else read_manifest(path)
            except (ArtifactError, ValueError) as err:
                raise ArtifactError(f"cannot read {path / MANIFEST_NAME} ({err}); sluice gc cannot tell which "
                                    "files that version uses, so it removes nothing: repair it, or move that "
                                    "directory out of the dataset root if it is not needed") from None
            complete.append(_Version(e.name, path, m, _created(m, path / MANIFEST_NAME)))
        elif os.path.lexists(path / REMOVED_MARKER):
            leftovers.append(e.name)
        else:
            report.incomplete.append(e.name)
    complete.sort(key=lambda v: (v.created, v.name), reverse=True)
    report.latest = _read_latest(base)
    kept = {v.name for v in complete[:keep]} | ({report.latest} if report.latest else set())

    # 1. Manifests first: each removed with its reader's lock held, so none can open it meanwhile.
    holding: list[_Version] = []
    for v in complete:
        if v.name in kept:
            holding.append(v)
            continue
        with try_exclusive(reader_lock_file(v.path), create=not dry_run) as free:
            latest = _read_latest(base)
            if latest == v.name:  # a shard run re-pointed LATEST at it since
                kept.add(v.name)
                holding.append(v)
                continue
            if not free:
                report.versions_held.append(v.name)
                holding.append(v)
                continue
            size = _size(v.path / MANIFEST_NAME)
            if not dry_run:
                try:
                    atomic.write_bytes(v.path / REMOVED_MARKER, (json.dumps({
                        "removed_by": "sluice gc", "at": datetime.now(timezone.utc).isoformat(),
                        "host": socket.gethostname(), "pid": os.getpid(),
                        "note": "files left here are read by other versions of this dataset"}) + "\n").encode())
                    os.unlink(v.path / MANIFEST_NAME)
                except OSError as err:  # still complete (a marker beside a manifest means nothing)
                    report.errors.append(f"cannot remove {v.path / MANIFEST_NAME}: {err.strerror or err}")
                    holding.append(v)
                    continue
            report.versions_removed.append(v.name)
            report.files_removed += 1
            report.bytes_freed += size
    report.versions_kept = [v.name for v in complete if v.name in kept]

    # 2. Every file no remaining version lists, then the empty directories.
    used: set[tuple[str, str]] = set()
    for v in holding:
        for f in v.manifest.files():
            used.add((f.version or v.name, posixpath.normpath(f.path)))
    for name in report.versions_removed + leftovers:
        path = base / name
        with try_exclusive(writer_lock_file(base, name), create=not dry_run) as free:
            if not free:  # a shard run writes this version again (same fingerprint): its files now
                report.busy.append(name)
                continue
            if not dry_run and os.path.lexists(path / MANIFEST_NAME):
                continue  # written again (complete) since it was found
            _sweep(path, name, used, dry_run, report)
    return report


def _size(path: Path) -> int:
    try:
        return path.lstat().st_size
    except OSError:
        return 0


def _sweep(vdir: Path, name: str, used: set[tuple[str, str]], dry_run: bool, report: GcReport) -> None:
    """Remove the files under ``vdir`` that no remaining version lists (a symlink as a link), then
    the directories left empty; the marker and ``vdir`` itself go last, once nothing else is left."""
    left = 0

    def walk(d: Path, rel: str) -> bool:  # True: ``d`` is (or, in a dry run, would be) empty now
        nonlocal left
        empty = True
        try:
            with os.scandir(d) as it:
                entries = list(it)
        except OSError as e:
            report.errors.append(f"cannot list {d}: {e.strerror or e}")
            return False
        for e in entries:
            r = f"{rel}/{e.name}" if rel else e.name
            if not rel and e.name in (REMOVED_MARKER, MANIFEST_NAME):
                continue  # the marker goes last; a dry run counted the manifest already
            if e.is_dir(follow_symlinks=False):
                if walk(Path(e.path), r):
                    if not dry_run:
                        try:
                            os.rmdir(e.path)
                        except OSError:
                            empty = False
                else:
                    empty = False
                continue
            if (name, r) in used:
                left += 1
                empty = False
                continue
            size = _size(Path(e.path))
            if not dry_run:
                try:
                    os.unlink(e.path)
                except FileNotFoundError:
                    continue
                except OSError as err:
                    report.errors.append(f"cannot remove {e.path}: {err.strerror or err}")
                    empty = False
                    continue
            report.files_removed += 1
            report.bytes_freed += size
        return empty

    if walk(vdir, ""):
        if not dry_run:
            try:
                (vdir / REMOVED_MARKER).unlink(missing_ok=True)
                os.rmdir(vdir)
            except OSError as err:
                report.errors.append(f"cannot remove {vdir}: {err.strerror or err}")
    elif left:
        report.dirs_left[name] = left
