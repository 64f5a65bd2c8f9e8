"""Text sources into token artifacts (stages/data/text) and their reader (storage/tokens.py):
small corpora built in tmp_path."""
from __future__ import annotations

import json
import tarfile

import numpy as np
import pytest

from sluice.errors import ArtifactError, CorruptSample
from sluice.stages.data.split import split_of
from sluice.stages.data.text import TextShardConfig, detect_text_source, shard_text
from sluice.stages.data.text.dedup import Deduplicator, MinHasher, content_hash, jaccard_estimate
from sluice.stages.data.text.sources import open_text_source
from sluice.stages.data.text.tokenizer import ByteTokenizer, load_tokenizer
from sluice.storage.tokens import open_token_split, read_token_manifest

WORDS = [f"w{i}x" for i in range(400)]


def _text(seed: int, n: int = 120) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(WORDS, n)) + "\n"


def _cfg(**kw) -> TextShardConfig:
    base = dict(vocab_size=300, val_fraction=0.2, progress=False, shard_tokens=500)
    return TextShardConfig(**{**base, **kw})


def _folder(root, n=20, start=0):
    root.mkdir(parents=True, exist_ok=True)
    for i in range(start, start + n):
        (root / f"doc{i:03d}.txt").write_text(_text(i))
    return root


def _all_docs(path, split="train"):
    ts = open_token_split(path, split)
    tok = load_tokenizer(ts.tokenizer_path)
    return ts, tok, {k: tok.decode(ts.doc(i)) for i, k in enumerate(ts.keys)}


def _split_key(split: str, cfg: TextShardConfig, prefix: str) -> str:
    """A key (folder source: ``<name>_txt``) that lands in ``split``."""
    for i in range(10_000):
        if split_of(f"{prefix}{i}_txt", cfg, has_test=False) == split:
            return f"{prefix}{i}"
    raise AssertionError(split)


# ------------------------------------------------------------------ sources

def test_folder_source_round_trip_offsets_keys_sums(tmp_path):
    src = _folder(tmp_path / "src")
    (src / "sub").mkdir()
    (src / "sub" / "notes.md").write_text("# héllo wörld 你好\n\nsome *markdown* text here\n")
    assert detect_text_source(src) == "folder"
    s = shard_text(_cfg(), src, tmp_path / "out")
    m = s.manifest
    assert m.modality == "tokens" and m.dtype == "uint16" and m.tokenizer.kind == "bpe"
    assert sum(m.counts().values()) == 21 and m.splits["val"].docs > 0
    decoded = {}
    for split in ("train", "val"):
        ts, tok, docs = _all_docs(tmp_path / "out", split)
        assert ts.offsets[0] == 0 and ts.offsets[-1] == len(ts.tokens) == m.splits[split].tokens
        assert np.all(np.diff(ts.offsets) > 0) and len(ts.keys) == len(ts.sums) == len(ts.offsets) - 1
        assert ts.eot == tok.eot and ts.eot not in set(ts.tokens.tolist())
        assert int(ts.tokens.max()) < ts.vocab_size
        import zlib
        assert [zlib.crc32(ts.doc(i).tobytes()) for i in range(len(ts))] == ts.sums.tolist()
        decoded.update(docs)
    assert decoded["sub_notes_md"] == (src / "sub" / "notes.md").read_text()
    assert all(decoded[f"doc{i:03d}_txt"] == _text(i) for i in range(20))
    assert (tmp_path / "out" / "LATEST").read_text().strip() == m.fingerprint[:16]
    assert "token artifact" in s.format() and "quarantined: none" in s.format()


