"""The image ``Loader`` over a weighted mixture of image artifacts: exact per-epoch counts
per source, a deterministic order per (seed, epoch), every sample read from its own artifact,
exact resume at another world size, weights changed between runs (recorded, applied at the next
epoch), clear refusals of sources that do not match, and a short real training run on a mixture."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from sluice.errors import LoaderError
from sluice.stages.contracts import Batch
from sluice.stages.load.loader import Loader
from sluice.storage.artifact import open_artifact

SIZES = {"a": 40, "b": 25, "c": 60, "d": 30}
SOURCE_ID = {"a": 1, "b": 2, "c": 3, "d": 4}


def _artifact(root, name: str, n: int, shape=(8, 8), classes: int = 3, source_id: int = 9,
              changed: tuple[int, ...] = ()):
    """A real artifact (the sharding code, several shards) whose pixels say what each sample is:
    pixel (0, 0) its source, pixel (0, 1) its place in the source file. ``changed``: samples
    whose pixels change in a second version written on top (their old indices are removed)."""
    from sluice.stages.data.config import IngestConfig, ShardConfig
    from sluice.stages.data.shard import shard_dataset
    x = np.zeros((n, *shape), np.uint8)
    x[:, 0, 0], x[:, 0, 1] = source_id, np.arange(n)
    versions = [x] + ([x.copy()] if changed else [])
    for k in changed:
        versions[-1][k, 0, 1] = 200 + k
    for v in versions:
        np.savez(root / f"{name}.npz", images=v, labels=np.arange(n) % classes)
        s = shard_dataset(IngestConfig(source=str(root / f"{name}.npz"), holdout_fraction=0.0, val_fraction=0.0,
                                       test_fraction=0.0),
                          root / name, ShardConfig(formats=["webdataset", "dali"], progress=False, workers=1,
                                                   shard_samples=16))
    return str(s.root)


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    out = {n: _artifact(root, n, k, source_id=SOURCE_ID[n], changed=(3, 10) if n == "d" else ())
           for n, k in SIZES.items()}
    out["wide"] = _artifact(root, "wide", 10, shape=(8, 10))
    out["five"] = _artifact(root, "five", 10, classes=5)
    # what each split index holds, read by the single-artifact Loader
    out["ids"] = {}
    for n in SIZES:
        im, lab, idx = next(iter(Loader(out[n], split="train", batch_size=100, sampler={"kind": "sequential"},
                                        workers=0)))
        px = (im[:, 0, 0, :2] * 255).round().to(torch.int64).numpy()
        assert (px[:, 0] == SOURCE_ID[n]).all()
        out["ids"][n] = dict(zip(idx.tolist(), zip(px[:, 1].tolist(), lab.tolist())))
    return out


def mix(arts, *rules, names=("a", "b", "c"), **kw) -> dict:
    return {"sources": [{"path": arts[n], "name": n, **r} for n, r in zip(names, rules)], **kw}


def loader(arts, mixture, **kw) -> Loader:
    kw.setdefault("batch_size", 8)
    kw.setdefault("workers", 0)
    return Loader(mixture=mixture, **kw)


def collect(L: Loader, arts, limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Indices and sources of the loader's batches (all of the epoch, or ``limit`` batches),
    each sample checked to be the stored sample its index names, read from its own artifact."""
    idx, src = [], []
    for b, batch in enumerate(L):
        assert isinstance(batch, Batch)
        images, labels, indices = batch
        s, j = L.locate(indices)
        assert np.array_equal(batch.sources.numpy(), s)
        assert batch.source_counts.tolist() == np.bincount(s, minlength=len(L.names)).tolist()
        px = (images[:, 0, 0, :2] * 255).round().to(torch.int64).numpy()
        for k in range(len(s)):
            name = L.names[s[k]]
            assert px[k, 0] == SOURCE_ID[name], (name, px[k])
            assert (px[k, 1], labels[k].item()) == arts["ids"][name][j[k]]
        idx.append(indices.numpy())
        src.append(s)
        if limit is not None and b + 1 == limit:
            break
    return np.concatenate(idx), np.concatenate(src)


