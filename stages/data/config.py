"""The data stage's configs: where samples come from and how they are split (``IngestConfig``),
how they are encoded and cut into shards (``ShardConfig``), and both (``PrepareConfig``, the
input of ``sluice shard`` and of the ``prepare`` flow)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator, model_validator

from sluice.stages.data.sources.base import SOURCES, Source
from sluice.storage.fingerprint import hash_obj

Format = Literal["webdataset", "dali", "ffcv"]
DEFAULT_MAX_PIXELS = 8192 * 8192  # 67 M pixels, 201 MB decoded as RGB
_LATER_DEFAULTS = {"max_pixels": DEFAULT_MAX_PIXELS}  # ShardConfig fields added after version 0.2
ALL_FORMATS: list[Format] = ["webdataset", "dali", "ffcv"]


# Settings that only decide whether a source may be used at all (a damaged file, a lopsided
# folder): the same samples land in the same splits either way, so no fingerprint holds them.
_ACCEPTANCE = {"keep_damaged", "check_classes"}
Encoding = Literal["npy", "png", "jpg"]
# Encoded image formats by what their pixels went through: ``auto`` keeps lossless data lossless.
LOSSY, LOSSLESS = ("jpg", "webp"), ("png", "bmp")


class IngestConfig(BaseModel):
    """Where samples come from and how the source's train split is cut into our splits."""
    model_config = ConfigDict(extra="forbid")

    source: str = "fashion-mnist"
    kind: str = Field("auto", description="auto, or a registered source: idx, folder, npz, webdataset, ...")
    holdout_fraction: float = Field(0.1, ge=0.0, lt=1.0,
                                    description="share of the source's train split held out for RHO-LOSS")
    val_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    test_fraction: float = Field(0.1, ge=0.0, lt=1.0,
                                 description="used only when the source has no test split")
    seed: int = 0
    limit: int | None = Field(None, ge=1, description="first N samples of each source split (quick runs)")
    num_classes: int | None = Field(None, ge=1, description="labels must lie in [0, num_classes)")
    keep_damaged: bool = Field(False, description="shard the readable part of a damaged source file (a "
                               "truncated tar) instead of failing; the damage is recorded in the manifest")
    check_classes: bool = Field(True, description="refuse an image folder with an empty class folder, or with a "
                                "class too small for the split fractions (stages/data/split.py); false: shard "
                                "it as it is (an empty folder keeps its label and gets no samples)")

    @field_validator("kind")
    @classmethod
    def _registered(cls, v: str) -> str:
        return v if v == "auto" else SOURCES.validate(v)

    @model_validator(mode="after")
    def _fractions(self) -> "IngestConfig":
        if self.holdout_fraction + self.val_fraction + self.test_fraction >= 1.0:
            raise ValueError("holdout_fraction + val_fraction + test_fraction must be < 1")
        return self

    def membership_fingerprint(self) -> str:
        """What decides a key's split (not ``limit``, which only decides which keys exist): two
        configs with the same one put every shared key in the same split."""
        return hash_obj(self.model_dump(exclude={"source", "kind", "limit"} | _ACCEPTANCE))

    def split_fingerprint(self) -> str:
        """What, besides the source content, decides which sample lands in which split."""
        return hash_obj(self.model_dump(exclude={"source", "kind"} | _ACCEPTANCE))


