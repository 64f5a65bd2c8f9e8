"""The kind of data is a registered axis: a third kind is one entry (here a toy kind of sprite
images kept in plain ``.npz`` files, registered by this test) and the nightly flow prepares,
verifies, trains, grades and promotes it without knowing it; the pipeline config's ``data:``
section takes the shape the kind declares; and no module of the flows or the run branches on
which kind it runs."""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
import torch

from sluice.errors import ArtifactError
from sluice.stages.kinds import DATA_KINDS, DataConfig, DataKind, DatasetVersion, Grade, SourceVersion
from sluice.stages.load.specs import ArraysData
from sluice.stages.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- a kind registered outside Sluice

class SpriteData(DataConfig):
    """Sprites: one ``.npz`` source (``images`` N×8×8 uint8, ``labels``), a fourth of it held out."""
    kind: Literal["test_sprites"] = "test_sprites"
    every: int = 4  # every n-th sprite is a val sprite


class SpriteVersion(DatasetVersion):
    kind: Literal["test_sprites"] = "test_sprites"
    classes: int


def _write(path: Path, arrays: dict[str, np.ndarray]) -> str:
    np.savez(path, **arrays)
    return hashlib.sha256(path.read_bytes()).hexdigest()


@DATA_KINDS.register("test_sprites")
class SpriteKind(DataKind):
    """Its artifact: ``<name>/<fingerprint16>/{train,val}.npz`` and a manifest of their sha256."""
    name = "test_sprites"
    Config = SpriteData
    Version = SpriteVersion
    task = "classify"
    metric = "acc"
    samples = "sprites"

    def prepare(self, data: SpriteData, datasets_dir: Path, *, log, map_shards=None) -> SpriteVersion:
        (s,) = data.sources
        raw = Path(s.source).read_bytes()
        fp = hashlib.sha256(raw + str(data.every).encode()).hexdigest()
        out = Path(datasets_dir) / s.name / fp[:16]
        reused = (out / "manifest.json").is_file()
        if not reused:
            z = np.load(s.source)
            keys = np.array([f"s{i}" for i in range(len(z["labels"]))])
            val = np.arange(len(keys)) % data.every == 0
            out.mkdir(parents=True)
            sums = {split: _write(out / f"{split}.npz", {"images": z["images"][m], "labels": z["labels"][m],
                                                         "keys": keys[m]})
                    for split, m in (("train", ~val), ("val", val))}
            (out / "manifest.json").write_text(json.dumps({"sha256": sums, "counts": {"train": int((~val).sum()),
                                                                                     "val": int(val.sum())}}))
        m = json.loads((out / "manifest.json").read_text())
        log(f"sprites {s.name}: {'reused' if reused else 'written'} at {out}")
        src = SourceVersion(name=s.name, location=s.source, root=str(out), fingerprint=fp, weight=s.weight,
                            counts=m["counts"], reused=reused)
        return SpriteVersion(fingerprint=fp, sources=[src], counts=src.counts, reused=reused,
                             classes=int(np.load(out / "train.npz")["labels"].max()) + 1)

    def verify(self, version: DatasetVersion, data: DataConfig, log, *, parts=None) -> dict[str, Any]:
        root = Path(version.root)
        sums = json.loads((root / "manifest.json").read_text())["sha256"]
        bad = [f for f, h in sums.items() if hashlib.sha256((root / f"{f}.npz").read_bytes()).hexdigest() != h]
        if bad:
            raise ArtifactError(f"damaged sprite files: {bad}")
        log(f"sprites: {len(sums)} files match their checksums")
        return {"ok": True, "samples": sum(version.counts.values()), "unchecked": [], "damaged": [],
                "damaged_count": 0}

    def train_config(self, train: TrainConfig, version: SpriteVersion) -> TrainConfig:
        return train.model_copy(update={"in_channels": 1, "num_classes": version.classes})

    def data_specs(self, train, data, version, *, eval_split, batch_size, selects, subsets=None, verified=False):
        root = Path(version.root)
        return (ArraysData(path=str(root / "train.npz"), batch_size=batch_size),
                ArraysData(path=str(root / f"{eval_split}.npz"), batch_size=64))

    def lineage_keys(self, version: DatasetVersion, split: str) -> list[str]:
        return [str(k) for k in np.load(Path(version.root) / f"{split}.npz")["keys"]]

    def grade(self, checkpoint, version, split, *, data, files, facts) -> Grade:
        from sluice.stages.load.arrays import ArrayLoader
        from sluice.stages.train.evaluate import model_from_checkpoint
        model, cfg = model_from_checkpoint(checkpoint)
        z = np.load(Path(version.root) / f"{split}.npz")
        loader = ArrayLoader(z["images"], z["labels"], 64, shuffle=False, drop_last=False, even=False,
                             normalize={"mean": cfg["normalize_mean"], "std": cfg["normalize_std"]})
        hits = loss = 0.0
        with torch.no_grad():
            for x, y, _ in loader:
                out = model(x).float()
                hits += float((out.argmax(1) == y).sum())
                loss += float(torch.nn.functional.cross_entropy(out, y, reduction="sum"))
        n = len(z["labels"])
        return Grade(value=hits / n, loss=loss / n, acc=hits / n, n=n)

    def describe(self, version: SpriteVersion) -> list[str]:
        return [f"- sprites: {version.classes} classes"]