# ------------------------------------------------------------------ counts and order
def test_each_source_gives_exactly_its_count_per_epoch(arts):
    L = loader(arts, mix(arts, {"weight": 0.5}, {"weight": 0.3}, {"weight": 0.2}, epoch_size=100))
    assert L.epoch_counts() == {"a": 50, "b": 30, "c": 20}
    for epoch in (0, 1):
        L.set_epoch(epoch)
        idx, src = collect(L, arts)
        assert np.bincount(src, minlength=3).tolist() == [50, 30, 20]
        s, j = L.locate(idx)
        assert len(set(j[s == 0].tolist())) == 40  # 50 of a's 40: every one, then 10 again
        assert len(set(j[s == 2].tolist())) == 20  # 20 of c's 60: distinct
    assert L.served_by_source() == {"unit": "samples", "served": {"a": 100, "b": 60, "c": 40}, "changes": []}


def test_repeat_and_choose_are_absolute_counts(arts):
    L = loader(arts, mix(arts, {"repeat": 2}, {"choose": 7}, {"repeat": 0.5}))
    idx, src = collect(L, arts)
    assert np.bincount(src, minlength=3).tolist() == [80, 7, 30]
    s, j = L.locate(idx)
    assert np.bincount(j[s == 0], minlength=40).tolist() == [2] * 40  # every sample of a twice


def test_the_order_is_a_function_of_seed_and_epoch(arts):
    m = mix(arts, {"weight": 2}, {"weight": 1}, {"weight": 1}, epoch_size=64, seed=5)
    one, two = loader(arts, m), loader(arts, m)
    e0 = collect(one, arts)[0]
    assert np.array_equal(e0, collect(two, arts)[0])
    one.set_epoch(1)
    e1 = collect(one, arts)[0]
    assert not np.array_equal(e0, e1)
    other = loader(arts, {**m, "seed": 6})
    assert not np.array_equal(e0, collect(other, arts)[0])
    one.set_epoch(1)  # the same epoch again (an evaluation): the same batches
    assert np.array_equal(e1, collect(one, arts)[0])


def test_every_prefix_is_near_the_mixture(arts):
    L = loader(arts, mix(arts, {"weight": 0.5}, {"weight": 0.25}, {"weight": 0.25}, epoch_size=80), batch_size=16)
    _, src = collect(L, arts)
    for end in range(16, 81, 16):
        share = np.bincount(src[:end], minlength=3) / end
        assert np.abs(share - [0.5, 0.25, 0.25]).max() <= 2 / end + 1e-9


def test_removed_samples_are_never_drawn(arts):
    art = open_artifact(arts["d"])
    assert art.manifest.splits["train"].removed == [3, 10] and art.manifest.splits["train"].count == 32
    L = loader(arts, mix(arts, {"repeat": 1}, {"repeat": 1}, names=("d", "b")))
    assert L.epoch_counts() == {"d": 30, "b": 25}
    idx, src = collect(L, arts)  # an index of a removed sample has no entry in arts["ids"]
    s, j = L.locate(idx)
    assert sorted(j[s == 0].tolist()) == art.live("train").tolist()
    assert L.offsets.tolist() == [0, 32, 57]  # removed samples keep their indices


def test_a_damaged_sample_is_dropped_and_the_rest_stay_in_place(arts):
    L = loader(arts, mix(arts, {"repeat": 1}, {"repeat": 2}, names=("a", "b")), backend="memory",
               on_corrupt="skip", max_corrupt_fraction=0.5, verify="none")
    reads = L.backend()
    reads.backends[0].damaged[0] = True  # a's split index 0: mixture index 0
    reads.backends[1].damaged[5] = True  # b's split index 5: mixture index 45, drawn twice
    want = L.epoch_indices()
    idx, _ = collect(L, arts)  # every other sample where the order puts it, each its own image
    assert np.array_equal(idx, want[~np.isin(want, [0, 45])])
    assert L.profile()["corrupt_skipped"] == 3


