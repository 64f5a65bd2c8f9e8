"""One loader contract (``stages/load/base.LoaderBase``), one suite run against every kind of
source and every backend: the image ``Loader`` over one artifact on each backend and over a
two-source mixture, the ``TokenLoader`` over one token source and over a mixture, and the
``ArrayLoader``. Each must yield ``contracts.Batch``, take a ``device`` as ``torch.device`` does,
mean one thing by ``set_epoch`` (epoch ``e`` from its first batch; iterating again without it
continues with the next epoch), say its ``len``, resume mid-epoch at exactly the next batch,
and report itself the same way."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from sluice.stages.contracts import Batch, LoaderReport, ResumableLoader
from sluice.stages.load import ArrayLoader, Loader, LoaderBase
from sluice.stages.load.tokens import ArrayTokens, TokenLoader

V = 40


def _docs(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, V, int(rng.integers(3, 20))).tolist() for _ in range(n)]


def _tokens(**kw):
    return TokenLoader([ArrayTokens.from_documents(_docs(60, 0), eot=0, vocab_size=V)], seq_len=16, batch_size=3,
                       seed=1, prefetch=0, **kw)


def _token_mixture(**kw):
    sources = [ArrayTokens.from_documents(_docs(50, s), eot=0, vocab_size=V) for s in (1, 2)]
    mix = {"sources": [{"name": "a", "weight": 2.0}, {"name": "b", "weight": 1.0}], "seed": 3}
    return TokenLoader(sources, seq_len=16, batch_size=3, seed=3, prefetch=0, mixture=mix, **kw)


def _arrays(**kw):
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 255, (70, 6, 6), dtype=np.uint8), rng.integers(0, 3, 70)
    return ArrayLoader(x, y, 8, seed=2, **kw)


@pytest.fixture(scope="module")
def makers(fmnist_artifact):
    """Every loader under contract, by name: a function making a fresh one (keyword arguments:
    its device)."""
    root = str(fmnist_artifact.root)
    common = dict(split="train", batch_size=64, workers=1, prefetch=0, sampler={"kind": "shuffle", "seed": 4})
    two = {"sources": [{"path": root, "name": "a", "weight": 1.0}, {"path": root, "name": "b", "weight": 1.0}],
           "epoch_size": 300, "seed": 4}
    out = {f"images-{b}": (lambda b=b, **kw: Loader(root, backend=b, **common, **kw))
           for b in ("memory", "webdataset", "ffcv", "dali")}
    out["images-mixture"] = lambda **kw: Loader(mixture=two, **{**common, "backend": "memory"}, **kw)
    out["tokens"] = lambda **kw: _tokens(**kw)
    out["tokens-mixture"] = lambda **kw: _token_mixture(**kw)
    out["arrays"] = lambda **kw: _arrays(**kw)
    return out


NAMES = ["images-memory", "images-webdataset", "images-ffcv", "images-dali", "images-mixture", "tokens",
         "tokens-mixture", "arrays"]


def _indices(batches) -> list[tuple[list, list]]:
    """What each batch holds: its indices and its first input (a token row's start is the same
    place in every epoch; its tokens are not)."""
    return [(b.indices.tolist(), b.input.reshape(-1)[:64].tolist()) for b in batches]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")], ids=["str", "torch.device"])
def test_every_loader_keeps_the_contract(makers, name, device):
    if name == "images-dali":
        pytest.importorskip("nvidia.dali", reason="DALI is not installed")
    make = makers[name]
    ld = make(device=device)
    assert isinstance(ld, LoaderBase) and isinstance(ld, ResumableLoader)
    assert ld.device == torch.device("cpu") and ld.names and all(isinstance(n, str) for n in ld.names)

    # set_epoch(e) is epoch e from its first batch, whatever was read before
    ld.set_epoch(0)
    e0 = list(ld)
    assert e0 and all(isinstance(b, Batch) for b in e0) and len(e0) == len(ld)
    assert all(b.input.device.type == "cpu" for b in e0)
    x, y, i = e0[0]  # a plain loop unpacks it
    assert x is e0[0].input and y is e0[0].targets and i is e0[0].indices
    ld.set_epoch(0)
    assert _indices(ld) == _indices(e0)  # read again: the same epoch, not the next
    # iterating again without set_epoch continues with the next epoch
    e1 = list(ld)
    assert ld.epoch == 1 and _indices(e1) != _indices(e0)
    ld.set_epoch(1)
    assert _indices(ld) == _indices(e1)

    # resume mid-epoch at exactly the next batch (a fresh loader, from the state)
    ld.set_epoch(2)
    it = iter(ld)
    head = [next(it) for _ in range(2)]
    state = ld.state_dict()
    it.close()
    rest = list(ld)  # this loader continues where it stopped too
    again = make(device=device)
    again.load_state_dict(state)
    assert _indices(again) == _indices(rest) and len(head) + len(rest) == len(ld)

    r = ld.report()
    assert isinstance(r, LoaderReport) and r.verdict is not None and r.corrupt_skipped == 0
    assert (r.served is not None) == (len(ld.names) > 1 or name.startswith("tokens"))
    if r.served is not None:
        assert set(r.served) == set(ld.names) and sum(r.served.values()) > 0


def test_set_epoch_of_an_epoch_read_to_its_end_reads_it_again(fmnist_artifact):
    """The change this refactor made on purpose: the image loader took ``set_epoch(e)`` after
    epoch ``e`` was read to its end as "go on to e + 1" (the token and mixture loaders restarted
    ``e``, the array loader rewound). Now every loader reads epoch ``e`` again, as PyTorch's
    ``DistributedSampler`` does; iterating on without ``set_epoch`` is how to get ``e + 1``."""
    ld = Loader(str(fmnist_artifact.root), split="train", batch_size=64, workers=1, prefetch=0,
                sampler={"kind": "shuffle", "seed": 4}, backend="memory")
    ld.set_epoch(3)
    first = _indices(ld)
    ld.set_epoch(3)
    assert _indices(ld) == first  # before: epoch 4's order
    assert _indices(ld) != first and ld.epoch == 4  # on, without set_epoch: the next epoch


def test_a_batch_is_one_typed_record_for_images_and_tokens(fmnist_artifact):
    """Inputs as a mapping, targets, sample keys and declared optional fields; model-ready."""
    images = next(iter(Loader(str(fmnist_artifact.root), split="train", batch_size=8, workers=1, prefetch=0,
                              augment={"ops": [{"op": "normalize", "mean": [0.3], "std": [0.3]}]})))
    assert set(images.inputs) == {"images"} and images.inputs["images"].dtype == torch.float32
    assert images.targets.shape == images.indices.shape == (8,) and images.sources is None
    rows = next(iter(_token_mixture(doc_keys=True)))
    assert set(rows.inputs) == {"input_ids", "segment_ids", "position_ids"}
    assert rows.targets.shape == rows.inputs["input_ids"].shape == rows.doc_keys.shape
    assert rows.sources.shape == rows.targets.shape and len(rows.source_counts) == 2
    assert rows.source_counts.sum() == (rows.sources >= 0).sum()
    lean = next(iter(_tokens(fields=[])))
    assert set(lean.inputs) == {"input_ids"} and lean.sources is None and lean.doc_keys is None
    assert len(lean.tensors()) == 4 and len(rows.tensors()) == 8  # what a CUDA stream hand-over records
    with pytest.raises(TypeError):
        images[2]  # a record, not a tuple: read it by name (it unpacks for a plain loop)
