"""A recipe that adapts to the data (#48): the default recipe's ``auto`` settings resolve from the
night's artifacts (stages/kinds/image_recipe.py). Fashion-MNIST resolves to exactly what the recipe
hard-coded before (bn_cnn, as stored, 0.286/0.353: its night unchanged); photos of many sizes to
random resized crops at the host's side for training and the whole image resized for evaluation,
also when a checkpoint is graded later; explicit settings win; ``sluice config show`` says what
resolved and why."""
from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT
from sluice.errors import ConfigError
from sluice.flows.pipeline import PipelineConfig, prepare_data, training_job
from sluice.stages.data.fashion_photos import make_fashion_photos
from sluice.stages.kinds.image import train_stats
from sluice.stages.kinds.image_recipe import CROP_SCALE, resolve
from sluice.storage.artifact import open_artifact


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """300 Fashion-MNIST photos (40-146 px, three aspect ratios), prepared as the pipeline does."""
    tmp = tmp_path_factory.mktemp("recipe")
    folder = make_fashion_photos(tmp / "photos", n=300)
    c = PipelineConfig.model_validate({"data_root": str(tmp / "data"), "data": {"source": str(folder), "name": "photos",
                                       "shard": {"workers": 1, "progress": False}}})
    return c, prepare_data(c)


def _ops(spec) -> list[str]:
    return [op.op for op in spec.loader.augment.ops]


def test_fashion_mnist_resolves_to_what_the_recipe_hard_coded(fmnist_artifact):
    """One size (28x28) at most the CPU's side: trained as stored, no resize op anywhere, the BN CNN,
    normalised by the train split's own statistics to three decimals (the full set's are
    0.286/0.353, the values the recipe gave by hand)."""
    c = PipelineConfig.model_validate({"data": {"source": "fashion-mnist"}, "train": {"device": "cpu"}})
    version = c.kind().version_of([fmnist_artifact.root])
    assert version.shape == (28, 28) and version.channels == 1
    job = training_job(c, version, None)
    stats = version.stats
    assert job.config.model == "bn_cnn" and job.config.input_size is None
    assert job.config.normalize_mean == [round(stats.mean[0], 3)]
    assert job.config.normalize_std == [round(stats.std[0], 3)]
    assert _ops(job.data) == ["flip", "normalize"] and _ops(job.eval_data) == ["normalize"]
    notes = c.kind().explain(c.train, version)
    assert any("as stored (28x28 px" in n for n in notes) and any("-> bn_cnn" in n for n in notes), notes


def test_photos_train_on_crops_at_the_cpus_side_and_evaluate_the_whole_image(photos):
    c, version = photos
    assert version.shape is None and version.channels == 3  # sizes vary; RGB
    median = version.stats.sizes.short_side.median
    assert median > 32
    job = training_job(c, version, None)
    cfg = job.config
    assert (cfg.model, cfg.input_size, cfg.in_channels, cfg.num_classes) == ("bn_cnn", 32, 3, 10)
    assert cfg.normalize_mean == [round(v, 3) for v in version.stats.mean] and len(cfg.normalize_std) == 3
    train_ops, eval_ops = job.data.loader.augment.ops, job.eval_data.loader.augment.ops
    assert _ops(job.data) == ["random_resized_crop", "flip", "normalize"]
    assert train_ops[0].size == 32 and tuple(train_ops[0].scale) == CROP_SCALE
    assert _ops(job.eval_data) == ["center_crop", "normalize"]
    assert (eval_ops[0].size, eval_ops[0].crop_mode) == (32, "squash")
    # the specs build loaders that batch these photos at 32x32 (train: crops; eval: every sample once)
    for spec, split in ((job.data, "train"), (job.eval_data, "test")):
        x, y, idx = next(iter(spec.build(rank=0, world_size=1)))
        assert tuple(x.shape[1:]) == (3, 32, 32) and x.dtype == torch.float32, split
    notes = c.kind().explain(c.train, version)
    assert any(f"-> 32 (sizes vary, median short side {int(median)} px" in n for n in notes), notes


def test_on_cuda_the_side_is_larger_and_the_model_a_resnet_said_to_be_unmeasured(photos):
    c, version = photos
    train = c.train.model_copy(update={"device": "cuda"})
    r = resolve(train, version.stats, version.shape, "cuda")
    side = min(int(version.stats.sizes.short_side.median), 64)
    assert r.updates["input_size"] == side and r.updates["model"] == "resnet_small"
    assert any("chosen without a GPU to measure it on" in n for n in r.notes), r.notes


