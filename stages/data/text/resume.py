"""The text stage's costly parts (signatures, tokens) kept as they finish, so a run interrupted
as a whole (``kill -9``, a lost head, a Prefect retry) resumes from the parts it had finished and
says how many it reused, instead of signing and tokenising the corpus again.

Each part's result is stored beside the version being written (``<version>/.parts/``) under the
hash of everything the part computes from (the function, its parameters or the tokenizer's
bytes, the documents' ids and texts), then its completion record (``storage/part_records.py``);
a rerun takes a stored result only for that very plan, so a result can never stand in for other
documents. The results hold no pickles: ``.npz`` arrays, loaded with ``allow_pickle=False``."""
from __future__ import annotations

import hashlib
import shutil
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from sluice.stages.data.engine import LocalParts, Parts
from sluice.storage import atomic, part_records

PARTS_DIR = ".parts"


class KeptParts:
    """``inner``'s parts (this process, or the engine's), each result stored in ``folder`` as it
    comes back, and a stored one taken instead of running its part again (``reused``)."""

    def __init__(self, inner: Parts | None, folder: Path):
        self.inner: Any = inner or LocalParts()
        self.folder = folder
        self.reused = 0
        self.ran = 0

    def ordered(self, fn: Callable[[Any], Any], parts: Iterable[Any], window: int | None = None) -> Iterator[Any]:
        """``fn(part)`` for each part, in order: stored results where there are any, the inner
        engine's for the rest (which it runs as it would, with ``window`` in flight)."""
        slots: deque = deque()  # per part, in order: ("kept", result) or ("todo", plan)

        def fresh() -> Iterator[Any]:
            for p in parts:
                plan = self._plan(fn, p)
                got = self._load(fn, plan)
                if got is None:
                    slots.append(("todo", plan))
                    yield p
                else:
                    slots.append(("kept", got))
        results = iter(self.inner.ordered(fn, fresh(), window))
        ready: deque = deque()
        exhausted = False

        def pull() -> None:
            nonlocal exhausted
            try:
                ready.append(next(results))
            except StopIteration:
                exhausted = True
        while True:
            while not slots and not exhausted:
                pull()
            if not slots:
                return
            kind, value = slots.popleft()
            if kind == "kept":
                self.reused += 1
                yield value
                continue
            while not ready and not exhausted:
                pull()
            if not ready:
                raise RuntimeError(f"the engine returned fewer {fn.__name__} results than it was given parts")
            result = ready.popleft()
            self._save(fn, value, result)
            self.ran += 1
            yield result

    def _plan(self, fn: Callable, part: tuple) -> str:
        """The hash of what the part computes from: the function, its first field (parameters,
        or the tokenizer's JSON), the ids and every text."""
        head, ids, texts = part
        h = hashlib.sha256(f"{fn.__module__}.{fn.__qualname__}\0".encode())
        if isinstance(head, (bytes, bytearray)):
            h.update(hashlib.sha256(head).digest())
        else:
            h.update(repr(head).encode())
        h.update(repr(list(ids)).encode())
        for t in texts:
            b = t.encode("utf-8", "surrogatepass")
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)
        return h.hexdigest()

    def _path(self, fn: Callable, plan: str) -> Path:
        return self.folder / f"{fn.__name__}-{plan[:32]}.npz"

    def _load(self, fn: Callable, plan: str) -> tuple[list, Any] | None:
        path = self._path(fn, plan)
        if part_records.reusable(path, plan) is None:
            return None
        try:
            with np.load(path, allow_pickle=False) as z:
                ids = z["ids"].tolist()
                if "array" in z:
                    return ids, z["array"]
                flat, offsets = z["flat"], z["offsets"]
                return ids, [flat[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
        except (OSError, ValueError, KeyError):
            return None  # unreadable: the part runs again

    def _save(self, fn: Callable, plan: str, result: tuple[list, Any]) -> None:
        ids, payload = result
        arrays: dict[str, np.ndarray] = {"ids": np.asarray(ids)}
        if isinstance(payload, np.ndarray):
            arrays["array"] = payload
        else:
            lens = [len(a) for a in payload]
            arrays["flat"] = np.concatenate(payload) if payload else np.zeros(0, np.uint32)
            arrays["offsets"] = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self._path(fn, plan)
        with atomic.atomic_path(path) as tmp:
            with open(tmp, "wb") as f:
                np.savez(f, **arrays)
        part_records.finish(path, plan, {}, [path])  # the result is the .npz itself

    def said(self) -> str:
        """What the resume saved, for the summary ('' when nothing was reused)."""
        if not self.reused:
            return ""
        return f"resumed an interrupted run: {self.reused} of {self.reused + self.ran} parts reused"


def clear_except_parts(work: Path) -> None:
    """An interrupted run's files gone, but for its finished parts (``PARTS_DIR``)."""
    if not work.exists():
        return
    for p in work.iterdir():
        if p.name == PARTS_DIR:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def drop_parts(work: Path) -> None:
    """The kept parts, once the version no longer needs them (before its manifest is written)."""
    shutil.rmtree(work / PARTS_DIR, ignore_errors=True)
