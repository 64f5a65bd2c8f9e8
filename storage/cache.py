"""A local, size-limited cache of verified copies of a remote artifact's files (S3 and friends).

Loaders read local files (``pread``, mmap). For an artifact on object storage each file is
fetched once into ``<cache dir>/<fingerprint[:16]>/<path>``: downloaded to a temp name while it
is hashed, checked against the manifest's size and sha256, and only then renamed into place, so
a reader can only ever open a verified file. A corrupt or truncated download is retried
(``retries`` times, with backoff), then fails with an ``ArtifactError`` naming the object.

The cache keeps at most ``max_bytes``: publishing a file first evicts the least recently used
ones (a file a reader still holds open stays readable until it is closed). ``prefetch(plan)``
fetches files ahead of need in a background thread, at most ``ahead`` files past the reader's
position (``advance``). Processes share a cache directory safely (file locks), so forked
DataLoader workers wait for a fetch in progress instead of repeating it.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

from sluice.errors import ArtifactError
from sluice.process_rules import parent_only_fd
from sluice.storage.manifest import FileRecord
from sluice.storage.paths import filesystem, version_file

CHUNK = 4 << 20


def default_cache_dir() -> Path:
    """``$SLUICE_CACHE_DIR``, else ``~/.cache/sluice/artifacts``."""
    env = os.environ.get("SLUICE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "sluice" / "artifacts"


class ArtifactCache:
    """Verified local copies of the files of one remote artifact (``root``)."""

    def __init__(self, root: str, fingerprint: str, cache_dir: str | os.PathLike | None = None,
                 max_bytes: int | None = None, retries: int = 3, ahead: int = 2):
        self.root = root
        self.dir = Path(cache_dir or default_cache_dir()).expanduser() / fingerprint[:16]
        # a file reused from an ancestor version is cached under that version's name, shared
        # with every reader of the ancestor and of its other descendants
        self.max_bytes, self.retries, self.ahead = max_bytes, retries, ahead
        self.stats = {"fetched": 0, "fetched_bytes": 0, "hits": 0, "retried": 0, "evicted": 0,
                      "fetch_s": 0.0}
        self._plan: list[FileRecord] = []
        self._plan_gen = 0  # bumped by each prefetch(): the thread starts the new plan afresh
        self._pos = -1
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def __getstate__(self):  # into worker processes: settings only, no thread
        state = dict(self.__dict__)
        state.update(_cond=None, _thread=None, _plan=[], _plan_gen=0, _pos=-1, _error=None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._cond = threading.Condition()

    # ------------------------------------------------------------------ reading
    def __call__(self, rec: FileRecord) -> Path:
        """The local path of ``rec``: verified, fetched now if it is not cached yet."""
        path = self._local(rec)
        if self._present(path, rec):
            self.stats["hits"] += 1
            with contextlib.suppress(OSError):
                os.utime(path)  # recency for eviction
            return path
        return self.fetch(rec)

    def _present(self, path: Path, rec: FileRecord) -> bool:
        try:
            return path.stat().st_size == rec.bytes
        except OSError:
            return False

    def _local(self, rec: FileRecord) -> Path:
        if rec.version is None:
            return self.dir / rec.path
        version_file(self.root, rec.path, rec.version)  # validates the name
        return self.dir.parent / rec.version / rec.path

    def fetch(self, rec: FileRecord) -> Path:
        path = self._local(rec)
        with self._lock(f"file-{rec.sha256[:24]}"):
            if self._present(path, rec):  # another process or thread fetched it meanwhile
                return path
            t = time.perf_counter()
            tmp = self._download(rec, path)
            with self._lock("index"):
                self._make_room(rec.bytes, keep=path)
                os.replace(tmp, path)
            self.stats["fetched"] += 1
            self.stats["fetched_bytes"] += rec.bytes
            self.stats["fetch_s"] += time.perf_counter() - t
        return path

    def _download(self, rec: FileRecord, path: Path) -> Path:
        url = version_file(self.root, rec.path, rec.version)
        fs, remote = filesystem(url)
        path.parent.mkdir(parents=True, exist_ok=True)
        problem = ""
        for attempt in range(self.retries + 1):
            if attempt:
                self.stats["retried"] += 1
                time.sleep(min(2.0, 0.1 * 2 ** attempt))
                with contextlib.suppress(AttributeError):
                    fs.invalidate_cache(remote)
            tmp = path.with_name(f".tmp-{uuid.uuid4().hex[:12]}-{path.name}")
            h, n = hashlib.sha256(), 0
            try:
                with fs.open(remote, "rb", block_size=CHUNK) as src, open(tmp, "wb") as out:
                    while chunk := src.read(CHUNK):
                        h.update(chunk)
                        out.write(chunk)
                        n += len(chunk)
            except FileNotFoundError:
                tmp.unlink(missing_ok=True)
                raise ArtifactError(f"artifact file missing on the server: {url}") from None
            except Exception as e:  # noqa: BLE001 - a dropped connection is retried like a bad body
                tmp.unlink(missing_ok=True)
                problem = f"download failed ({type(e).__name__}: {e})"
                continue
            if n != rec.bytes:
                problem = f"downloaded {n} bytes, manifest says {rec.bytes} (truncated)"
            elif h.hexdigest() != rec.sha256:
                problem = f"sha256 {h.hexdigest()[:16]}…, manifest says {rec.sha256[:16]}… (corrupted)"
            else:
                return tmp
            tmp.unlink(missing_ok=True)
        raise ArtifactError(f"{url}: {problem}, after {self.retries + 1} attempts; nothing of it "
                            "was used")

    # ------------------------------------------------------------------ size limit
    def _files(self) -> Iterator[Path]:
        for p in self.dir.rglob("*"):
            if p.is_file() and not p.name.startswith(".") and p.parent.name != ".locks":
                yield p

    def cached_bytes(self) -> int:
        return sum(p.stat().st_size for p in self._files())

    def _make_room(self, need: int, keep: Path) -> None:
        if self.max_bytes is None:
            return
        if need > self.max_bytes:
            raise ArtifactError(f"the cache limit ({self.max_bytes} bytes) is smaller than one file "
                                f"of the artifact ({need} bytes, {keep.name}); raise cache.max_bytes")
        files = sorted(((p.stat().st_mtime, p.stat().st_size, p) for p in self._files() if p != keep),
                       key=lambda t: t[0])
        total = sum(s for _, s, _ in files)
        for _, size, p in files:
            if total + need <= self.max_bytes:
                break
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                self.stats["evicted"] += 1
            total -= size

    @contextlib.contextmanager
    def _lock(self, name: str) -> Iterator[None]:
        """Hold the cache-wide lock ``name`` (an flock on ``.locks/name``). Its descriptor is
        this process's only: a DataLoader worker forked while the prefetch thread holds it must
        not keep it held (``sluice.process_rules``, rule 5)."""
        d = self.dir / ".locks"
        d.mkdir(parents=True, exist_ok=True)
        with parent_only_fd(d / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600) as fd:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield

    # ------------------------------------------------------------------ ahead of need
    def prefetch(self, plan: list[FileRecord]) -> None:
        """Fetch ``plan`` (files in the order they will be needed) in a background thread,
        at most ``ahead`` files past the position given to ``advance``."""
        with self._cond:
            self._plan, self._pos, self._error = list(plan), -1, None
            self._plan_gen += 1
            self._cond.notify_all()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="sluice-prefetch", daemon=True)
                self._thread.start()

    def advance(self, pos: int) -> None:
        """The reader now needs ``plan[pos]``: the thread may run ``ahead`` files past it."""
        with self._cond:
            if pos > self._pos:
                self._pos = pos
                self._cond.notify_all()
            if self._error is not None:
                e, self._error = self._error, None
                raise e

    def _run(self) -> None:
        done: set[str] = set()
        gen = -1
        while True:
            with self._cond:
                if gen != self._plan_gen:  # a new plan: every file of it is to be fetched again
                    gen, done = self._plan_gen, set()
                todo = [(k, r) for k, r in enumerate(self._plan[: self._pos + 1 + self.ahead])
                        if (r.version, r.path) not in done]
                if not todo:
                    self._cond.wait(timeout=1.0)
                    continue
                k, rec = todo[0]
            try:
                self(rec)
            except BaseException as e:  # noqa: BLE001 - handed to the reader at its next advance
                with self._cond:
                    self._error = e
            done.add((rec.version, rec.path))
