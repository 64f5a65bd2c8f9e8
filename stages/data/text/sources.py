"""Where text documents come from: a folder of ``.txt``/``.md`` files, a ``.jsonl`` with a text
field, or a Parquet file (pyarrow, imported only for one).

A source yields ``RawDoc``s in a stable order, each with a stable key (what decides its split and
what a grown source's next version matches it by) and its bytes or string as stored; nothing is
judged here, the shard stage quarantines what is bad. Keys: a file's path under the folder; a
record's ``key_field`` (``id``) when it has one, else the file's stem and line (row) number, so an
appended-to ``.jsonl`` keeps every earlier key.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from sluice.errors import MissingDependency, SourceError
from sluice.stages.data.sources.base import sanitize_key, unique_keys
from sluice.storage.fingerprint import CHUNK

TEXT_SUFFIXES = (".txt", ".md")
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".tar", ".npz"}  # an image source (with a README.txt, say)


@dataclass
class RawDoc:
    """A document as the source holds it: ``data`` is bytes (a file) or str (a JSON/Parquet
    string); with ``error`` set, a record that holds no usable text (``data``: its raw bytes, if any)."""
    key: str
    where: str
    data: bytes | str | None
    error: str | None = None


class TextSource:
    kind = ""

    def __init__(self, path: Path, text_field: str = "text", key_field: str | None = "id"):
        self.path, self.text_field, self.key_field = path, text_field, key_field

    def files(self) -> list[Path]:
        return [self.path]

    def docs(self) -> Iterator[RawDoc]:
        raise NotImplementedError

    def fingerprint(self) -> str:
        """A hash of the kind, the fields read, and every file's relative name and bytes."""
        h = hashlib.sha256(f"{self.kind}\0{self.text_field}\0{self.key_field}\0".encode())
        base = self.path if self.path.is_dir() else self.path.parent
        for p in self.files():
            h.update(p.relative_to(base).as_posix().encode() + b"\0")
            with open(p, "rb") as f:
                while chunk := f.read(CHUNK):
                    h.update(chunk)
            h.update(b"\0")
        return h.hexdigest()

    def _key(self, record: dict | None, n: int, seen: set[str]) -> str:
        v = record.get(self.key_field) if isinstance(record, dict) and self.key_field else None
        key = sanitize_key(str(v)) if isinstance(v, (str, int)) and not isinstance(v, bool) else \
            sanitize_key(f"{self.path.stem}-{n:09d}")
        if key in seen:  # a repeated id: the later record still gets a key, and is quarantined
            return ""
        seen.add(key)
        return key


class FolderSource(TextSource):
    """Every ``.txt`` and ``.md`` file under a folder (recursively), one document each, in path order."""
    kind = "folder"

    def files(self) -> list[Path]:
        return sorted(p for p in self.path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES
                      and not any(part.startswith(".") for part in p.relative_to(self.path).parts))

    def docs(self) -> Iterator[RawDoc]:
        files = self.files()
        keys = unique_keys([p.relative_to(self.path).as_posix() for p in files])
        for key, p in zip(keys, files):
            yield RawDoc(key, str(p), p.read_bytes())


class JsonlSource(TextSource):
    """One JSON object a line; its ``text_field`` string is the document."""
    kind = "jsonl"

    def docs(self) -> Iterator[RawDoc]:
        seen: set[str] = set()
        with open(self.path, "rb") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{self.path}:{n}"
                try:
                    rec = json.loads(line)
                except ValueError as e:  # bad JSON, or bytes that are not UTF-8
                    yield RawDoc(self._key(None, n, seen) or f"{self.path.stem}-{n:09d}-dup", where, line,
                                 "utf8" if isinstance(e, UnicodeDecodeError) else f"bad_record: {e}")
                    continue
                key = self._key(rec, n, seen)
                text = rec.get(self.text_field) if isinstance(rec, dict) else None
                if not key:
                    yield RawDoc(f"{self.path.stem}-{n:09d}-dup", where, line, "duplicate_key")
                elif not isinstance(text, str):
                    yield RawDoc(key, where, line, f"bad_record: no string field {self.text_field!r}")
                else:
                    yield RawDoc(key, where, text)


class ParquetSource(TextSource):
    """A Parquet file's ``text_field`` column (string or binary), read a row group at a time."""
    kind = "parquet"

    def docs(self) -> Iterator[RawDoc]:
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise MissingDependency(f"reading the Parquet text source {self.path} needs pyarrow ({e}); "
                                    "install it with: pip install 'sluice[parquet]'") from e
        f = pq.ParquetFile(self.path)
        names = f.schema_arrow.names
        if self.text_field not in names:
            raise SourceError(f"{self.path} has no column {self.text_field!r} (columns: {names})")
        cols = [self.text_field] + ([self.key_field] if self.key_field in names else [])
        seen: set[str] = set()
        n = 0
        for batch in f.iter_batches(columns=cols, batch_size=4096):
            data = batch.to_pydict()
            ids = data.get(self.key_field) if self.key_field in data else None
            for j, text in enumerate(data[self.text_field]):
                n += 1
                key = self._key({self.key_field: ids[j]} if ids is not None else None, n, seen)
                where = f"{self.path}:row {n - 1}"
                if not key:
                    yield RawDoc(f"{self.path.stem}-{n:09d}-dup", where, None, "duplicate_key")
                elif not isinstance(text, (str, bytes)):
                    yield RawDoc(key, where, None, "empty" if text is None else f"bad_record: {type(text).__name__}")
                else:
                    yield RawDoc(key, where, text)


KINDS = {"folder": FolderSource, "jsonl": JsonlSource, "parquet": ParquetSource}


def detect_text_source(path: str | os.PathLike) -> str | None:
    """The text source kind a path looks like (``folder`` when a directory holds ``.txt``/``.md``
    files and no image class folders, ``jsonl``, ``parquet``), or None: what a CLI asks first to
    tell a text source from an image one."""
    p = Path(path)
    if p.is_file():
        s = p.name.lower()
        return "jsonl" if s.endswith((".jsonl", ".jsonl.txt")) else "parquet" if s.endswith((".parquet", ".pq")) \
            else None
    if p.is_dir():
        suffixes = {f.suffix.lower() for f in p.rglob("*") if f.is_file()}
        if suffixes & set(TEXT_SUFFIXES) and not suffixes & IMAGE_SUFFIXES:
            return "folder"
    return None


def open_text_source(path: str | os.PathLike, kind: str = "auto", text_field: str = "text",
                     key_field: str | None = "id") -> TextSource:
    p = Path(path)
    if not p.exists():
        raise SourceError(f"text source {p} does not exist")
    if kind == "auto":
        found = detect_text_source(p)
        if found is None:
            raise SourceError(f"{p} is not a text source: give a folder of .txt/.md files, a .jsonl "
                              "or a .parquet file")
        kind = found
    if kind not in KINDS:
        raise SourceError(f"unknown text source kind {kind!r}; known: {sorted(KINDS)}")
    if (kind == "folder") != p.is_dir():
        raise SourceError(f"{p}: a {kind} source must be {'a directory' if kind == 'folder' else 'a file'}")
    return KINDS[kind](p, text_field, key_field)


__all__ = ["RawDoc", "TextSource", "FolderSource", "JsonlSource", "ParquetSource", "detect_text_source",
           "open_text_source"]
