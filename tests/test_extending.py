"""Extending Sluice from outside the package, as docs/extending.md shows: each axis
takes a new entry by registration (one decorator) or an installed entry point, and a name no
registry knows fails when the config is validated, before anything runs."""
from __future__ import annotations

from typing import Literal

import numpy as np
import pytest
import torch
from pydantic import Field, ValidationError

from sluice.errors import ConfigError
from sluice.stages.contracts import SelectedBatch
from sluice.stages.load import AugmentSpec, Loader, LoaderConfig
from sluice.stages.load.augment import AUGMENT_OPS, AugmentOp, Normalize
from sluice.stages.load.backends import LOADER_BACKENDS, Backend, Timings, batch_slices
from sluice.stages.load.sample_index import SampleIndex
from sluice.stages.models import MODELS
from sluice.stages.select import SELECTION_METHODS, BaseSelector, SelectionConfig, build_selector


# ---------------------------------------------------------------- a selection method

@SELECTION_METHODS.register("test_smallest_index")
class SmallestIndexSelector(BaseSelector):
    """Trains the n_b candidates with the smallest split index (deterministic, no scoring)."""

    def __call__(self, model, images, labels, indices) -> SelectedBatch:
        pos = torch.argsort(indices)[: self._n(images.shape[0])]
        return SelectedBatch(images[pos], labels[pos], indices[pos], None,
                             self._stats(indices, pos, None))


def test_a_selection_method_registered_outside_trains_in_the_loop():
    from sluice.stages.load import ArrayLoader
    from sluice.stages.train import TrainConfig, train
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 255, (256, 28, 28), dtype=np.uint8), rng.integers(0, 10, 256)
    cfg = SelectionConfig(method="test_smallest_index", ratio=0.25)
    sel = build_selector(cfg, candidate_size=32, split_size=256)
    r = train(TrainConfig(model_kwargs={"width": 4}, max_steps=3, batch_size=32, progress=False),
              ArrayLoader(x, y, 32), selector=sel)
    assert [m["select/n_selected"] for m in r.metrics] == [8.0, 8.0, 8.0]


# ---------------------------------------------------------------- a loader backend

@LOADER_BACKENDS.register("test_pread")
class PreadBackend(Backend):
    """Each sample read by offset from its shard, one at a time: the simplest exact backend."""
    name = "test_pread"

    @classmethod
    def open(cls, artifact, split, config, device, workers):
        return cls(artifact, split)

    def __init__(self, artifact, split):
        self.index, self.labels = SampleIndex(artifact, split), artifact.labels(split)
        self.timings = Timings()

    def epoch(self, order, batch_size, drop_last, start_batch=0, *, resolution=None, epoch=0):
        for lo, hi in batch_slices(len(order), batch_size, drop_last, start_batch):
            idx = order[lo:hi]
            yield np.stack([self.index.pixels(int(i)) for i in idx]), self.labels[idx], idx


def test_a_backend_registered_outside_yields_what_memory_yields(fmnist_artifact):
    """Same order, same pixels, same augmentation draws as a built-in backend."""
    spec = AugmentSpec(ops=[{"op": "flip"}, {"op": "translate", "pad": 2}, Normalize()])
    batches = {}
    for backend in ("test_pread", "memory"):
        cfg = LoaderConfig(split="train", batch_size=64, backend=backend, augment=spec, workers=1)
        loader = Loader(fmnist_artifact.root, cfg)
        loader.set_epoch(1)
        batches[backend] = list(loader)
    for (xa, ya, ia), (xb, yb, ib) in zip(batches["test_pread"], batches["memory"]):
        assert torch.equal(ia, ib) and torch.equal(ya, yb) and torch.equal(xa, xb)


# ---------------------------------------------------------------- an augmentation op

@AUGMENT_OPS.register("test_invert")
class Invert(AugmentOp):
    """Inverts an image's pixels with probability ``p``."""
    op: Literal["test_invert"] = "test_invert"
    p: float = Field(0.5, ge=0, le=1)

    def draw(self, n, hs, ws, resolution, gen):
        return {"mask": torch.rand(n, generator=gen) < self.p}

    def apply_torch(self, x, params, ctx, fused=None):
        m = params["mask"].to(x.device).view(-1, 1, 1, 1)
        ctx.owned = True
        return torch.where(m, 255.0 - x, x)


def test_an_op_registered_outside_runs_from_plain_config(fmnist_artifact):
    spec = AugmentSpec.model_validate({"ops": [{"op": "test_invert", "p": 1.0}]})
    assert spec.model_dump()["ops"] == [{"op": "test_invert", "p": 1.0}]  # round-trips as data
    plain = Loader(fmnist_artifact.root, LoaderConfig(split="val", batch_size=50, workers=1,
                                                      sampler={"kind": "sequential"}))
    inverted = Loader(fmnist_artifact.root, LoaderConfig(split="val", batch_size=50, workers=1, augment=spec,
                                                         sampler={"kind": "sequential"}))
    (a, _, _), (b, _, _) = next(iter(plain)), next(iter(inverted))
    assert torch.allclose(b, 1.0 - a)


# ---------------------------------------------------------------- models and entry points

def test_a_model_registered_outside_trains_and_is_checked_by_name():
    from sluice.stages.load import ArrayLoader
    from sluice.stages.train import TrainConfig, train

    @MODELS.register("test_linear")
    def linear(in_channels: int, num_classes: int) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(in_channels * 28 * 28, num_classes))
    x = np.zeros((64, 28, 28), np.uint8)
    r = train(TrainConfig(model="test_linear", max_steps=2, batch_size=32, progress=False),
              ArrayLoader(x, np.arange(64) % 10, 32))
    assert r.steps == 2


def test_installed_entry_points_resolve_by_name(installed_plugins):
    from sluice.stages.train import TrainConfig
    assert "tiny_mlp" in MODELS.names() and "fixed_count" in SELECTION_METHODS.names()
    assert TrainConfig(model="tiny_mlp").model == "tiny_mlp"
    assert MODELS.get("tiny_mlp")(in_channels=1, num_classes=10)(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


@pytest.mark.parametrize("section,value,field", [
    ("train", {"model": "resnet_typo"}, "train.model"),
    ("train", {"comm": {"mode": "powersgdd"}}, "train.comm.mode"),
    ("selection", {"method": "rho-loss"}, "selection.method"),
    ("data", {"loader": {"backend": "ffvc"}}, "data.loader.backend"),
    ("data", {"ingest": {"kind": "tarball"}}, "data.ingest.kind"),
    ("data", {"augment": {"ops": [{"op": "flipp"}]}}, "data.augment.ops"),
    ("data", {"kind": "imagez"}, "data"),
])
def test_unknown_names_fail_at_validation_naming_field_and_choices(section, value, field):
    from sluice.flows.config import validate
    from sluice.flows.pipeline import PipelineConfig
    with pytest.raises(ConfigError) as e:
        validate(PipelineConfig, {section: value})
    assert field in str(e.value) and "known:" in str(e.value)


def test_registration_refuses_a_taken_name_unless_replacing():
    with pytest.raises(ConfigError, match="already registered"):
        MODELS.register("small_cnn")(lambda **kw: torch.nn.Identity())
    with pytest.raises(ValidationError):
        SelectionConfig(method="not_a_method")