def test_the_cursor_follows_each_epochs_own_length():
    from sluice.stages.load.epochs import EpochCursor
    lengths = {0: 10, 1: 21}
    cur = EpochCursor(lambda e, _g: np.arange(lengths[e]), 10, rank=1, world=2, batch=4, drop_last=False,
                      length=lengths.__getitem__)
    assert cur.batches() == 2 and cur.rank_order()[0].tolist() == [1, 3, 5, 7, 9]
    cur.set_epoch(1)
    assert cur.batches() == 3 and cur.state_dict()["end"] == 22  # 21 padded to the world
    assert cur.rank_order()[0].tolist() == list(range(1, 21, 2)) + [0]


def test_a_streaming_backend_reads_the_same_batches(arts):
    m = mix(arts, {"weight": 1}, {"weight": 1}, {"weight": 2}, epoch_size=50)
    mem = loader(arts, m, backend="memory")
    wds = loader(arts, m, backend="webdataset")
    assert wds.backend_name == "webdataset" and mem.backend_name == "memory"
    a, b = collect(mem, arts), collect(wds, arts)
    assert np.array_equal(a[0], b[0])


# ------------------------------------------------------------------ ranks and resume
def _rank_loaders(arts, m, world: int, batch: int) -> list[Loader]:
    return [loader(arts, m, batch_size=batch, rank=r, world_size=world) for r in range(world)]


@pytest.mark.parametrize("world_to", [1, 2, 3])
def test_resume_at_another_world_size_covers_the_uninterrupted_run(arts, world_to):
    m = mix(arts, {"weight": 0.5}, {"weight": 0.3}, {"weight": 0.2}, epoch_size=90)
    full = np.sort(np.concatenate([collect(L, arts)[0] for L in _rank_loaders(arts, m, 4, 5)]))
    seen = []
    first = _rank_loaders(arts, m, 4, 5)
    for L in first:
        seen.append(collect(L, arts, limit=2)[0])
    states = [L.state_dict() for L in first]
    assert all(s["consumed"] == 40 for s in states)  # global: two batches of 4 x 5
    for r, L in enumerate(_rank_loaders(arts, m, world_to, 4)):
        L.load_state_dict(states[r % 4])
        seen.append(collect(L, arts)[0])
    assert np.array_equal(np.sort(np.concatenate(seen)), full)  # none twice, none skipped
    # the ranks split every epoch evenly
    ranks = _rank_loaders(arts, m, world_to, 4)
    assert len({len(L) for L in ranks}) == 1
    assert len({len(L.epoch_indices()) for L in ranks}) == 1


def test_resume_at_the_same_world_size_gives_the_very_next_batch(arts):
    m = mix(arts, {"weight": 1}, {"weight": 1}, {"weight": 1}, epoch_size=60)
    whole = collect(loader(arts, m, rank=1, world_size=2), arts)[0]
    L = loader(arts, m, rank=1, world_size=2)
    head = collect(L, arts, limit=1)[0]
    again = loader(arts, m, rank=1, world_size=2)
    again.load_state_dict(L.state_dict())
    assert np.array_equal(np.concatenate([head, collect(again, arts)[0]]), whole)
    assert again.served.sum() == len(whole)  # served counts carry over on the same rank


# ------------------------------------------------------------------ weights changed between runs
def test_new_weights_finish_the_epoch_with_the_old_counts_and_are_recorded(arts):
    old = mix(arts, {"weight": 1}, {"weight": 1}, {"weight": 2}, epoch_size=40)
    new = mix(arts, {"weight": 3}, {"weight": 1}, {"weight": 1}, epoch_size=50)
    first = loader(arts, old)
    _, head = collect(first, arts, limit=2)
    state = first.state_dict()
    L = loader(arts, new)
    L.load_state_dict(state)
    assert L.epoch_counts(0) == {"a": 10, "b": 10, "c": 20}  # the epoch it began with
    _, rest = collect(L, arts)
    assert np.bincount(np.concatenate([head, rest]), minlength=3).tolist() == [10, 10, 20]
    assert L.mixture_changes == [{"epoch": 1, "old": {"a": {"weight": 1.0, "count": 10, "size": 40},
                                                      "b": {"weight": 1.0, "count": 10, "size": 25},
                                                      "c": {"weight": 2.0, "count": 20, "size": 60}},
                                  "new": {"a": {"weight": 3.0, "count": 30, "size": 40},
                                          "b": {"weight": 1.0, "count": 10, "size": 25},
                                          "c": {"weight": 1.0, "count": 10, "size": 60}}}]
    L.set_epoch(1)
    assert len(L) == 7  # 50 samples in batches of 8
    _, nxt = collect(L, arts)
    assert np.bincount(nxt, minlength=3).tolist() == [30, 10, 10]
    assert L.state_dict()["mixture"]["changes"] == L.mixture_changes  # carried to the next run
    assert L.served_by_source()["changes"] == L.mixture_changes


