"""``image``: labelled images (an IDX set, an image folder, an ``.npz``, WebDataset shards) become
dataset artifacts (``stages/data``: tar shards, DALI indexes, an FFCV ``.beton``), are read by
the image ``Loader`` (decode and augment on the rank's device; several sources mixed by weight)
and train a classifier, promoted by accuracy on the eval split.

A night's sources are ``data.sources`` (one is a mixture of one), each sharded into
``datasets/<name>/`` with the section's ``ingest`` and ``shard`` settings. One source keeps every
name as it was: its version's fingerprint is the night's, its samples' keys are their lineage
keys; several are named by source (``<name>/<key>``) and fingerprinted together. Every method
selects images; one that trains an irreducible-loss model on a holdout needs one source.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import numpy as np
from pydantic import Field, model_validator

from sluice.errors import SelectionError, StorageError
from sluice.stages.data.config import IngestConfig, PrepareConfig, ShardConfig
from sluice.stages.kinds.base import (DATA_KINDS, DataConfig, DataKind, DatasetVersion, Grade, Log, Servable, SourceVersion,
                                      WarmSource)
from sluice.stages.data.stats import image_stats
from sluice.stages.kinds.image_recipe import ImageRecipe, resolve, train_ops
from sluice.stages.load import AugmentSpec, LoaderConfig, SamplerConfig
from sluice.stages.load.augment import Normalize, eval_resize
from sluice.stages.load.canvas import stored_channels
from sluice.stages.load.specs import ImagesData
from sluice.stages.select import SELECTION_METHODS
from sluice.stages.select.config import SelectionConfig
from sluice.stages.train.config import TrainConfig
from sluice.stages.train.dist import wants_cuda
from sluice.storage.artifact import open_artifact
from sluice.storage.fingerprint import combine
from sluice.storage.lineage import IMAGE_SPLIT_RULE
from sluice.storage.manifest import ImageStats, SizeSummary, Spread

# Evaluation reads every sample of the eval split once, in order, at a batch size that keeps its
# per-batch overhead small; it never augments beyond normalising.
EVAL_BATCH = 500


class SourceSplits(IngestConfig):
    """How each image source's samples are split into train, holdout, val and test (its
    ``source`` is the data source's: never set here)."""
    source: str | None = Field(None, exclude=True, description="(the data source's)")


class ImageData(DataConfig):
    """Images: the sources, how each is split (``ingest``) and sharded (``shard``), the training
    augmentation (normalisation is added from ``train.normalize_*``) and the loader."""
    kind: Literal["image"] = "image"
    ingest: SourceSplits = Field(default_factory=SourceSplits, description="how each source's samples are split "
                                 "(its source is the data source's)")
    shard: ShardConfig = Field(default_factory=ShardConfig)
    augment: AugmentSpec = Field(default_factory=AugmentSpec,
                                 description="training augmentation; normalisation is added from train.normalize_*")
    loader: LoaderConfig = Field(default_factory=LoaderConfig)

    @model_validator(mode="after")
    def _source_is_the_sources(self) -> "ImageData":
        if self.ingest.source is not None:
            raise ValueError("data.ingest.source: a night's images come from data.sources (or data.source)")
        return self

    def with_seed(self, seed: int) -> "ImageData":
        """The loader's augmentation draws and the sampler's order follow the run's seed unless set."""
        for part in (self.loader, self.loader.sampler):
            if "seed" not in part.model_fields_set:
                part.seed = seed
        return self

    def split_fraction(self, split: str) -> float | None:
        return {"holdout": self.ingest.holdout_fraction, "val": self.ingest.val_fraction}.get(split)

    def loader_device(self) -> str:
        return self.loader.device

    def prepare_config(self, source: str) -> PrepareConfig:
        """What ``stages/data`` shards one source with."""
        return PrepareConfig(ingest=IngestConfig.model_validate({**self.ingest.model_dump(), "source": source}),
                             shard=self.shard)


class ImageVersion(DatasetVersion):
    """The night's image versions, and what a model built for them needs to know: channels,
    classes, the one size every image has (None where sizes vary) and the train split's
    statistics (pixel mean and std per channel, sizes) that ``auto`` settings resolve from."""
    kind: Literal["image"] = "image"
    channels: int
    num_classes: int
    damaged_sources: int = 0
    shape: tuple[int, int] | None = None
    stats: ImageStats | None = None


