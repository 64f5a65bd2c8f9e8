"""The ffcv backend over a split whose ``.beton`` is in several parts (an incremental version's
``SplitRecord.ffcv_parts``): every sample read from the parts equals what a single-file split
gives, in exactly the order asked for, across batch sizes that straddle parts and from any resume
point; damage in a later part is caught (fail) or dropped (skip); a relabelled sample is yielded
with its new label, its stored one still checked.

The artifacts are written by hand (``formats.beton`` and a manifest), not by the shard stage,
so these tests hold whatever the shard stage writes today."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from sluice.errors import CorruptSample
from sluice.stages.data.formats import beton
from sluice.stages.load.integrity import Guard
from sluice.storage.artifact import open_artifact
from sluice.storage.fingerprint import sha256_file
from sluice.storage.manifest import (FfcvPart, FieldSpecs, FileRecord, ImageFieldSpec, LabelFieldSpec, Manifest,
                                     Relabel, SourceRecord, SplitRecord, write_manifest)
from sluice.storage.sums import make_sums

pytest.importorskip("ffcv")
pytestmark = pytest.mark.timeout(300)

N, SHAPE, CLASSES = 300, (12, 10, 3), 7
BOUNDS = (0, 110, 230)  # the parts' first indices: [0, 110), [110, 230), [230, 300)


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (N, *SHAPE), dtype=np.uint8), rng.integers(0, CLASSES, N).astype(np.int64)


def _record(root: Path, rel: str) -> FileRecord:
    path = root / rel
    return FileRecord(path=rel, bytes=path.stat().st_size, sha256=sha256_file(path))


def _npy(path: Path, arr: np.ndarray) -> None:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    path.write_bytes(buf.getvalue())


def _page(sample_bytes: int | None, later: bool) -> int:
    """A later part's page as the shard stage writes it (small pages, where it has them)."""
    if later and hasattr(beton, "PART_PAGE_SIZE"):
        return beton.page_size_for(sample_bytes, small=True)
    return beton.page_size_for(sample_bytes)


def write_artifact(root: Path, images: np.ndarray, labels: np.ndarray, bounds=BOUNDS, jpg: bool = False,
                   relabel: dict[int, int] | None = None) -> Path:
    """A one-split (``train``) ffcv-only artifact whose .beton is cut at ``bounds`` (each part's
    records' ``index`` the split index, FFCV's sample ids from 0 per file), with labels.npy,
    keys.txt, sums.npy and a manifest. ``relabel`` (index -> new label) writes the new label to
    labels.npy and the old one to the .beton, with the manifest's ``relabelled`` entries."""
    split = root / "train"
    split.mkdir(parents=True)
    n = len(images)
    image = beton.RGBImageField(mode="jpg", jpeg_quality=90) if jpg else beton.NDArrayField(np.dtype("uint8"), SHAPE)
    fields = {"image": image, "label": beton.IntField(), "index": beton.IntField(), "key": beton.BytesField()}
    keys = [f"s{i:05d}" for i in range(n)]
    edges = [*bounds, n]
    parts, crcs = [], []
    for first, end in zip(edges, edges[1:]):
        rel = "train/data.beton" if first == 0 else f"train/data-{first:010d}.beton"
        samples = ((images[i], labels[i], i, np.frombuffer(keys[i].encode(), np.uint8)) for i in range(first, end))
        with open(root / rel, "w+b") as fp:
            crcs.append(beton.write_beton(fp, fields, samples, end - first, _page(None if jpg else int(np.prod(SHAPE)),
                                                                                first > 0), checksum="image"))
        parts.append(FfcvPart(file=_record(root, rel), first_index=first, count=end - first))
    new = labels.copy()
    for i, label in (relabel or {}).items():
        new[i] = label
    _npy(split / "labels.npy", new)
    (split / "keys.txt").write_text("".join(k + "\n" for k in keys))
    _npy(split / "sums.npy", make_sums(n, ffcv=np.concatenate(crcs)))
    rec = SplitRecord(count=n, ffcv=parts[0].file, ffcv_parts=parts[1:], labels=_record(root, "train/labels.npy"),
                      keys=_record(root, "train/keys.txt"), sums=_record(root, "train/sums.npy"),
                      class_counts=np.bincount(new, minlength=CLASSES).tolist(),
                      relabelled=[Relabel(index=i, stored=int(labels[i])) for i in sorted(relabel or {})])
    enc = "jpg" if jpg else "npy"
    manifest = Manifest(fingerprint=f"test-{root.name}", content_sha256="0" * 64,
                        source=SourceRecord(kind="arrays", uri=str(root), fingerprint="test"), config={},
                        fields=FieldSpecs(image=ImageFieldSpec(encoding=enc, shape=SHAPE,
                                                               ffcv_field="rgb_image" if jpg else "ndarray"),
                                          label=LabelFieldSpec(num_classes=CLASSES)),
                        splits={"train": rec}, formats=["ffcv"])
    write_manifest(root, manifest)
    return root


