"""The pipeline config: one shape from YAML, --set and Python; partial sections keep the
pipeline's defaults; bad fields are refused with their path."""
from __future__ import annotations

import pytest

from sluice.flows.config import ConfigError, load_config
from sluice.flows.pipeline import PipelineConfig


def test_a_partial_section_changes_only_what_it_names(tmp_path):
    default = PipelineConfig()
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  max_steps: 500\n  comm: {bucket_cap_mb: 30}\nselection: {ratio: 0.25}\n")
    c = load_config(PipelineConfig, f, ["train.epochs=8"])
    assert (c.train.max_steps, c.train.epochs, c.train.comm.bucket_cap_mb) == (500, 8, 30)
    assert c.selection.ratio == 0.25 and c.selection.method == default.selection.method
    # everything not named is the pipeline's default, not the stage class's own default
    for field in ("amp", "channels_last", "model_kwargs", "normalize_mean", "lr"):
        assert getattr(c.train, field) == getattr(default.train, field), field
    assert c.train.comm.mode == default.train.comm.mode == "none"
    assert c.data == default.data


def test_null_turns_a_default_technique_off():
    assert PipelineConfig().train.ema_decay == 0.995  # the measured default evaluates an EMA
    c = load_config(PipelineConfig, None, ["train.ema_decay=null", "selection.method=none"])
    assert c.train.ema_decay is None and c.selection.method == "none"
    assert c.train.eval_tta == PipelineConfig().train.eval_tta  # the rest stays the default


def test_python_yaml_and_dumped_configs_agree(tmp_path):
    c = PipelineConfig.model_validate({"train": {"max_steps": 7}})
    assert PipelineConfig.model_validate(c.model_dump(mode="json")) == c
    f = tmp_path / "c.yaml"
    f.write_text("train: {max_steps: 7}\n")
    assert load_config(PipelineConfig, f) == c


def test_another_model_does_not_inherit_the_default_model_kwargs():
    c = PipelineConfig.model_validate({"train": {"model": "resnet_small"}})
    assert c.train.model_kwargs == {}
    c = PipelineConfig.model_validate({"train": {"model_kwargs": {"width": 8}}})
    assert c.train.model_kwargs == {"width": 8}  # replaced whole, not merged key by key


@pytest.mark.parametrize("overrides, path", [(["train.bogus=1"], "train.bogus"),
                                             (["train.lr=fast"], "train.lr"),
                                             (["selection.ratio=2"], "selection.ratio"),
                                             (["data.ingest.limit=-5"], "data.ingest.limit")])
def test_bad_fields_are_refused_with_their_path(overrides, path):
    with pytest.raises(ConfigError) as e:
        load_config(PipelineConfig, None, overrides)
    assert path in str(e.value)


def _version():
    """A version of one image source as the prepare stage describes it (nothing read from it)."""
    from sluice.stages.kinds import SourceVersion
    from sluice.stages.kinds.image import ImageVersion
    source = SourceVersion(name="fashion-mnist", location="fashion-mnist", root="/nowhere", fingerprint="f" * 16,
                           counts={"train": 100, "val": 10, "test": 10})
    from sluice.storage.manifest import ImageStats, SizeSummary, Spread
    side = Spread(min=28, median=28.0, max=28)
    stats = ImageStats(samples=100, pixels=100 * 28 * 28, channels=1, mean=[0.2862], std=[0.3531],
                       sizes=SizeSummary(height=side, width=side, short_side=side, distinct=1))
    return ImageVersion(fingerprint="f" * 16, sources=[source], counts=source.counts, channels=1, num_classes=10,
                        shape=(28, 28), stats=stats)


def test_progressive_resizing_shapes_training_batches_but_never_evaluation():
    from sluice.flows.pipeline import training_job
    c = PipelineConfig.model_validate({"data": {"loader": {"resolution": {"start": 16, "end": 28, "end_epoch": 4}}}})
    job = training_job(c, _version(), il_path="scores.npy")
    assert job.data.loader.resolution.start == 16
    assert job.eval_data.loader.resolution is None  # accuracy is measured at full size


def test_holdout_is_kept_only_for_a_method_that_trains_an_il_model():
    assert PipelineConfig.model_validate({"selection": {"method": "rho_loss"}}).data.ingest.holdout_fraction == 0.1
    for method in ("none", "infobatch", "uniform"):
        c = PipelineConfig.model_validate({"selection": {"method": method}})
        assert c.data.ingest.holdout_fraction == 0.0  # trained on instead
        assert PipelineConfig.model_validate(c.model_dump(mode="json")) == c  # stable round trip
    given = {"selection": {"method": "none"}, "data": {"ingest": {"holdout_fraction": 0.2}}}
    assert PipelineConfig.model_validate(given).data.ingest.holdout_fraction == 0.2


def test_promotion_decides_on_val_and_training_curves_report_test():
    from sluice.flows.pipeline import training_job
    c = PipelineConfig()
    assert (c.promotion.eval_split, c.promotion.metric, c.promotion.report_split) == ("val", "val_acc", "test")
    assert training_job(c, _version(), il_path="scores.npy").eval_data.loader.split == "test"


