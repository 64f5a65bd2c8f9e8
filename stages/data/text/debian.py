"""Real text that ships as Debian packages, turned into three text sources of one mixture:

* ``gcide.jsonl``  (dict-gcide): one dictionary entry a document, keyed by headword and offset;
* ``fortunes.parquet`` (fortunes, fortunes-min): one fortune a document (files split on ``%``),
  keyed by file and number; a Parquet file, so the demo covers that reader too;
* ``pydocs/``      (python3.11-doc): the reStructuredText sources of the Python docs, one file a
  document, a folder of ``.txt``.

``python -m sluice.stages.data.text.debian OUT [--limit N]`` writes them; ``apt-get install
dict-gcide fortunes python3.11-doc`` first (scripts/setup.sh does). Output is a pure function of
the installed packages and ``limit``, so re-running it re-shards to the same versions.
"""
from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from sluice.errors import SourceError
from sluice.storage import atomic

GCIDE = Path("/usr/share/dictd")
FORTUNES = Path("/usr/share/games/fortunes")
PYDOCS = Path("/usr/share/doc/python3.11/html/_sources")
_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _b64(s: str) -> int:
    """dictd's index numbers: base 64 digits, most significant first."""
    n = 0
    for c in s:
        n = n * 64 + _B64.index(c)
    return n


def _need(path: Path, package: str) -> None:
    if not path.exists():
        raise SourceError(f"{path} is missing: apt-get install {package}")


def gcide_jsonl(out: Path, limit: int | None = None, base: Path = GCIDE) -> Path:
    """Each distinct dictionary entry (by its offset in the dictionary) as a JSON line."""
    index, data = base / "gcide.index", base / "gcide.dict.dz"
    _need(index, "dict-gcide")
    raw = gzip.decompress(data.read_bytes())  # dictzip is gzip: ~40 MB
    lines, seen = [], set()
    for row in index.read_text(encoding="utf-8").splitlines():
        word, off, size = row.split("\t")[:3]
        if word.startswith("00-database") or off in seen:
            continue
        seen.add(off)
        o, n = _b64(off), _b64(size)
        lines.append(json.dumps({"id": f"{word}-{o}", "text": raw[o:o + n].decode("utf-8", "replace")},
                                ensure_ascii=False))
        if limit and len(lines) >= limit:
            break
    path = out / "gcide.jsonl"
    atomic.write_bytes(path, ("\n".join(lines) + "\n").encode())
    return path


def fortunes_parquet(out: Path, limit: int | None = None, base: Path = FORTUNES) -> Path:
    """Every fortune of every cookie file (the ``.u8`` and ``.dat`` companions skipped)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    _need(base / "fortunes", "fortunes-min")
    ids, texts = [], []
    for f in sorted(p for p in base.iterdir() if p.is_file() and not p.suffix and not p.is_symlink()):
        for n, text in enumerate(f.read_bytes().decode("utf-8", "replace").split("\n%\n")):
            if text.strip():
                ids.append(f"{f.name}-{n}")
                texts.append(text.strip("%\n") + "\n")
    if limit:
        ids, texts = ids[:limit], texts[:limit]
    path = out / "fortunes.parquet"
    atomic.write_with(path, lambda tmp: pq.write_table(pa.table({"id": ids, "text": texts}), tmp))
    return path


def pydocs_folder(out: Path, limit: int | None = None, base: Path = PYDOCS) -> Path:
    """The Python docs' ``.rst.txt`` sources copied as ``.txt`` files (paths kept: the keys)."""
    _need(base, "python3.11-doc")
    files = sorted(base.rglob("*.txt"))[:limit or None]
    dest = out / "pydocs"
    for f in files:
        atomic.write_bytes(dest / f.relative_to(base), f.read_bytes())
    return dest


def build_corpus(out: str | Path, limit: int | None = None) -> dict[str, Path]:
    """The three sources under ``out``: ``{"gcide": .jsonl, "fortunes": .parquet, "pydocs": folder}``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return {"gcide": gcide_jsonl(out, limit), "fortunes": fortunes_parquet(out, limit),
            "pydocs": pydocs_folder(out, limit)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--limit", type=int, default=None, help="documents per source (default: all)")
    ap.add_argument("--shard", metavar="DATA_ROOT", help="also shard each source into DATA_ROOT/datasets/<name>, "
                    "all with one tokenizer learnt from the train documents of all three (kept in "
                    "DATA_ROOT/tokenizers), so they mix: where the pipeline on data_root DATA_ROOT puts them")
    ap.add_argument("--tokenizer", default="bpe", choices=["bpe", "byte"])
    args = ap.parse_args(argv)
    sources = build_corpus(args.out, args.limit)
    for name, path in sources.items():
        print(f"{name}: {path}")
    if args.shard:
        from sluice.stages.data.text.config import TextShardConfig
        from sluice.stages.data.text.shard import shard_text
        from sluice.stages.data.text.shared_tokenizer import shared_tokenizer
        cfg = TextShardConfig(tokenizer=args.tokenizer)
        tok = shared_tokenizer(list(sources.items()), cfg, Path(args.shard) / "tokenizers", log=print)
        for name, path in sources.items():  # one tokenizer for the mixture, learnt from all of them
            s = shard_text(cfg.model_copy(update={"tokenizer_file": str(tok)}), path,
                           Path(args.shard) / "datasets" / name)
            print(s.format())


if __name__ == "__main__":
    main()