@pytest.fixture(scope="module")
def arts(tmp_path_factory) -> dict:
    images, labels = _data()
    base = tmp_path_factory.mktemp("parts")
    return {"images": images, "labels": labels,
            "single": write_artifact(base / "single", images, labels, bounds=(0,)),
            "parts": write_artifact(base / "parts", images, labels)}


def _backend(root: Path, batch_size: int, policy: str = "fail"):
    from sluice.stages.load.backends.ffcv import FfcvBackend
    art = open_artifact(root)
    return FfcvBackend(art, "train", 1, batch_size, Guard(art, "train", policy, 0.05))


def _read(backend, order, batch_size, drop_last=False, start_batch=0):
    return [(np.asarray(x), np.asarray(y), np.asarray(i))
            for x, y, i in backend.epoch(order, batch_size, drop_last, start_batch)]


def _expect_batches(batches, order, batch_size, images, labels, start_batch=0, drop_last=False):
    stop = len(order) // batch_size * batch_size if drop_last else len(order)
    lo = start_batch * batch_size
    assert len(batches) == len(range(lo, stop, batch_size))
    for x, y, idx in batches:
        hi = min(lo + batch_size, stop)
        assert np.array_equal(idx, order[lo:hi])
        assert np.array_equal(x, images[idx])
        assert np.array_equal(y, labels[idx])
        lo = hi
    assert lo == stop


def test_parts_manifest_is_what_the_backend_reads(arts):
    rec = open_artifact(arts["parts"]).manifest.split("train")
    assert [(p.first_index, p.count) for p in rec.ffcv_files()] == [(0, 110), (110, 120), (230, 70)]
    b = _backend(arts["parts"], 32)
    assert [(p.first, p.count) for p in b.parts] == [(0, 110), (110, 120), (230, 70)]
    assert [int(p.loader.reader.page_size) for p in b.parts][1:] == [_page(int(np.prod(SHAPE)), True)] * 2
    # the ndarray field's stored pixels are checksummed by each part's readahead, as JPEG bytes are
    assert all(p.image is not None and p.image[2].all() and (p.image[1] == np.prod(SHAPE)).all() for p in b.parts)


@pytest.mark.parametrize("batch_size", [7, 32, 50, 128, 400])
@pytest.mark.slow
def test_shuffled_orders_read_exactly_from_every_part(arts, batch_size):
    """Batch sizes that straddle the parts (and one larger than the split): each batch holds
    exactly ``order[lo:hi]``, pixels and labels as written, and equals the single-file read."""
    images, labels = arts["images"], arts["labels"]
    multi, single = _backend(arts["parts"], batch_size), _backend(arts["single"], batch_size)
    rng = np.random.default_rng(batch_size)
    for order in (rng.permutation(N), np.arange(N), np.arange(N)[::-1].copy(),
                  np.concatenate([np.arange(230, 300), np.arange(0, 230)])):
        got = _read(multi, order, batch_size)
        _expect_batches(got, order, batch_size, images, labels)
        ref = _read(single, order, batch_size)
        assert len(ref) == len(got)
        for a, b in zip(got, ref):
            assert all(np.array_equal(u, v) for u, v in zip(a, b))


