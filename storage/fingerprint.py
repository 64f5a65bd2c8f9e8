"""Content fingerprints: the same inputs always give the same hex string.

A dataset's fingerprint hashes its source's content with the config that shapes it, so an
unchanged re-run finds its artifact and new data yields a new version.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable

CHUNK = 1 << 20


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace: equal objects, equal strings."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def hash_obj(obj: Any) -> str:
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def hash_files(paths: Iterable[str | os.PathLike], root: str | os.PathLike | None = None) -> str:
    """Hash file names (relative to ``root``) and their bytes, in the order given."""
    h = hashlib.sha256()
    for p in paths:
        name = os.path.relpath(p, root) if root is not None else Path(p).name
        h.update(name.encode() + b"\0")
        h.update(sha256_file(p).encode())
    return h.hexdigest()


def combine(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()