def test_jsonl_source_keys_from_id_or_line(tmp_path):
    p = tmp_path / "docs.jsonl"
    rows = [{"id": "alpha", "text": _text(1)}, {"text": _text(2)}, {"id": 7, "text": _text(3)}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert detect_text_source(p) == "jsonl"
    keys = [d.key for d in open_text_source(p).docs()]
    assert keys == ["alpha", "docs-000000002", "7"]
    s = shard_text(_cfg(tokenizer="byte", val_fraction=0.0), p, tmp_path / "out")
    _, _, docs = _all_docs(tmp_path / "out")
    assert docs == {"alpha": _text(1), "docs-000000002": _text(2), "7": _text(3)}
    assert s.manifest.source.kind == "jsonl"


def test_parquet_source(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    p = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c"], "text": [_text(1), _text(2), None]}), p)
    assert detect_text_source(p) == "parquet"
    s = shard_text(_cfg(tokenizer="byte", val_fraction=0.0), p, tmp_path / "out")
    _, _, docs = _all_docs(tmp_path / "out")
    assert docs == {"a": _text(1), "b": _text(2)}
    assert s.manifest.quarantined == {"empty": 1} and s.manifest.quarantine[0].key == "c"


def test_image_folder_is_not_a_text_source(tmp_path):
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "a.png").write_bytes(b"x")
    (tmp_path / "README.txt").write_text("about the images")
    assert detect_text_source(tmp_path) is None


# ------------------------------------------------------------------ tokenizers

def test_bpe_learns_from_train_only(tmp_path):
    cfg = _cfg(vocab_size=600, min_frequency=2)
    src = _folder(tmp_path / "src", 12)
    val_doc = _split_key("val", cfg, "valonly")
    secret = "zqvkjzqvkj"
    (src / f"{val_doc}.txt").write_text((secret + " ") * 200)
    train_doc = _split_key("train", cfg, "trainonly")
    common = "plomphlomp"
    (src / f"{train_doc}.txt").write_text((common + " ") * 200)
    s = shard_text(cfg, src, tmp_path / "out")
    assert s.manifest.tokenizer.trained_on == ["train"]
    ts, tok, docs = _all_docs(tmp_path / "out", "val")
    vocab = tok.vocab()
    assert common in vocab  # learnt from a train document...
    assert secret not in vocab and "zq" not in vocab  # ...never from a val one
    i = ts.keys.index(f"{val_doc}_txt")
    assert docs[f"{val_doc}_txt"] == (secret + " ") * 200  # still encodes (byte-level), round trips
    assert len(ts.doc(i)) > 200 * 2


def test_byte_tokenizer_round_trip(tmp_path):
    tok = ByteTokenizer()
    text = "héllo\twörld 你好 🎉\n"
    ids = tok.encode_batch([text])[0]
    assert ids.max() < 256 and tok.decode(ids) == text and tok.eot == 256 and tok.vocab_size == 257
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text(text)
    s = shard_text(_cfg(tokenizer="byte", val_fraction=0.0), src, tmp_path / "out")
    ts = open_token_split(tmp_path / "out", "train")
    assert ts.eot == 256 and ts.vocab_size == 257 and s.manifest.dtype == "uint16"
    assert bytes(ts.doc(0).astype(np.uint8)) == text.encode()
    assert load_tokenizer(ts.tokenizer_path).decode(ts.doc(0)) == text


# ------------------------------------------------------------------ dedup

def test_exact_and_near_duplicates_are_dropped_and_counted(tmp_path):
    src = _folder(tmp_path / "src", 10)
    (src / "zz_copy.txt").write_text(_text(3))  # exact
    words = _text(4).split()
    words[60] = "changed"
    (src / "zz_near.txt").write_text(" ".join(words) + "\n")  # one word of 120
    s = shard_text(_cfg(), src, tmp_path / "out")
    d = s.manifest.dropped
    assert (d.exact_duplicates, d.near_duplicates) == (1, 1)
    assert d.duplicate_of == {"zz_copy_txt": "doc003_txt", "zz_near_txt": "doc004_txt"}
    kept = [k for split in s.manifest.splits for k in open_token_split(tmp_path / "out", split).keys]
    assert len(kept) == 10 and "zz_copy_txt" not in kept and "zz_near_txt" not in kept
    assert "dropped 1 exact and 1 near duplicates" in s.format()
    s2 = shard_text(_cfg(dedup=False), src, tmp_path / "out2")
    assert sum(s2.manifest.counts().values()) == 12


def test_where_the_parts_are_cut_changes_no_byte(tmp_path, monkeypatch):
    """The signatures and tokens are computed in parts of consecutive documents (on a Ray
    cluster with ``engine: ray``, tests/test_ray_engine.py): parts of 3 documents or of one
    give the artifact parts of 1,024 give, copies dropped alike."""
    from sluice.stages.data.text import parts
    src = _folder(tmp_path / "src", 14)
    (src / "zz_copy.txt").write_text(_text(3))
    words = _text(4).split()
    words[60] = "changed"
    (src / "zz_near.txt").write_text(" ".join(words) + "\n")

    def written(out):
        m = shard_text(_cfg(), src, out).manifest
        return [f.sha256 for f in m.files()] + [m.tokenizer.file.sha256], m.dropped.model_dump()
    whole = written(tmp_path / "whole")
    calls = []
    real = parts.encode_part
    monkeypatch.setattr(parts, "PART_DOCS", 3)
    monkeypatch.setattr("sluice.stages.data.text.shard.encode_part", lambda p: calls.append(len(p[1])) or real(p))
    assert written(tmp_path / "threes") == whole and len(calls) >= 4 and max(calls) == 3
    monkeypatch.setattr(parts, "PART_DOCS", 1)
    assert written(tmp_path / "ones") == whole
    assert whole[1]["exact_duplicates"] == 1 and whole[1]["near_duplicates"] == 1


def test_the_lsh_buckets_found_a_band_a_part_give_the_same_verdicts(tmp_path, monkeypatch):
    """The LSH buckets of the whole corpus found beforehand, one part per band (on the engine
    with ``engine: ray``: ``text/parts.bucket_part``), drop exactly the documents, for exactly
    the kept ones, that each band's bytes as buckets drop: near copies of near copies, a copy
    of a dropped copy, chains of edits."""
    import random

    from sluice.stages.data.text import scan as scan_mod
    from sluice.stages.data.text.parts import bucket_part
    band, ids = bucket_part((2, np.array([[1, 2], [3, 4], [1, 2], [5, 6], [3, 4]], np.uint32)))
    assert band == 2 and ids.tolist() == [0, 1, 0, 3, 1]
    rnd = random.Random(0)
    src = _folder(tmp_path / "src", 30)
    for i in range(60):  # edits of edits: some near their origin, some only near a copy
        words = _text(i % 7, 150).split()
        for _ in range(rnd.randrange(1, 6)):
            words[rnd.randrange(len(words))] = f"w{rnd.randrange(10**6)}"
        (src / f"zz_{i:03d}.txt").write_text(" ".join(words) + "\n")

    def verdicts(out):
        m = shard_text(_cfg(), src, out).manifest
        return [f.sha256 for f in m.files()], m.dropped.model_dump()
    calls = []
    real = scan_mod._buckets
    monkeypatch.setattr(scan_mod, "_buckets", lambda *a: calls.append(1) or real(*a))
    by_parts = verdicts(tmp_path / "parts")
    assert calls  # the buckets were found a band a part
    monkeypatch.setattr(scan_mod, "_buckets", lambda *a: None)  # each band's bytes as its bucket
    assert verdicts(tmp_path / "bytes") == by_parts
    assert by_parts[1]["near_duplicates"] >= 8, by_parts[1]
    assert any(k.startswith("zz_") for k in by_parts[1]["duplicate_of"].values())  # kept for a copy, not the origin


def test_near_duplicate_threshold_above_and_below():
    a = _text(5, 200)
    words = a.split()
    for j in range(0, 200, 25):  # 8 words changed: true shingle Jaccard ~0.67
        words[j] = f"new{j}"
    b = " ".join(words) + "\n"
    h = MinHasher(128, 5, 0)
    est = jaccard_estimate(h.signature(a), h.signature(b))
    assert 0.45 < est < 0.9
    for threshold, dropped in ((0.4, True), (0.95, False)):
        d = Deduplicator(threshold, 128, 5, 0)
        assert d.check("a", content_hash(a.encode()), d.hasher.signature(a)) is None
        hit = d.check("b", content_hash(b.encode()), d.hasher.signature(b))
        assert (hit == ("near", "a")) is dropped
    assert MinHasher(128, 5, 0).signature(a).tolist() == h.signature(a).tolist()  # deterministic


# ------------------------------------------------------------------ quarantine

def test_bad_documents_are_quarantined_good_ones_kept(tmp_path):
    src = _folder(tmp_path / "src", 6)
    (src / "bad.txt").write_bytes(b"good start \xff\xfe bad bytes")
    (src / "blank.txt").write_text("   \n\n")
    (src / "huge.txt").write_text("y " * 3000)
    s = shard_text(_cfg(max_doc_bytes=4000), src, tmp_path / "out")
    m = s.manifest
    assert m.quarantined == {"utf8": 1, "empty": 1, "oversize": 1}
    assert {q.key for q in m.quarantine} == {"bad_txt", "blank_txt", "huge_txt"}
    assert sum(m.counts().values()) == 6
    root = tmp_path / "out" / m.fingerprint[:16]
    assert (root / "quarantine" / "bad_txt.bin").read_bytes() == b"good start \xff\xfe bad bytes"
    reasons = [json.loads(x) for x in (root / "quarantine" / "reasons.jsonl").read_text().splitlines()]
    assert {r["key"]: r["reason"].split(":")[0] for r in reasons} == \
        {"bad_txt": "utf8", "blank_txt": "empty", "huge_txt": "oversize"}
    assert "quarantined: 1 empty, 1 oversize, 1 utf8" in s.format()


def test_bad_jsonl_records_are_quarantined(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'{"id": "ok", "text": "fine text"}\n{"id": "x", "text": "\xff"}\n{"id": "n", "body": 1}\n'
                  b'{"id": "s", "text": "\\udc80 lone"}\n{"id": "ok", "text": "again"}\n')
    m = shard_text(_cfg(tokenizer="byte", val_fraction=0.0), p, tmp_path / "out").manifest
    assert m.counts()["train"] == 1
    assert m.quarantined == {"utf8": 2, "bad_record": 1, "duplicate_key": 1}


# ------------------------------------------------------------------ versions

def test_idempotent_reshard_writes_nothing(tmp_path):
    src = _folder(tmp_path / "src", 8)
    first = shard_text(_cfg(), src, tmp_path / "out")
    tokens = tmp_path / "out" / first.manifest.fingerprint[:16] / "train" / "tokens.bin"
    mtime = tokens.stat().st_mtime_ns
    again = shard_text(_cfg(), src, tmp_path / "out")
    assert again.reused and again.root == first.root and tokens.stat().st_mtime_ns == mtime
    assert again.manifest.fingerprint == first.manifest.fingerprint
    other = shard_text(_cfg(vocab_size=320), src, tmp_path / "out")
    assert not other.reused and other.root != first.root


def test_grown_source_new_version_with_parent_and_stable_splits(tmp_path):
    src = _folder(tmp_path / "src", 30)
    cfg = _cfg()
    first = shard_text(cfg, src, tmp_path / "out").manifest
    before = {s: open_token_split(tmp_path / "out", s) for s in ("train", "val")}
    old = {k: (s, before[s].doc(i).tolist()) for s in before for i, k in enumerate(before[s].keys)}
    _folder(src, 10, start=30)
    (src / "doc005.txt").write_text(_text(999))  # changed
    (src / "doc007.txt").unlink()  # removed
    grown = shard_text(cfg, src, tmp_path / "out")
    m = grown.manifest
    assert not grown.reused and m.parent == first.fingerprint[:16]
    assert m.ancestors == [first.fingerprint] and m.tokenizer.from_version == first.fingerprint[:16]
    assert m.delta.changed == ["doc005_txt"] and m.delta.removed == ["doc007_txt"]
    assert sum(m.delta.added.values()) == 11 and m.delta.reused_docs == 28
    after = {s: open_token_split(tmp_path / "out", s) for s in ("train", "val")}
    now = {k: (s, after[s].doc(i).tolist()) for s in after for i, k in enumerate(after[s].keys)}
    for k, (s, ids) in old.items():
        if k not in ("doc005_txt", "doc007_txt"):
            assert now[k] == (s, ids)  # same split, same tokens (the parent's tokenizer kept)
    assert "doc007_txt" not in now and now["doc005_txt"][0] == old["doc005_txt"][0]
    for s in ("train", "val"):
        assert split_of("doc035_txt", cfg, False) != s or "doc035_txt" in after[s].keys
    # parent's tar shards before the first removed document are listed, not rewritten
    reused = [sh for sh in m.splits["train"].shards if sh.tar.version == first.fingerprint[:16]]
    assert reused and m.delta.reused_bytes > 0
    for s in after.values():
        s.verify(deep=True)
    assert shard_text(cfg, src, tmp_path / "out").reused  # the grown source again: nothing new
    assert f"on top of {first.fingerprint[:16]}" in grown.format()


# ------------------------------------------------------------------ verify and shards

def test_verify_catches_a_flipped_byte_naming_the_document(tmp_path):
    src = _folder(tmp_path / "src", 10)
    m = shard_text(_cfg(), src, tmp_path / "out").manifest
    ts = open_token_split(tmp_path / "out", "train")
    ts.verify(deep=True)
    i = 3
    pos = int(ts.offsets[i]) * ts.dtype.itemsize + 1
    path = tmp_path / "out" / m.fingerprint[:16] / "train" / "tokens.bin"
    raw = bytearray(path.read_bytes())
    raw[pos] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(ArtifactError, match="sha256"):
        open_token_split(tmp_path / "out", "train").verify(deep=True)
    with pytest.raises(CorruptSample, match=f"document {i} \\(key '{ts.keys[i]}'\\)") as e:
        open_token_split(tmp_path / "out", "train").verify(deep=False)
    assert e.value.key == ts.keys[i] and e.value.index == i
    (tmp_path / "out" / m.fingerprint[:16] / "train" / "offsets.npy").write_bytes(b"junk")
    with pytest.raises(ArtifactError, match="offsets.npy"):
        open_token_split(tmp_path / "out", "train")


def test_tar_shards_hold_the_same_tokens(tmp_path):
    src = _folder(tmp_path / "src", 20)
    m = shard_text(_cfg(shard_tokens=300), src, tmp_path / "out").manifest
    ts = open_token_split(tmp_path / "out", "train")
    rec = m.splits["train"]
    assert len(rec.shards) > 1 and sum(sh.count for sh in rec.shards) == rec.docs
    seen = []
    for sh in rec.shards:
        with tarfile.open(ts.path(sh.tar)) as t:
            members = {mm.name: t.extractfile(mm).read() for mm in t}
        for j in range(sh.count):
            i = sh.first_doc + j
            key = ts.keys[i]
            assert np.frombuffer(members[f"{key}.tokens"], "<u2").tolist() == ts.doc(i).tolist()
            assert np.frombuffer(members[f"{key}.idx"], "<i8")[0] == i
            seen.append(i)
    assert seen == list(range(rec.docs))
    assert read_token_manifest(tmp_path / "out").fingerprint == m.fingerprint


def test_sources_of_one_mixture_share_a_tokenizer(tmp_path):
    """The second source uses the first one's tokenizer (tokenizer_file), so their ids mix."""
    a = shard_text(_cfg(), _folder(tmp_path / "a", 12), tmp_path / "out-a")
    p = tmp_path / "b.jsonl"
    p.write_text("".join(json.dumps({"id": f"b{i}", "text": _text(100 + i)}) + "\n" for i in range(6)))
    b = shard_text(_cfg(tokenizer_file=a.root), p, tmp_path / "out-b")
    ta, tb = a.manifest.tokenizer, b.manifest.tokenizer
    assert (ta.file.sha256, ta.eot, ta.vocab_size) == (tb.file.sha256, tb.eot, tb.vocab_size)
    assert tb.trained_on == []
    _, tok, docs = _all_docs(tmp_path / "out-b")
    assert all(docs[k] == _text(100 + int(k[1:])) for k in docs)


def test_the_cli_shards_a_text_folder_and_verify_names_a_damaged_document(tmp_path, capsys):
    """``sluice shard`` takes text (its settings by --set) and writes a token artifact; ``sluice
    verify`` checks it, and after one flipped byte exits 1 naming the document."""
    from sluice.flows.cli import main
    src = tmp_path / "notes"
    src.mkdir()
    for i in range(12):
        (src / f"n{i}.md").write_text(f"# note {i}\n" + "packed rows of tokens " * (i + 1))
    out = tmp_path / "art"
    assert main(["shard", str(src), "--out", str(out), "--quiet", "--set", "tokenizer=byte",
                 "--set", "val_fraction=0"]) == 0
    assert "token artifact" in capsys.readouterr().out
    assert open_token_split(out, "train").vocab_size == 257
    assert main(["verify", str(out), "--full"]) == 0
    assert "every document matches" in capsys.readouterr().out
    train = open_token_split(out, "train")
    path, at = train.path(train.record.tokens_file), int(train.offsets[3]) * train.dtype.itemsize
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    assert main(["verify", str(out)]) == 1
    assert "document 3" in capsys.readouterr().out


def test_gc_keeps_the_files_a_kept_token_version_reuses(tmp_path):
    """``sluice gc`` on a root of token versions: older manifests go, the files a kept version
    still reads from its parent stay, and the kept version verifies."""
    from sluice.storage.gc import collect
    src = tmp_path / "notes"
    src.mkdir()
    out = tmp_path / "art"
    cfg = TextShardConfig(tokenizer="byte", val_fraction=0, progress=False, shard_tokens=200)
    for night in range(3):
        for i in range(10 * night, 10 * night + 10):
            (src / f"n{i:03d}.txt").write_text(f"note {i} " + "grows nightly " * (i % 4 + 1))
        shard_text(cfg, src, out)
    versions = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert len(versions) == 3
    report = collect(out, keep=1)
    assert len(report.versions_removed) == 2 and report.ok
    latest = open_token_split(out, "train")
    latest.verify(deep=True)
    assert len(latest) == 30