@DATA_KINDS.register("image")
class ImageKind(DataKind):
    name = "image"
    Config = ImageData
    Version = ImageVersion
    ShardConfig = PrepareConfig
    task = "classify"
    metric = "acc"
    higher_is_better = True
    samples = "samples"
    curve = ("acc", "accuracy", (0.0, 1.0))
    split_rule = IMAGE_SPLIT_RULE
    trains = "classifiers (a language model trains on data.kind: tokens)"
    input_settings = "data.shard.image_size (the size images are stored at) or data.loader.resolution"

    # ------------------------------------------------------------------ preparation
    def claims(self, source: str) -> bool:
        from sluice.stages.data.ingest import NAMED_SOURCES, detect_kind
        from sluice.stages.data.text.sources import detect_text_source
        if source in NAMED_SOURCES:
            return True
        if detect_text_source(source) is not None:
            return False
        try:
            detect_kind(source)
        except StorageError:
            return False
        except Exception:  # noqa: BLE001 - a source no image reader recognises is not an image source
            return False
        return True

    def owns(self, artifact: str | os.PathLike) -> bool:
        try:
            open_artifact(artifact)
        except (StorageError, OSError, ValueError):
            return False
        return True

    def shard_overrides(self, source: str) -> list[str]:
        return [f"ingest.source={source}"]

    def shard(self, source: str, out: str | os.PathLike, config: PrepareConfig, progress: bool,
              map_shards: Callable | None = None) -> str:
        from sluice.stages.data.shard import shard_dataset
        if not progress:
            config.shard.progress = False
        return shard_dataset(config.ingest, out, config.shard, map_shards=map_shards).format()

    def verify_artifact(self, artifact: str | os.PathLike, full: bool, *,
                        parts: Any = None) -> tuple[bool, dict[str, Any], str]:
        from sluice.stages.data.verify import verify_artifact
        r = verify_artifact(artifact, full=full, parts=parts)
        return r.ok, r.to_dict(), r.format()

    def prepare(self, data: ImageData, datasets_dir: Path, *, log: Log,
                map_shards: Callable | None = None) -> ImageVersion:
        from sluice.stages.data.shard import shard_dataset
        written = []
        for s in data.sources:
            p = data.prepare_config(s.source)
            summary = shard_dataset(p.ingest, Path(datasets_dir) / s.name, p.shard, map_shards=map_shards)
            log("\n" + summary.format())
            written.append(self._source(s.name, summary.root, weight=s.weight, location=s.source,
                                        reused=summary.reused, seconds=summary.seconds))
        return self._version(written)

    def version_of(self, roots: Sequence[str | os.PathLike], names: Sequence[str] | None = None,
                   weights: Sequence[float] | None = None) -> ImageVersion:
        """The version of artifacts written already (each a version, or a dataset root with LATEST):
        what a script of your own assembles a job over."""
        names = list(names) if names is not None else [Path(open_artifact(r).root).parent.name for r in roots]
        weights = list(weights) if weights is not None else [1.0] * len(names)
        return self._version([self._source(n, r, weight=w, reused=True) for n, r, w in zip(names, roots, weights)])

    @staticmethod
    def _source(name: str, root: str | os.PathLike, *, weight: float, location: str = "", reused: bool,
                seconds: float = 0.0) -> tuple[SourceVersion, Any]:
        art = open_artifact(root)
        m = art.manifest
        return SourceVersion(name=name, location=location or m.source.uri, root=str(art.root), fingerprint=m.fingerprint,
                             weight=weight, counts=m.counts(), reused=reused, quarantined=m.quarantined,
                             seconds=seconds, delta=m.delta.model_dump() if m.delta is not None else None), art

    def _version(self, written: list[tuple[SourceVersion, Any]]) -> ImageVersion:
        out, arts = [s for s, _ in written], [a for _, a in written]
        if len(arts) > 1:  # one model reads every batch: the sources must agree (named when they do not)
            from sluice.stages.load.source_reads import check_compatible
            check_compatible(arts, [s.name for s in out])
        m = arts[0].manifest
        shapes = {a.manifest.fields.image.shape for a in arts}
        shape = next(iter(shapes)) if len(shapes) == 1 else None
        stats = train_stats(arts)
        splits = sorted({k for s in out for k in s.counts})
        fingerprint = out[0].fingerprint if len(out) == 1 else \
            combine("image-sources", *(f"{s.name}:{s.fingerprint}" for s in out))
        return ImageVersion(fingerprint=fingerprint, sources=out,
                            counts={k: sum(s.counts.get(k, 0) for s in out) for k in splits},
                            reused=all(s.reused for s in out), quarantined=sum(s.quarantined for s in out),
                            channels=shape[2] if shape else (stats.channels if stats else stored_channels(arts[0])),
                            num_classes=m.fields.label.num_classes, shape=shape[:2] if shape else None, stats=stats,
                            damaged_sources=sum(len(a.manifest.damaged_sources) for a in arts))

    def verify(self, version: DatasetVersion, data: ImageData, log: Log, *, parts: Any = None) -> dict[str, Any]:
        from sluice.stages.data.verify import check_before_training
        summaries = []
        for s in version.sources:
            report, summary = check_before_training(s.root, data.loader.on_corrupt, parts)
            log(report.format())
            summaries.append(summary)
        return {"ok": all(s["ok"] for s in summaries), "samples": sum(s["samples"] for s in summaries),
                "seconds": sum(s["seconds"] for s in summaries),
                "unchecked": [u for s in summaries for u in s["unchecked"]],
                "damaged": [d for s in summaries for d in s["damaged"]][:100],
                "damaged_count": sum(s["damaged_count"] for s in summaries)}

    def irreducible_loss(self, version: DatasetVersion, selection: SelectionConfig, scores_root: str,
                         device: str, parts: Any = None) -> dict[str, Any]:
        """The IL scores a method that needs them selects with (``stages/select/il_carry``);
        the scoring pass in ``parts`` (the engine's) when given."""
        from sluice.stages.load import split_arrays
        from sluice.stages.select.il_carry import describe, il_scores_for_version
        with open_artifact(version.root) as art:
            if art.fingerprint != version.fingerprint:
                raise SelectionError(f"the dataset at {version.root} is version {art.fingerprint[:16]}, "
                                     f"not {version.fingerprint[:16]}")
            # the IL model never trains on removed samples (live_only for the holdout)
            s = il_scores_for_version(selection.il, art, lambda split, live: split_arrays(art, split, live_only=live),
                                      scores_root, device=device, parts=parts)
        return {"path": s.path, "describe": describe(s),
                **{k: v for k, v in s.extra.items() if isinstance(v, (int, float, bool, str))}}

    # ------------------------------------------------------------------ the training job
    def selection_refusal(self, method: str, data: DataConfig) -> str | None:
        if method != "none" and SELECTION_METHODS.get(method).needs_il and len(data.sources) > 1:
            return (f"selection method {method!r} trains its irreducible-loss model on one source's holdout: "
                    f"give it one source (data has {len(data.sources)})")
        return None

    def train_config(self, train: TrainConfig, version: ImageVersion) -> TrainConfig:
        """The version's channels and classes, and what ``auto`` resolves to for its images
        (``image_recipe``: input size, model, normalisation)."""
        return train.model_copy(update={"in_channels": version.channels, "num_classes": version.num_classes,
                                        **_recipe(train, version).updates})

    def explain(self, train: TrainConfig, version: ImageVersion) -> list[str]:
        return _recipe(train, version).notes

    def data_specs(self, train: TrainConfig, data: ImageData, version: DatasetVersion, *, eval_split: str,
                   batch_size: int, selects: bool, subsets: dict[str, str] | None = None,
                   verified: bool = False) -> tuple[ImagesData, ImagesData]:
        norm = Normalize(mean=train.normalize_mean, std=train.normalize_std)
        loader = data.loader.model_copy(update={"verify": "none"}) if verified else data.loader
        train_loader = loader.model_copy(update={
            "split": "train", "batch_size": batch_size, "drop_last": True,
            "augment": AugmentSpec(ops=[*train_ops(data.augment.ops, train.input_size), norm],
                                   channels_last=data.augment.channels_last or train.channels_last)})
        eval_loader = loader.model_copy(update={
            "split": eval_split, "batch_size": EVAL_BATCH, "drop_last": False,
            "augment": AugmentSpec(ops=[*eval_resize(train.input_size), norm]),
            "resolution": None, "sampler": SamplerConfig(kind="sequential")})
        several = len(version.sources) > 1
        trained = {"sources": [{"path": s.root, "name": s.name, "weight": s.weight,
                                "subset": (subsets or {}).get(s.name)} for s in version.with_counts("train")],
                   "epoch_size": data.epoch_size if several else None, "seed": train_loader.seed}
        graded = {"sources": [{"path": s.root, "name": s.name, "repeat": 1.0} for s in version.with_counts(eval_split)]}
        return (ImagesData(mixture=trained, loader=train_loader), ImagesData(mixture=graded, loader=eval_loader))

    # ------------------------------------------------------------------ lineage, grading, warm start
    def _keyed(self, version: DatasetVersion, name: str, keys: Sequence[str]) -> list[str]:
        """Lineage keys: one source's as they are; several's named by source."""
        return list(keys) if len(version.sources) == 1 else [f"{name}/{k}" for k in keys]

    def lineage_keys(self, version: DatasetVersion, split: str) -> list[str]:
        out: list[str] = []
        for s in version.with_counts(split):
            out += self._keyed(version, s.name, open_artifact(s.root).keys(split))
        return out

    def grade(self, checkpoint: str | os.PathLike, version: DatasetVersion, split: str, *,
              data: DataConfig, files: dict[str, str], facts: dict[str, Any]) -> Grade:
        from sluice.stages.train.evaluate import evaluate_checkpoint
        each = {s.name: evaluate_checkpoint(checkpoint, s.root, split) for s in version.with_counts(split)}
        if len(each) == 1:
            m = next(iter(each.values()))
            return Grade(value=m["acc"], loss=m["loss"], acc=m["acc"], n=int(m["n"]))
        n = sum(int(m["n"]) for m in each.values())
        acc = sum(m["acc"] * m["n"] for m in each.values()) / max(n, 1)
        loss = sum(m["loss"] * m["n"] for m in each.values()) / max(n, 1)
        return Grade(value=acc, loss=loss, acc=acc, n=n,
                     by_source={k: {"acc": m["acc"], "loss": m["loss"], "n": m["n"]} for k, m in each.items()})

    def servable(self, checkpoint: str | os.PathLike, version: ImageVersion) -> Servable:
        from sluice.stages.models.served import ServedClassifier
        from sluice.stages.train.evaluate import model_from_checkpoint
        model, cfg = model_from_checkpoint(checkpoint)
        side = cfg.get("input_size")
        h, w = (side, side) if side else (version.shape or (model_min_side(cfg), model_min_side(cfg)))
        c = int(cfg.get("in_channels", version.channels))
        module = ServedClassifier(model, cfg.get("normalize_mean", [0.5]), cfg.get("normalize_std", [0.5]),
                                  cfg.get("eval_tta", "none"))
        reads = (f"uint8 images (N, {c}, {h}, {w}), RGB or gray as trained"
                 + (f", each squashed to {side}x{side} px first as grading does" if side else ", as stored")
                 + f"; returns logits (N, {cfg.get('num_classes', version.num_classes)})")
        return Servable(module=module, example=np.zeros((2, c, h, w), np.uint8), shape=(-1, c, h, w), reads=reads)

    def warm_sources(self, version: DatasetVersion, split: str,
                     champion_versions: dict[str, str]) -> list[WarmSource] | str:
        from sluice.storage.ancestry import changes_since
        out = []
        for s in version.with_counts(split):
            art = open_artifact(s.root)
            live = np.zeros(art.manifest.splits[split].count, bool)
            live[art.live(split)] = True  # a removed sample is never trained on
            redo: set[str] = set()
            theirs = champion_versions.get(s.name)
            if theirs is not None:
                since = changes_since(s.root, theirs)
                if isinstance(since, str):
                    return f"the champion's version of source {s.name!r} cannot be traced to tonight's: {since}"
                # new pixels, a new label or a removed-then-returned key since the champion's version:
                # the champion learnt something else under that key, so the sample counts as new
                redo = set(self._keyed(version, s.name, since.relabelled | since.changed | since.removed))
            out.append(WarmSource(name=s.name, root=s.root, keys=self._keyed(version, s.name, art.keys(split)),
                                  live=live, redo=redo))
        return out

    def champion_losses(self, checkpoint: str | os.PathLike, version: DatasetVersion, split: str,
                        indices: np.ndarray) -> np.ndarray:
        from sluice.stages.train.loss_cache import losses_by_key
        roots = version.with_counts(split)
        sizes = np.cumsum([0] + [s.counts[split] for s in roots])
        src = np.searchsorted(sizes, indices, side="right") - 1
        out = np.empty(len(indices), np.float32)
        for i, s in enumerate(roots):
            at = np.flatnonzero(src == i)
            if len(at):
                out[at] = losses_by_key(checkpoint, s.root, split, indices[at] - sizes[i]).values
        return out

    def carry_selector(self, table: Any, champion_versions: dict[str, str], version: DatasetVersion, split: str,
                       learnt: np.ndarray, out: Path) -> Any:
        """InfoBatch's table from the champion, matched into tonight's index for the ``learnt``
        samples (one source: its table is indexed by the source's split)."""
        from sluice.stages.select.infobatch_carry import CarriedTable, carry_table
        from sluice.storage.ancestry import changes_since
        if len(version.sources) > 1 or len(champion_versions) != 1:
            return CarriedTable(None, 0, "InfoBatch starts empty: a table is carried over one source's samples")
        s = version.sources[0]
        since = changes_since(s.root, next(iter(champion_versions.values())))
        if isinstance(since, str):
            return CarriedTable(None, 0, f"InfoBatch starts empty: {since}")
        return carry_table(table, since.root, s.root, split, learnt, out)

    def reread_lineage(self, fingerprint: str, datasets_dir: Path, names: Sequence[str] = ()) -> np.ndarray | None:
        """The train and holdout keys of a version named by ``fingerprint`` under one of the
        dataset folders (a record from before lineage was kept: holdout too, whatever its
        selection was: a superset can only refuse more)."""
        from sluice.storage.lineage import split_key_hashes
        for root in [Path(datasets_dir) / n / fingerprint[:16] for n in names] + [Path(datasets_dir) / fingerprint[:16]]:
            if (root / "manifest.json").is_file():
                return split_key_hashes(root, ["train", "holdout"])
        return None

    def describe(self, version: ImageVersion) -> list[str]:
        lines = [f"- images: {version.channels} channels, {version.num_classes} classes"]
        if version.damaged_sources:
            lines.append(f"- **damaged source files kept in part: {version.damaged_sources}** (see the manifest)")
        return lines


