"""A dataset version's ancestry: is an earlier version one of its ancestors, and which keys were
relabelled or given new pixels since then.

A warm start needs both. "Ancestor" is read from the version's own manifest (``ancestors``: the
fingerprints of every version it was written on top of), so it holds after ``gc`` removed the
older directories. What changed since reads the deltas of the versions in between, which must
still be on disk: when one is gone the answer is "unknown", and a caller starts from scratch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from sluice.errors import ArtifactError
from sluice.storage.manifest import Manifest, read_manifest
from sluice.storage.paths import join, parent_url


@dataclass
class SinceAncestor:
    """What the versions after ``ancestor`` changed, up to and including the one asked about."""
    ancestor: str
    versions: int = 0  # versions written since the ancestor (1: it is the direct parent)
    relabelled: set[str] = field(default_factory=set)
    changed: set[str] = field(default_factory=set)  # new pixels under an old key
    removed: set[str] = field(default_factory=set)
    root: str = ""  # where the ancestor version itself lives (its directory or URL)


def is_ancestor(manifest: Manifest, fingerprint: str) -> bool:
    """True when the version of ``fingerprint`` is the one of ``manifest`` or one it descends from."""
    return fingerprint == manifest.fingerprint or fingerprint in manifest.ancestors


def parents(root: str | os.PathLike, manifest: Any,
            read: Callable[[str], Any] = read_manifest) -> Iterator[tuple[str, Any]]:
    """The versions the one at ``root`` (``manifest``) was written on top of, nearest first, as
    (directory, manifest), through each manifest's ``parent``; ArtifactError names the first one
    that is gone (``sluice gc``) or unreadable. ``read``: how a version's manifest is read (an
    image artifact's; a token artifact's)."""
    here, m, seen = os.fspath(root), manifest, set()
    while m.parent and m.parent not in seen:
        seen.add(m.parent)
        here = join(parent_url(here), m.parent)
        try:
            m = read(here)
        except (ArtifactError, OSError, ValueError) as e:
            raise ArtifactError(f"version {m.parent} is gone or unreadable ({e})") from None
        yield here, m


def ancestry(root: str | os.PathLike, manifest: Manifest) -> list[str]:
    """The fingerprints of the versions the one at ``root`` descends from, nearest first: the
    manifest's ``ancestors`` when it records them, else its ``parent`` chain as far as it reads."""
    if manifest.ancestors:
        return list(manifest.ancestors)
    out: list[str] = []
    try:
        for _, m in parents(root, manifest):
            out.append(m.fingerprint)
    except ArtifactError:
        pass  # collected or unreadable: the chain ends here
    return out


def changes_since(root: str | os.PathLike, fingerprint: str,
                  read: Callable[[str], Any] = read_manifest) -> SinceAncestor | str:
    """The keys relabelled, changed or removed between the ancestor ``fingerprint`` and the
    version at ``root``, or why they cannot be told (not an ancestor; a version in between gone).
    ``read``: how a version's manifest is read (an image artifact's, by default; a token
    artifact's records no relabelling)."""
    manifest = read(os.fspath(root))
    if not is_ancestor(manifest, fingerprint):
        return f"version {fingerprint[:16]} is not an ancestor of {manifest.fingerprint[:16]}"
    out = SinceAncestor(ancestor=fingerprint, root=os.fspath(root))
    m = manifest
    if m.fingerprint == fingerprint:
        return out
    try:
        for here, parent in parents(root, manifest, read):  # lazily: nothing is read past the ancestor
            if m.delta is None:
                break
            out.relabelled.update(getattr(m.delta, "relabelled", ()))
            out.changed.update(m.delta.changed)
            out.removed.update(m.delta.removed)
            out.versions += 1
            out.root, m = here, parent
            if m.fingerprint == fingerprint:
                return out
    except ArtifactError as e:
        return f"{e}: what changed since {fingerprint[:16]} cannot be told"
    return f"version {m.fingerprint[:16]} records no delta against its parent"