class ShardConfig(BaseModel):
    """How samples are encoded and cut into shards."""
    model_config = ConfigDict(extra="forbid")

    encoding: Literal["auto", "npy", "png", "jpg"] = Field(
        "auto", description="auto: jpg (the photos' own bytes kept) for a source of encoded images, png when "
                            "most of them are lossless (PNG, BMP), npy for arrays (IDX, npz); see for_source")
    jpeg_quality: int = Field(90, ge=1, le=100)
    png_level: int = Field(1, ge=0, le=9)
    shard_samples: int = Field(5000, ge=1, description="samples per shard")
    shard_bytes: int | None = Field(None, ge=4096, description="target shard size; overrides shard_samples")
    formats: list[Format] = Field(default_factory=lambda: list(ALL_FORMATS))
    image_size: tuple[PositiveInt, PositiveInt] | None = Field(None, description="resize every image to (H, W)")
    channels: Literal[1, 3] | None = Field(None, description="convert to 1 (gray) or 3 (RGB)")
    max_bad_fraction: float = Field(0.01, ge=0.0, le=1.0)
    max_pixels: int = Field(DEFAULT_MAX_PIXELS, ge=1,
                            description="an image with more pixels (width x height) is quarantined "
                                        "before it is decoded: decompression bombs")
    workers: int | None = Field(None, ge=1, description="processes; default: all cores")
    progress: bool = True
    incremental: bool = Field(True, description="write a new version of a grown or changed source on top of "
                              "the newest one under the same output (LATEST): only new and changed samples "
                              "are written, the rest reused (storage/manifest.py); false: every version whole")
    merge_wait_s: float = Field(60.0, ge=0, description="how long the merge waits for a shard part's completion "
                                "record (storage that shows files late) before it refuses the missing part")

    @model_validator(mode="after")
    def _formats(self) -> "ShardConfig":
        if not self.formats:
            raise ValueError("formats must name at least one of webdataset, dali, ffcv")
        if "dali" in self.formats and "webdataset" not in self.formats:
            raise ValueError("the dali format indexes the WebDataset shards: add webdataset to formats")
        self.formats = [f for f in ALL_FORMATS if f in self.formats]
        if self.image_size is not None and self.image_size[0] * self.image_size[1] > self.max_pixels:
            raise ValueError(f"image_size {list(self.image_size)} is more than max_pixels={self.max_pixels} pixels")
        return self

    def for_source(self, source: "Source") -> "ShardConfig":
        """This config with ``encoding: auto`` made concrete for ``source``: what the shard stage
        fingerprints, writes and records, so an artifact made before ``auto`` existed (at the old
        default, npy) is found again, and so is one made with the encoding ``auto`` picks.

        The source declares what it holds from its listing (``Source.image_formats``: file or
        tar member extensions, no byte read), rather than the first samples being sniffed: the
        answer is the same whatever the order, ``limit`` or number of workers, and known before
        anything is hashed. The rule:

        * arrays (IDX, npz, ``.npy`` members), or a source that cannot tell: ``npy``, raw pixels;
        * encoded images, most of them lossless (PNG, BMP: more than half): ``png``, so data that
          was never lossy (scans, renders, masks, screenshots) is not made lossy by sharding;
        * otherwise (JPEG, WebP, or a mix with at most half lossless): ``jpg``. A JPEG whose bytes
          already decode to the stored pixels goes into the artifact as it is (no re-encoding,
          ``SampleEncoder.members``), so a photo loses nothing more; the rest are re-encoded.

        A file's extension may lie (a ``.jpg`` holding PNG bytes): it only steers this choice,
        every sample is decoded by its content and re-encoded when its bytes are not in the
        chosen format."""
        if self.encoding != "auto":
            return self
        return self.model_copy(update={"encoding": auto_encoding(source.image_formats())})

    def content_fingerprint(self) -> str:
        """Only what changes the bytes written: not workers or progress bars. Options added
        later count only when set away from their default, so existing artifacts keep their
        fingerprints. Take it of a resolved config (``for_source``): ``auto`` means nothing on
        its own."""
        later = {k for k, v in _LATER_DEFAULTS.items() if getattr(self, k) == v}
        how = {"workers", "progress", "max_bad_fraction", "incremental", "merge_wait_s"}  # how, not what, is written
        return hash_obj(self.model_dump(exclude=how | later))


def auto_encoding(formats: dict[str, int]) -> Encoding:
    """``encoding: auto``'s choice from a source's sample counts by stored format (see
    ``ShardConfig.for_source``)."""
    lossy = sum(formats.get(f, 0) for f in LOSSY)
    lossless = sum(formats.get(f, 0) for f in LOSSLESS)
    arrays = sum(n for f, n in formats.items() if f not in LOSSY + LOSSLESS)
    if lossy + lossless == 0 or arrays >= lossy + lossless:
        return "npy"
    return "png" if lossless > lossy else "jpg"


class PrepareConfig(BaseModel):
    """Ingest + shard: the input of ``sluice shard`` and of the ``prepare`` flow."""
    model_config = ConfigDict(extra="forbid")
    ingest: IngestConfig = Field(default_factory=IngestConfig)
    shard: ShardConfig = Field(default_factory=ShardConfig)