def test_new_weights_resumed_mid_epoch_at_another_world_size(arts):
    old = mix(arts, {"weight": 1}, {"weight": 1}, {"weight": 1}, epoch_size=48)
    new = mix(arts, {"weight": 1}, {"weight": 4}, {"weight": 1}, epoch_size=48)
    full = np.sort(np.concatenate([collect(L, arts)[0] for L in _rank_loaders(arts, old, 2, 4)]))
    first = _rank_loaders(arts, old, 2, 4)
    seen = [collect(L, arts, limit=3)[0] for L in first]
    for r, L in enumerate(_rank_loaders(arts, new, 3, 2)):
        L.load_state_dict(first[0].state_dict())
        seen.append(collect(L, arts)[0])
        assert L.mixture_changes[0]["epoch"] == 1
    assert np.array_equal(np.sort(np.concatenate(seen)), full)


def test_a_state_at_an_epoch_boundary_takes_the_new_weights_there(arts):
    old = mix(arts, {"weight": 1}, {"weight": 1}, {"weight": 1}, epoch_size=30)
    new = mix(arts, {"weight": 1}, {"weight": 2}, {"weight": 3}, epoch_size=30)
    done = loader(arts, old)
    collect(done, arts)  # epoch 0 read to its end
    L = loader(arts, new)
    L.load_state_dict(done.state_dict())
    assert L.epoch == 1 and [c["epoch"] for c in L.mixture_changes] == [1]
    assert np.bincount(collect(L, arts)[1], minlength=3).tolist() == [5, 10, 15]
    fresh = loader(arts, old)  # a state before any batch: the new weights from this very epoch
    L = loader(arts, new)
    L.load_state_dict(fresh.state_dict())
    assert L.epoch == 0 and [c["epoch"] for c in L.mixture_changes] == [0]
    assert np.bincount(collect(L, arts)[1], minlength=3).tolist() == [5, 10, 15]


def test_a_state_of_another_version_mid_epoch_is_refused(arts):
    m = mix(arts, {"weight": 1}, {"weight": 1}, names=("a", "b"))
    L = loader(arts, m)
    collect(L, arts, limit=1)
    state = L.state_dict()
    state["fingerprints"]["b"] = "0" * 64
    with pytest.raises(LoaderError, match="other versions of sources .*'b'"):
        loader(arts, m).load_state_dict(state)
    with pytest.raises(LoaderError, match="not an image loader state"):
        loader(arts, m).load_state_dict({**state, "kind": "tokens"})


# ------------------------------------------------------------------ refusals
def test_sources_that_do_not_match_are_refused_by_name(arts):
    with pytest.raises(LoaderError, match=r"image shape .*'a' .*\(8, 8, 1\).*'wide' .*\(8, 10, 1\)"):
        loader(arts, mix(arts, {"weight": 1}, {"weight": 1}, names=("a", "wide")))
    with pytest.raises(LoaderError, match=r"number of classes: 'a' .*: 3, 'five' .*: 5"):
        loader(arts, mix(arts, {"weight": 1}, {"weight": 1}, names=("a", "five")))
    with pytest.raises(LoaderError, match="no path"):
        loader(arts, {"sources": [{"name": "x", "weight": 1}]})
    two = mix(arts, {"weight": 1}, {"weight": 1}, names=("a", "b"))
    with pytest.raises(LoaderError, match="order of several sources is the mixture plan's"):
        loader(arts, two, sampler={"kind": "shard_block"})
    with pytest.raises(LoaderError, match="augments inside its own pipeline"):
        loader(arts, two, backend="dali")
    with pytest.raises(LoaderError, match="decode: device"):
        loader(arts, two, decode="device")
    # a mixture of one source is the plain loader: its sampler orders it
    one = loader(arts, mix(arts, {"weight": 1}, names=("a",)), sampler={"kind": "shard_block"})
    assert sorted(i for b in one for i in b.indices.tolist()) == list(range(SIZES["a"]))
    assert one.names == ["a"] and next(iter(one)).sources is None  # one source: no breakdown