def test_auto_ranks_on_pinned_nodes_follow_each_nodes_cores():
    """nproc auto with launch.nodes: ranks per node from the cores a node is pinned to, not
    this machine's count (a simulated node pinned to one core runs one rank)."""
    nodes = [{"address": "10.213.0.1", "cpus": "0"}, {"address": "10.213.0.2", "cpus": "1"}]
    assert PipelineConfig.model_validate({"launch": {"nodes": nodes}}).ranks() == 1
    wide = [{"address": "10.213.0.1", "cpus": "0-2,5"}, {"address": "10.213.0.2", "cpus": "4,6-8"}]
    assert PipelineConfig.model_validate({"launch": {"nodes": wide}}).ranks() == 4
    assert PipelineConfig.model_validate({"nproc": 3, "launch": {"nodes": nodes}}).ranks() == 3


# ---------------------------------------------------------------- recipes and `sluice config show`

def test_the_recipe_is_where_pipeline_defaults_come_from(monkeypatch, tmp_path):
    """Change a value in the recipe file and the pipeline's default follows; the stage config's
    own default does not move (recipes are the one place pipeline defaults live)."""
    import sluice.flows.recipe as recipe
    from sluice.stages.train.config import TrainConfig
    assert PipelineConfig().train.lr == 0.2 and TrainConfig().lr == 0.1
    fake = tmp_path / "recipes"
    fake.mkdir()
    (fake / "default.yaml").write_text((recipe.RECIPES_DIR / "default.yaml").read_text().replace("lr: 0.2", "lr: 0.3"))
    monkeypatch.setattr(recipe, "RECIPES_DIR", fake)
    assert PipelineConfig().train.lr == 0.3 and TrainConfig().lr == 0.1


def test_the_demo_recipe_is_the_default_with_a_shorter_budget():
    default, demo = PipelineConfig(), PipelineConfig(recipe="demo")
    assert (default.train.epochs, demo.train.epochs) == (5.5, 3.5)
    assert demo.model_copy(update={"recipe": "default", "train": default.train}) == default


@pytest.mark.parametrize("name,match", [("../../etc/passwd", "letters, digits"), ("nope", "unknown recipe.*default")])
def test_a_recipe_is_named_never_a_path(name, match):
    with pytest.raises(ConfigError, match=match):
        load_config(PipelineConfig, None, [f"recipe={name}"])


def test_a_method_hook_or_model_change_drops_the_recipes_knobs_for_the_old_one(monkeypatch, tmp_path):
    import sluice.flows.recipe as recipe
    fake = tmp_path / "recipes"
    fake.mkdir()
    (fake / "default.yaml").write_text(
        "data: {kind: image, source: fashion-mnist}\n"
        "selection: {method: infobatch, params: {prune: 0.3}}\n"
        "train: {model: small_cnn, model_kwargs: {width: 8}, comm: {mode: powersgd, params: {rank: 4}}}\n")
    monkeypatch.setattr(recipe, "RECIPES_DIR", fake)
    kept = PipelineConfig()
    assert (kept.selection.params["prune"], kept.train.comm.params["rank"], kept.train.model_kwargs) == (0.3, 4, {"width": 8})
    c = load_config(PipelineConfig, None, ["selection.method=rho_loss", "train.comm.mode=fp16", "train.model=bn_cnn"])
    assert c.selection.method == "rho_loss" and "prune" not in c.selection.params
    assert c.train.comm.params == {} and c.train.model_kwargs == {}


@pytest.mark.parametrize("section,match", [
    ({"selection": {"method": "infobatch", "params": {"beta": 2}}}, r"params.beta: unknown key \(it takes: prune, anneal, sync_every, mode\)"),
    ({"train": {"comm": {"mode": "fp16", "params": {"rank": 1}}}}, r"compression hook 'fp16': params.rank: unknown key"),
    ({"selection": {"method": "none", "params": {"prune": 0.1}}}, "takes no params"),
])
def test_each_method_and_hook_checks_its_own_params(section, match):
    with pytest.raises(ConfigError, match=match):
        load_config(PipelineConfig, None, [], base=section)


def test_config_show_prints_the_resolved_config_a_run_would_use(capsys):
    """The printed YAML validates back to exactly the config the demo runs with, --set applied."""
    import yaml
    from sluice.flows.cli import main
    assert main(["config", "show", "--recipe", "demo", "--set", "train.lr=0.05"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# the config a run would use: recipe 'demo'") and "resolved for this host" in out
    shown = yaml.safe_load(out)
    assert shown["train"]["epochs"] == 3.5 and shown["train"]["lr"] == 0.05
    assert isinstance(shown["train"]["batch_size"], int)  # "auto" resolved
    assert shown["selection"]["params"] == {"prune": 0.5, "anneal": 0.875, "sync_every": 16, "mode": "auto"}
    assert PipelineConfig.model_validate(shown) == load_config(PipelineConfig, None, ["train.lr=0.05"],
                                                              base={"recipe": "demo"})


def test_each_loader_backend_checks_its_own_params():
    from sluice.stages.load import LoaderConfig
    c = LoaderConfig(backend="auto", backend_params={"webdataset": {"streaming": True}})
    assert c.params_for("webdataset") == {"streaming": True, "shuffle_buffer": 1000}
    assert LoaderConfig().params_for("webdataset")["streaming"] is False and LoaderConfig().params_for("memory") == {}
    with pytest.raises(ValueError, match=r"loader backend 'webdataset': params.shuffle: unknown key \(it takes: streaming, shuffle_buffer\)"):
        LoaderConfig(backend_params={"webdataset": {"shuffle": 10}})
    with pytest.raises(ValueError, match="loader backend 'memory' takes no params"):
        LoaderConfig(backend_params={"memory": {"streaming": True}})
    with pytest.raises(ValueError, match="nope"):
        LoaderConfig(backend_params={"nope": {}})