def model_min_side(cfg: dict[str, Any]) -> int:
    """The smallest side the checkpoint's model takes (where its images' size is unknown)."""
    from sluice.stages.models.base import min_input_size
    return max(28, min_input_size(cfg.get("model", "small_cnn")) or 0)


def _recipe(train: TrainConfig, version: ImageVersion) -> ImageRecipe:
    """``train``'s ``auto`` settings resolved for ``version``'s images on the device it trains on."""
    return resolve(train, version.stats, version.shape, "cuda" if wants_cuda(train.device) else "cpu")


def train_stats(arts: Sequence[Any]) -> ImageStats | None:
    """The train split's statistics over every source: one source's as recorded (or taken now
    from an artifact written before them); several merged, every pixel counting once (means and
    mean squares weighted by pixels), sizes spanning all (the median short side is the median of
    the sources', weighted by samples: close, not exact)."""
    each = [s for s in (image_stats(a) for a in arts) if s is not None]
    if len(each) <= 1:
        return each[0] if each else None
    if len({s.channels for s in each}) > 1:
        return None  # check_compatible refuses this mixture before a model is built
    px = sum(s.pixels for s in each)
    mean = [sum(s.pixels * s.mean[c] for s in each) / px for c in range(each[0].channels)]
    square = [sum(s.pixels * (s.std[c] ** 2 + s.mean[c] ** 2) for s in each) / px for c in range(each[0].channels)]
    std = [max(q - m * m, 0.0) ** 0.5 for q, m in zip(square, mean)]
    order = sorted(each, key=lambda s: s.sizes.short_side.median)
    half, acc, median = sum(s.samples for s in each) / 2, 0, order[-1].sizes.short_side.median
    for s in order:
        acc += s.samples
        if acc >= half:
            median = s.sizes.short_side.median
            break

    def spread(part: str, mid: float | None = None) -> Spread:
        got = [getattr(s.sizes, part) for s in each]
        return Spread(min=min(g.min for g in got), max=max(g.max for g in got),
                      median=mid if mid is not None else float(np.median([g.median for g in got])))
    sizes = SizeSummary(height=spread("height"), width=spread("width"), short_side=spread("short_side", median),
                        distinct=max(s.sizes.distinct for s in each))
    return ImageStats(split="train", samples=sum(s.samples for s in each), pixels=px, channels=each[0].channels,
                      mean=mean, std=std, sizes=sizes)