def test_artifacts_can_be_passed_open(arts):
    m = {"sources": [{"name": "a", "weight": 1}, {"name": "b", "weight": 1}], "epoch_size": 20}
    L = Loader(mixture=m, batch_size=8, workers=0, artifacts=[open_artifact(arts["a"]), arts["b"]])
    assert np.bincount(collect(L, arts)[1], minlength=2).tolist() == [10, 10]


@pytest.mark.gpu
def test_batches_made_on_the_gpu_equal_the_cpu_ones(arts):
    """Sources held on the GPU (memory backend): the same samples in the same order as on the
    CPU, the sources on the batches' device."""
    m = mix(arts, {"weight": 2}, {"weight": 1}, {"weight": 1}, epoch_size=70)
    cpu, gpu = loader(arts, m, device="cpu"), loader(arts, m, device="cuda:0")
    for a, b in zip(cpu, gpu):
        assert b.input.device.type == "cuda" and b.sources.device.type == "cuda"
        assert torch.equal(a.indices, b.indices.cpu()) and torch.equal(a.sources, b.sources.cpu())
        assert torch.allclose(a.input, b.input.cpu(), atol=1e-6)
    assert cpu.served_by_source() == gpu.served_by_source()


# ------------------------------------------------------------------ in a training run
def test_a_training_job_trains_on_an_image_mixture(arts, tmp_path):
    from sluice.stages.load.specs import ImagesData
    from sluice.stages.run.launch import make_job
    from sluice.stages.train import TrainConfig, train
    spec = {"kind": "images", "loader": {"batch_size": 16, "workers": 0, "augment": {"ops": [{"op": "normalize"}]}},
            "mixture": mix(arts, {"weight": 0.6}, {"weight": 0.4}, names=("a", "c"), epoch_size=40)}
    job = make_job({"num_classes": 3, "max_steps": 9}, spec, spec)
    assert isinstance(job.data, ImagesData)
    cfg = TrainConfig(model_kwargs={"width": 8}, num_classes=3, max_steps=9, batch_size=16, lr=0.05,
                      progress=False, torch_threads=1, checkpoint_dir=str(tmp_path / "ck"))
    build = dict(rank=0, world_size=1)
    r = train(cfg.model_copy(update={"halt_at_step": 6}), job.data.build(**build), job.eval_data.build(**build))
    assert r.halted and r.steps == 6
    served = r.summary["served_by_source"]
    # 6 steps: two epochs of 3 batches (16, 16, 8), each epoch 24 of a and 16 of c
    assert served == {"unit": "samples", "served": {"a": 48, "c": 32}, "changes": []}
    # the next run, with other weights, resumes from the checkpoint and records the change
    spec2 = {**spec, "mixture": mix(arts, {"weight": 0.25}, {"weight": 0.75}, names=("a", "c"), epoch_size=40)}
    job2 = make_job({"num_classes": 3, "max_steps": 9}, spec2, spec)
    r2 = train(cfg, job2.data.build(**build), job2.eval_data.build(**build))
    assert r2.resumed_from == 6 and r2.steps == 9 and r2.final_acc is not None
    s2 = r2.summary["served_by_source"]
    assert s2["served"] == {"a": 48 + 10, "c": 32 + 30}
    assert [c["epoch"] for c in s2["changes"]] == [2]
    # the evaluation reports each source's loss and accuracy; the counts weight them to the whole
    ev = r2.evals[-1]
    assert set(ev["loss_by_source"]) == set(ev["acc_by_source"]) == {"a", "c"}
    loader = job2.eval_data.build(**build)
    counts = loader.epoch_counts(0)
    assert sum(counts.values()) == ev["n"]
    assert sum(ev["loss_by_source"][k] * counts[k] for k in counts) / ev["n"] == pytest.approx(ev["loss"], rel=1e-4)
    assert sum(ev["acc_by_source"][k] * counts[k] for k in counts) / ev["n"] == pytest.approx(ev["acc"], abs=1e-6)