@pytest.mark.slow
def test_orders_that_skip_parts_and_repeat_samples(arts):
    """A subset order (a part never met, another met once) and repeated indices."""
    images, labels = arts["images"], arts["labels"]
    b = _backend(arts["parts"], 16)
    rng = np.random.default_rng(3)
    for order in (rng.permutation(np.arange(110, 230)), np.array([5, 250, 5, 120, 250, 299, 0]),
                  rng.integers(0, N, 500)):
        _expect_batches(_read(b, order, 16), order, 16, images, labels)


@pytest.mark.parametrize("start_batch", [0, 3, 9])
@pytest.mark.slow
def test_resume_from_a_middle_batch(arts, start_batch):
    images, labels = arts["images"], arts["labels"]
    b = _backend(arts["parts"], 32)
    order = np.random.default_rng(7).permutation(N)
    _expect_batches(_read(b, order, 32, start_batch=start_batch), order, 32, images, labels, start_batch)
    _expect_batches(_read(b, order, 32, drop_last=True, start_batch=start_batch), order, 32, images, labels,
                    start_batch, drop_last=True)
    assert _read(b, order, 32, start_batch=10) == []


@pytest.mark.slow
def test_an_abandoned_epoch_then_a_full_one(arts):
    """An epoch left after two batches (threads and FFCV iterators stopped) leaves the backend
    ready for the next."""
    images, labels = arts["images"], arts["labels"]
    b = _backend(arts["parts"], 40)
    order = np.random.default_rng(1).permutation(N)
    it = b.epoch(order, 40, False)
    next(it), next(it)
    it.close()
    _expect_batches(_read(b, order, 40), order, 40, images, labels)
    assert b.timings  # timed as ever


def _damage_second_part(root: Path, victim: int) -> None:
    """16 bytes inside ``victim``'s stored pixels, in the part holding it (the second)."""
    path = root / "train" / "data-0000000110.beton"
    _, _, meta, _ = beton.read_layout(str(path))
    ptr = int(meta[meta.dtype.names[0]][victim - 110])
    with open(path, "r+b") as f:
        f.seek(ptr + 100)
        old = f.read(16)
        f.seek(ptr + 100)
        f.write(bytes(b ^ 0xFF for b in old))


