"""Sluice writes FFCV's .beton itself (stages/data/formats/beton.py, no FFCV import): the bytes
must be FFCV's DatasetWriter's own, so that FFCV's loader reads them and a fingerprint means
the same file whichever writer made it."""
from __future__ import annotations

import numpy as np
import pytest

from sluice.stages.data.formats import beton

pytest.importorskip("ffcv")


def _ffcv_write(path, fields, samples, page_size):
    from ffcv.writer import DatasetWriter

    class View:
        def __len__(self):
            return len(samples)

        def __getitem__(self, i):
            return samples[i]

    DatasetWriter(str(path), fields, page_size=page_size, num_workers=1).from_indexed_dataset(View(), chunksize=256)


def _ours(path, fields, samples, page_size):
    with open(path, "w+b") as fp:
        beton.write_beton(fp, fields, samples, len(samples), page_size)


def _fields(lib, image):
    return {"image": image, "label": lib.IntField(), "index": lib.IntField(), "key": lib.BytesField()}


@pytest.mark.slow
def test_gray_arrays_byte_for_byte_as_ffcv_including_samples_that_restart_on_a_new_page(tmp_path, monkeypatch):
    from ffcv import fields as ffcv_fields
    rng = np.random.default_rng(0)
    n = 6000
    images = rng.integers(0, 256, (n, 28, 28, 1), dtype=np.uint8)
    # long keys: at a page's end the image often fits and its key does not, so the sample
    # starts again on the next page (the bytes it left behind stay in the file, as FFCV's do)
    samples = [(images[i], i % 10, i, np.frombuffer(b"k" * int(rng.integers(1, 2000)), np.uint8)) for i in range(n)]
    restarted: list[int] = []
    malloc = beton._Pages.malloc

    def counting(self, size):
        try:
            return malloc(self, size)
        except beton._Retry:
            restarted.append(self.sample)
            raise
    monkeypatch.setattr(beton._Pages, "malloc", counting)
    page = beton.page_size_for(28 * 28)
    _ours(tmp_path / "ours.beton", _fields(beton, beton.NDArrayField(np.dtype("uint8"), (28, 28, 1))), samples, page)
    _ffcv_write(tmp_path / "ffcv.beton", _fields(ffcv_fields, ffcv_fields.NDArrayField(np.dtype("uint8"), (28, 28, 1))),
                samples, page)
    assert restarted, "the case must cover a sample that restarts on a fresh page"
    assert (tmp_path / "ours.beton").read_bytes() == (tmp_path / "ffcv.beton").read_bytes()

    from ffcv.fields.basics import IntDecoder
    from ffcv.fields.decoders import NDArrayDecoder
    from ffcv.loader import Loader, OrderOption
    loader = Loader(str(tmp_path / "ours.beton"), batch_size=1000, order=OrderOption.SEQUENTIAL, num_workers=1,
                    pipelines={"image": [NDArrayDecoder()], "label": [IntDecoder()], "index": [IntDecoder()], "key": None})
    for k, (x, y, idx) in enumerate(loader):  # FFCV reuses its batch buffers: compare batch by batch
        assert np.array_equal(x, images[k * 1000:(k + 1) * 1000])
        assert np.array_equal(idx.ravel(), np.arange(k * 1000, (k + 1) * 1000))
        assert np.array_equal(y.ravel(), np.arange(k * 1000, (k + 1) * 1000) % 10)


@pytest.mark.parametrize("mode", ["raw", "jpg"])
def test_rgb_images_byte_for_byte_as_ffcv(tmp_path, mode):
    from ffcv import fields as ffcv_fields
    rng = np.random.default_rng(1)
    samples = [(rng.integers(0, 256, (int(rng.integers(60, 300)), int(rng.integers(60, 300)), 3), dtype=np.uint8),
                i % 7, i, np.frombuffer(f"photo-{i}".encode(), np.uint8)) for i in range(150)]
    page = beton.page_size_for(None)
    _ours(tmp_path / "ours.beton", _fields(beton, beton.RGBImageField(mode=mode, jpeg_quality=85)), samples, page)
    _ffcv_write(tmp_path / "ffcv.beton", _fields(ffcv_fields, ffcv_fields.RGBImageField(write_mode=mode, jpeg_quality=85)),
                samples, page)
    assert (tmp_path / "ours.beton").read_bytes() == (tmp_path / "ffcv.beton").read_bytes()


def test_a_sample_count_that_disagrees_with_the_samples_is_an_error(tmp_path):
    fields = _fields(beton, beton.NDArrayField(np.dtype("uint8"), (2, 2, 1)))
    samples = [(np.zeros((2, 2, 1), np.uint8), 0, i, np.frombuffer(b"k", np.uint8)) for i in range(3)]
    for count, message in ((2, "more samples than the 2 announced"), (4, "3 samples written, 4 announced")):
        with open(tmp_path / "x.beton", "w+b") as fp, pytest.raises(ValueError, match=message):
            beton.write_beton(fp, fields, samples, count, beton.MIN_PAGE_SIZE)