# ------------------------------------------------------------------ the nightly flow on an image mixture
MIXTURE_NIGHTS = """
import json, sys
import sluice.flows.nightly as fl
from sluice.flows.pipeline import PipelineConfig
for cfg in json.loads(sys.argv[1]):
    r = fl.nightly(PipelineConfig.model_validate(cfg))
    p = r["promotion"]
    print("RESULT " + json.dumps({"promotion": {k: p[k] for k in ("model_id", "promoted", "metric", "by_source",
        "warm", "unseen", "champion_before", "champion_value", "eval")}, "dataset": r["dataset"].model_dump(mode="json"),
        "served": r["train"]["summary"].get("served_by_source")}), flush=True)
"""


def _source(path, x, y, tx, ty):
    np.savez(path, images=x, labels=y, test_images=tx, test_labels=ty)
    return str(path)


@pytest.mark.slow
def test_an_image_mixture_night_warm_starts_and_reports_each_source(tmp_path):
    """Two image sources, mixed by weight, through the same nightly flow as one: per-source
    accuracy in the promotion and what each source served training; the next night, one source
    grown, starts from the champion on the new samples of that source plus a replay of both."""
    import json
    import subprocess
    import sys
    from sluice.stages.load.arrays import fashion_mnist
    x, y = fashion_mnist("train")
    tx, ty = fashion_mnist("test")
    a = _source(tmp_path / "a.npz", x[:400], y[:400], tx[:150], ty[:150])
    b = tmp_path / "b.npz"

    def config(n_b: int) -> dict:
        _source(b, x[400:400 + n_b], y[400:400 + n_b], tx[150:250], ty[150:250])
        return {"data_root": str(tmp_path / "data"), "nproc": 1, "keep_versions": None,
                "data": {"sources": [{"name": "a", "source": a, "weight": 2.0}, {"name": "b", "source": str(b)}],
                         "shard": {"shard_samples": 500, "workers": 1, "progress": False}},
                "selection": {"method": "none"}, "train": {"max_steps": 12, "batch_size": 32},
                "warm": {"init": "auto", "replay_ratio": 0.5}}
    nights = []
    for n_b in (200, 300):  # b grows by 100 samples between the nights: separate runs, one process each
        out = subprocess.run([sys.executable, "-c", MIXTURE_NIGHTS, json.dumps([config(n_b)])],
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
        nights += [json.loads(x[len("RESULT "):]) for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    first, second = nights
    p1, d1 = first["promotion"], first["dataset"]
    assert [s["name"] for s in d1["sources"]] == ["a", "b"] and d1["kind"] == "image"
    assert p1["promoted"] and p1["metric"] == "val_acc"
    assert set(p1["by_source"]) == {"a", "b"} and all(0 <= v["candidate"] <= 1 for v in p1["by_source"].values())
    assert set(p1["eval"]["by_source"]) == {"a", "b"}
    assert sum(s["n"] for s in p1["eval"]["by_source"].values()) == d1["counts"]["val"]
    served = first["served"]["served"]
    assert set(served) == {"a", "b"} and served["a"] > served["b"] > 0  # a weighs twice as much
    assert {k: v["trained"] for k, v in p1["by_source"].items()} == served

    p2, d2 = second["promotion"], second["dataset"]
    w = p2["warm"]
    assert w["init"] == "champion" and w["parent_model"] == p1["model_id"], w
    grown = d2["sources"][1]["counts"]["train"] - d1["sources"][1]["counts"]["train"]
    assert grown > 0 and w["new"] == grown and w["replayed"] == round(0.5 * grown)
    subsets = {k: set(np.load(f).tolist()) for k, f in w["subsets"].items()}
    assert set(subsets) == {"a", "b"} and len(subsets["a"]) + len(subsets["b"]) == w["new"] + w["replayed"]
    assert p2["champion_before"] == p1["model_id"] and p2["unseen"]["champion_samples_checked"] > 0
    assert all(v["champion"] is not None for v in p2["by_source"].values())  # re-graded per source