@pytest.mark.parametrize("checksum", ["readahead", "decoded"])
@pytest.mark.slow
def test_damage_in_the_second_part_is_caught_or_dropped(arts, tmp_path, monkeypatch, checksum):
    """Caught before its batch is yielded whichever way the ndarray field's checksum was taken:
    by the part's readahead from the stored bytes, or (the readahead behind) from the decoded
    pixels."""
    import shutil
    from sluice.stages.load.readahead import Readahead
    if checksum == "readahead":  # wait for the thread's checksums, as for a JPEG field
        monkeypatch.setattr(Readahead, "poll", Readahead.crcs)
    else:  # the thread never ready
        monkeypatch.setattr(Readahead, "poll", lambda self, b: None)
    images, labels = arts["images"], arts["labels"]
    root = tmp_path / "damaged"
    shutil.copytree(arts["parts"], root)
    victim = 150
    _damage_second_part(root, victim)
    order = np.random.default_rng(5).permutation(N)
    pos = int(np.flatnonzero(order == victim)[0])

    fail = _backend(root, 32)
    seen = []
    with pytest.raises(CorruptSample) as e:
        for x, y, idx in fail.epoch(order, 32, False):
            seen += idx.tolist()
    assert e.value.index == victim and "data-0000000110.beton" in str(e.value)
    assert "image field checksum" in str(e.value)
    assert victim not in seen and seen == order[:pos // 32 * 32].tolist()  # every batch before it

    skip = _backend(root, 32, "skip")
    got = _read(skip, order, 32)
    idx = np.concatenate([i for _, _, i in got])
    assert idx.tolist() == [i for i in order.tolist() if i != victim]
    x = np.concatenate([x for x, _, _ in got])
    assert np.array_equal(x, images[idx]) and np.array_equal(np.concatenate([y for _, y, _ in got]), labels[idx])
    assert skip.guard.skipped == 1 and list(skip.guard.bad) == [victim]


def test_readahead_skips_batches_the_reader_took_without_it(tmp_path):
    """``poll`` does not wait; batches the reader has taken meanwhile are not read at all."""
    import zlib
    from sluice.stages.load.readahead import Readahead
    from sluice.stages.load.timings import Timings
    data = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    path = tmp_path / "f"
    path.write_bytes(data)
    asked = []

    def checked(idx):
        asked.append(int(idx[0]))
        return [int(i) * 100 for i in idx], [50] * len(idx)
    ahead = Readahead(str(path), lambda idx: [], Timings(), ahead=1, checked=checked)
    ahead.start([np.array([b, b + 1]) for b in range(8)])
    try:
        assert ahead.crcs(0).tolist() == [zlib.crc32(data[i * 100:i * 100 + 50]) for i in (0, 1)]
        assert ahead.poll(1) is None  # not waited for: the thread holds at ``ahead`` batches past the reader
        ahead.taken(4)  # batches 1..3 checked by the reader itself
        got = ahead.crcs(4)
        assert got.tolist() == [zlib.crc32(data[i * 100:i * 100 + 50]) for i in (4, 5)]
        assert asked == [0, 4]
    finally:
        ahead.stop()


@pytest.mark.slow
def test_a_relabelled_sample_is_yielded_with_its_new_label(tmp_path):
    """labels.npy holds the new label, the .beton the stored one (``relabelled``): the batch
    carries the new label and nothing is reported as damage."""
    from sluice.stages.load import Loader
    images, labels = _data(1)
    relabel = {4: (int(labels[4]) + 1) % CLASSES, 200: (int(labels[200]) + 3) % CLASSES}
    root = write_artifact(tmp_path / "relabelled", images, labels, relabel=relabel)
    want = labels.copy()
    for i, label in relabel.items():
        want[i] = label
    art = open_artifact(root)
    assert np.array_equal(art.labels("train"), want) and np.array_equal(art.stored_labels("train"), labels)
    b = _backend(root, 32)
    order = np.random.default_rng(2).permutation(N)
    _expect_batches(_read(b, order, 32), order, 32, images, want)
    assert not b.guard.bad

    loader = Loader(root, backend="ffcv", batch_size=64, workers=1)
    seen = {}
    for _, y, idx in loader:
        seen.update(zip(idx.tolist(), y.tolist()))
    assert len(seen) == N and all(seen[i] == want[i] for i in range(N))


@pytest.mark.slow
def test_a_label_changed_in_a_record_is_still_damage(tmp_path):
    """The stored label is what the record is checked against: a record whose label differs
    from it (relabelled or not) is damage, named in its part."""
    images, labels = _data(2)
    root = write_artifact(tmp_path / "relabelled", images, labels, relabel={120: (int(labels[120]) + 1) % CLASSES})
    path = root / "train" / "data-0000000110.beton"
    _, fields, meta, _ = beton.read_layout(str(path))
    at = beton.HEADER.itemsize + beton.FIELD_DESCRIPTOR.itemsize * len(fields) + \
        (120 - 110) * meta.dtype.itemsize + meta.dtype.fields[meta.dtype.names[1]][1]
    with open(path, "r+b") as f:  # the record now holds the new label, not the stored one
        f.seek(at)
        f.write(((int(labels[120]) + 1) % CLASSES).to_bytes(8, "little"))
    with pytest.raises(CorruptSample) as e:
        _read(_backend(root, 32), np.arange(N), 32)
    assert e.value.index == 120 and "data-0000000110.beton" in str(e.value)


@pytest.mark.slow
def test_jpeg_parts_read_like_one_file(tmp_path):
    """An RGB (JPEG) field in three parts decodes exactly as in one file, in any order."""
    images, labels = _data(4)
    yy, xx = np.mgrid[0:SHAPE[0], 0:SHAPE[1]]
    images = ((images // 4) + np.stack([xx * 9, yy * 11, xx + yy], -1)[None].astype(np.uint8)).astype(np.uint8)
    single = write_artifact(tmp_path / "single", images, labels, bounds=(0,), jpg=True)
    multi = write_artifact(tmp_path / "multi", images, labels, jpg=True)
    order = np.random.default_rng(8).permutation(N)
    ref = _read(_backend(single, 50), np.arange(N), 50)
    decoded = np.concatenate([x for x, _, _ in ref])
    _expect_batches(_read(_backend(multi, 50), order, 50), order, 50, decoded, labels)