def sprites(path: Path, n: int = 240, seed: int = 0) -> Path:
    """Learnable 8×8 sprites: a horizontal or a vertical bar (the label) on noise."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n)
    images = rng.integers(0, 60, (n, 8, 8)).astype(np.uint8)
    at = rng.integers(1, 7, n)
    for i in range(n):
        if labels[i]:
            images[i, :, at[i]] = 255
        else:
            images[i, at[i], :] = 255
    np.savez(path, images=images, labels=labels)
    return path


NIGHTS = """
import json, sys
import tests.test_kinds  # registers the sprite kind in this process, as a user's package would
import sluice.flows.nightly as fl
from sluice.flows.pipeline import PipelineConfig
c = PipelineConfig.model_validate(json.loads(sys.argv[1]))
assert type(c.data).__name__ == "SpriteData" and c.promotion.metric == "val_acc" and c.kind().name == "test_sprites"
for night in range(2):
    r = fl.nightly(c)
    print("RESULT " + json.dumps({"promotion": r["promotion"], "dataset": r["dataset"].model_dump(mode="json"),
                                  "version_type": type(r["dataset"]).__name__, "verify": r["verify"],
                                  "steps": r["train"]["steps"], "run_dir": r["run_dir"]}, default=str), flush=True)
"""


@pytest.mark.slow
def test_a_kind_registered_in_one_entry_runs_the_nightly_flow(tmp_path):
    """Prepared, verified, trained, graded and promoted by the same flow the built-in kinds run:
    the flow asks the kind, never which kind it is. A second night on the same data trains again
    and is compared with the first on the same split."""
    import subprocess
    import sys
    from sluice.storage.registry import Registry
    cfg = {"data_root": str(tmp_path / "data"), "nproc": 1, "keep_versions": None,
           "data": {"kind": "test_sprites", "source": str(sprites(tmp_path / "sprites.npz"))},
           "selection": {"method": "none"}, "warm": {"init": "scratch"}, "promotion": {"report_split": "val"},
           "train": {"model": "small_cnn", "model_kwargs": {"width": 8}, "max_steps": 30, "batch_size": 32,
                     "lr": 0.05, "ema_decay": None, "eval_tta": "none", "channels_last": False,
                     "normalize_mean": [0.2], "normalize_std": [0.3], "eval_every_steps": 15}}
    out = subprocess.run([sys.executable, "-c", NIGHTS, json.dumps(cfg)], capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    first, second = (json.loads(x[len("RESULT "):]) for x in text.splitlines() if x.startswith("RESULT "))
    p = first["promotion"]
    assert first["version_type"] == "SpriteVersion" and first["dataset"]["classes"] == 2
    assert first["verify"]["ok"] and first["steps"] == 30
    assert p["promoted"] and p["metric"] == "val_acc" and p["candidate_value"] > 0.8, p
    assert p["unseen"]["samples_checked"] == first["dataset"]["counts"]["val"]
    assert second["dataset"]["reused"] and second["promotion"]["champion_before"] == p["model_id"]
    assert second["promotion"]["unseen"]["champion_samples_checked"] is None  # the same split: the recorded value
    reg = Registry(tmp_path / "data" / "registry")
    assert len(reg.list()) == 2 and reg.get(p["model_id"]).metrics["data"]["kind"] == "test_sprites"
    assert "sprites: 1 files match" not in text and "sprites: 2 files match their checksums" in text


# ---------------------------------------------------------------- the data section

def test_the_data_section_takes_the_shape_its_kind_declares():
    from sluice.flows.pipeline import PipelineConfig
    from sluice.stages.kinds.image import ImageData
    from sluice.stages.kinds.tokens import TokenData
    c = PipelineConfig.model_validate({"data": {"source": "photos/"}})
    assert type(c.data) is ImageData and c.data.names == ["photos"]  # the default recipe's kind
    assert c.data.sources[0].source == "photos/"
    text = PipelineConfig.model_validate({"recipe": "text", "data": {"source": "notes/", "name": "n"}})
    assert type(text.data) is TokenData and text.data.names == ["n"]
    # naming another kind replaces the recipe's data section whole: the image knobs do not leak in
    other = PipelineConfig.model_validate({"data": {"kind": "tokens", "source": "notes/"}, "train": {"model": "gpt"},
                                          "promotion": {"report_split": "val"}})
    assert type(other.data) is TokenData and other.promotion.metric == "val_bpb"
    dumped = c.model_dump(mode="json")
    assert dumped["data"]["kind"] == "image" and "source" not in dumped["data"]  # shorthand only as input
    assert PipelineConfig.model_validate(dumped) == c


@pytest.mark.parametrize("old,where", [({"prepare": {"ingest": {"limit": 5}}}, "data.ingest"),
                                       ({"loader": {"prefetch": 1}}, "data.loader"),
                                       ({"text": {"sources": []}}, "data.kind: tokens"),
                                       ({"dataset_name": "x"}, "data.name")])
def test_a_section_from_before_the_one_data_section_says_where_it_moved(old, where):
    from sluice.flows.pipeline import PipelineConfig
    with pytest.raises(ValueError, match=re.escape(where)):
        PipelineConfig.model_validate(old)


def test_each_kind_refuses_what_it_cannot_train_before_anything_runs():
    from sluice.flows.pipeline import PipelineConfig
    for bad, match in [({"data": {"source": "a"}, "train": {"model": "gpt"}}, "trains classifiers"),
                       ({"data": {"sources": [{"name": "a", "source": "a"}, {"name": "b", "source": "b"}]},
                         "selection": {"method": "rho_loss"}}, "needs? one source|one source's holdout"),
                       ({"data": {"ingest": {"source": "x"}}}, "data.sources"),
                       ({"data": {"kind": "nope"}}, "unknown kind of data 'nope'")]:
        with pytest.raises(ValueError, match=match):
            PipelineConfig.model_validate(bad)


# ---------------------------------------------------------------- one house

KIND_BRANCH = re.compile(r"\.kind\s*[!=]=|[!=]=\s*['\"](image|tokens|text|artifact)['\"]|\b(TokenKind|ImageKind|"
                         r"TokenData|ImageData|TokenVersion|ImageVersion|is_token_artifact|detect_text_source)\b"
                         r"|\bc\.text\b|modality")


def test_no_module_of_the_flows_or_the_run_branches_on_the_kind_of_data():
    """What differs by kind is the kind's (``stages/kinds``): the flows and the run only call it."""
    found = []
    for path in sorted([*(ROOT / "flows").rglob("*.py"), *(ROOT / "stages" / "run").rglob("*.py")]):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if KIND_BRANCH.search(line.split("#")[0]):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == []


def test_the_trainer_reads_batches_and_loaders_by_their_fields_never_by_probing():
    found = []
    for path in sorted((ROOT / "stages" / "train").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\b(getattr|hasattr)\((batch|loader|selector|self\.selector|train_job|data)\b", line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == []


def test_a_champion_of_another_kind_is_neither_warm_started_nor_graded(tmp_path):
    """One registry per kind of data: a text night on a data root whose champion is an image
    classifier says so, instead of failing on a missing tokenizer or comparing accuracy with
    bits per byte; the registry stays as it was."""
    from sluice.errors import RegistryError
    from sluice.stages.kinds.tokens import TokenData, TokenKind, TokenVersion
    from sluice.stages.run.promote import PromotionConfig, evaluate_and_promote
    from sluice.stages.run.warm import WarmStartConfig, plan_start
    from sluice.storage.registry import Candidate, Registry
    reg = Registry(tmp_path / "reg")
    ckpt = tmp_path / "c.pt"
    ckpt.write_bytes(b"weights")
    rec = reg.register(Candidate(ckpt, dataset_fingerprint="f" * 64, eval_split="f/val", metric="val_acc", value=0.9))
    reg.promote_if_better(rec)  # a record from before kinds were recorded: an image model
    kind = TokenKind()
    source = SourceVersion(name="a", location="x", root=str(tmp_path / "nowhere"), fingerprint="a" * 64,
                           counts={"train": 5, "val": 2})
    version = TokenVersion(fingerprint="v" * 64, sources=[source], counts=source.counts, vocab_size=300, eot=0,
                           tokenizer_sha256="t" * 64, tokenizer_file="/t.json", tokens=source.counts)
    start = plan_start(WarmStartConfig(init="auto"), kind, version, TrainConfig(model="gpt"), "none", reg.root, None,
                       tmp_path / "run")
    assert start.plan is None and "data.kind image" in start.why
    with pytest.raises(RegistryError, match="model of data.kind image and tonight trains tokens"):
        evaluate_and_promote(kind, PromotionConfig().for_kind(kind), reg.root, tmp_path, version,
                             TokenData(source="x"), {"checkpoint": str(ckpt), "summary": {}}, {}, needs_il=False,
                             config={})
    assert [r.model_id for r in reg.list()] == [rec.model_id]