def test_explicit_settings_win_and_a_stored_size_is_not_resized(photos, fmnist_artifact):
    c, version = photos
    given = {"model": "small_cnn", "input_size": 24, "normalize_mean": [0.5, 0.5, 0.5], "normalize_std": [0.25] * 3}
    train = c.train.model_copy(update=given)
    r = resolve(train, version.stats, version.shape, "cpu")
    assert r.updates == {"input_size": 24} and r.notes == []
    job = training_job(c.model_copy(update={"train": train}), version, None)
    assert job.config.model == "small_cnn" and job.data.loader.augment.ops[0].size == 24
    f = PipelineConfig.model_validate({"data": {"source": "fashion-mnist"}, "train": {"input_size": 28}})
    fm = f.kind().version_of([fmnist_artifact.root])
    assert training_job(f, fm, None).config.input_size is None  # already 28x28: nothing to resize


def test_a_checkpoint_trained_at_an_input_size_is_graded_at_it(photos, tmp_path):
    """Grading reads the size from the checkpoint's config: the variable-size test split is
    resized as in training's evaluation (a grade of every test sample), with no loader settings."""
    from sluice.stages.models import build_model
    from sluice.stages.train.evaluate import evaluate_checkpoint
    c, version = photos
    cfg = training_job(c, version, None).config
    model = build_model(cfg.model, cfg.in_channels, cfg.num_classes)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "config": cfg.model_dump(mode="json")}, path)
    m = evaluate_checkpoint(path, version.root, "test")
    assert m["n"] == version.counts["test"] and 0.0 <= m["acc"] <= 1.0 and np.isfinite(m["loss"])


def test_statistics_of_several_sources_count_every_pixel_once(tmp_path):
    """Two photo sources' merged statistics equal numpy over both train splits' decoded images."""
    from PIL import Image
    from sluice.stages.data.config import IngestConfig, ShardConfig
    from sluice.stages.data.shard import shard_dataset
    arts = []
    for n, seed in ((120, 1), (200, 2)):
        folder = make_fashion_photos(tmp_path / f"p{seed}", n=n, seed=seed)
        s = shard_dataset(IngestConfig(source=str(folder)), tmp_path / f"a{seed}", ShardConfig(progress=False, workers=1))
        arts.append(open_artifact(s.root))
    merged = train_stats(arts)
    pixels = []
    for art in arts:
        from sluice.stages.load.sample_index import SampleIndex
        si = SampleIndex(art, "train")
        pixels += [np.asarray(Image.open(io.BytesIO(si.read(i))).convert("RGB"), np.float64).reshape(-1, 3)
                   for i in range(art.manifest.split("train").count)]
    allpx = np.concatenate(pixels) / 255
    assert merged.samples == sum(a.manifest.split("train").count for a in arts)
    assert np.allclose(merged.mean, allpx.mean(0), atol=2e-3), (merged.mean, allpx.mean(0))  # JPEG noise only
    assert np.allclose(merged.std, allpx.std(0), atol=2e-3), (merged.std, allpx.std(0))


def test_a_job_of_your_own_with_auto_left_is_refused_clearly(photos):
    from sluice.stages.run.launch import make_job
    c, version = photos
    job = training_job(c, version, None)
    with pytest.raises(ConfigError, match="train.model: auto is resolved from the data by the pipeline"):
        make_job(job.config.model_copy(update={"model": "auto"}), job.data)


def test_config_show_says_what_resolved_from_the_data_and_why(photos):
    c, version = photos
    args = [sys.executable, "-m", "sluice.flows.cli", "config", "show", "--data-root", c.data_root,
            "--set", f"data.source={version.sources[0].location}", "--set", "data.name=photos"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "# resolved from the data" in text, text[:2000]
    assert "train.input_size: auto -> 32 (sizes vary" in text and "train.model: auto -> bn_cnn" in text, text[:2000]
    assert "train.normalize_mean/std: auto -> [" in text
    fresh = subprocess.run(args[:6] + [c.data_root + "-none"] + args[7:], capture_output=True, text=True, timeout=300,
                           cwd=ROOT)
    assert "no version yet of: photos" in fresh.stdout, fresh.stdout[:2000]
