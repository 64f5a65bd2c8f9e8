"""The loader's config: everything that shapes what it yields; the same shape in YAML, Prefect
and Python. ``backend`` names a registered loader backend (or ``auto``), checked here."""
from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from sluice.plugins import entry_params
from sluice.stages.load.augment import AugmentSpec
from sluice.stages.load.backends import LOADER_BACKENDS
from sluice.stages.load.backends.base import with_index
from sluice.stages.load.samplers import ResolutionSchedule, SamplerConfig


class CacheConfig(BaseModel):
    """The local cache for an artifact on object storage (``s3://...``): verified copies of its
    files, at most ``max_bytes``, shards fetched ``prefetch_shards`` ahead of need."""
    model_config = ConfigDict(extra="forbid")
    dir: str | None = Field(None, description="default: $SLUICE_CACHE_DIR or ~/.cache/sluice/artifacts")
    max_bytes: int | None = Field(None, ge=1, description="evict least recently used files past this; default: no limit")
    prefetch_shards: int = Field(2, ge=0, description="shards fetched ahead of the one being read")
    retries: int = Field(3, ge=0, description="re-downloads of a corrupt or truncated file before failing")


class LoaderConfig(BaseModel):
    """Everything that shapes what the loader yields."""
    model_config = ConfigDict(extra="forbid")
    split: str = "train"
    backend: str = Field("auto", description="auto, or a registered backend: memory, ffcv, dali, webdataset, ...")
    batch_size: int = Field(256, ge=1)
    drop_last: bool = False
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    augment: AugmentSpec | None = None
    resolution: ResolutionSchedule | None = None
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$",
                        description="where batches are made and augmented: auto = the rank's training device "
                        "when the trainer builds the loader (so decode-side work runs on the GPU a rank trains "
                        "on), else cpu; cpu; cuda (the current device); cuda:N")
    decode: Literal["auto", "cpu", "device"] = Field(
        "auto", description="where JPEG bytes become pixels: cpu = in the backend's CPU workers; device = "
        "the workers only read and check the bytes and the batch is decoded in one call (nvJPEG through "
        "torchvision, else DALI's mixed decoder, on a CUDA loader; OpenCV on a CPU loader), then cropped, "
        "flipped and normalised where the batch is made; no device decoder on a CUDA loader says so once "
        "and decodes on the CPU; auto = device when the loader's device is CUDA, the images are JPEG and a "
        "device decoder is importable, else cpu")
    workers: int | None = Field(None, ge=0, description="decode workers; default: the machine's cores")
    prefetch: int = Field(3, ge=0, description="batches prepared ahead in a background thread")
    verify: Literal["none", "size", "full"] = Field("size", description="check files against the manifest first")
    check_samples: bool = Field(True, description="check every sample's bytes against its checksum as it is read")
    on_corrupt: Literal["fail", "skip"] = Field("fail", description="a damaged sample: fail naming it, or drop it")
    max_corrupt_fraction: float = Field(0.01, ge=0, le=1, description="skip: fail once more of the split is damaged")
    backend_params: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="each backend's own knobs, by backend name (e.g. webdataset: "
        "{streaming: true, shuffle_buffer: 1000}); checked against the Params model the backend declares "
        "beside its code, and used when that backend is the one chosen (also through auto)")
    memory_budget_bytes: int | None = Field(None, description="default: half the tighter of the cgroup's and "
                                            "the host's free memory (stages/load/budget.py)")
    device_memory_budget_bytes: int | None = Field(
        None, ge=0, description="the memory backend on CUDA keeps the decoded split on the GPU when it fits "
        "this; default: half the device's free memory (stages/load/budget.py)")
    cache: CacheConfig = Field(default_factory=CacheConfig)
    seed: int = 0

    @field_validator("backend")
    @classmethod
    def _registered(cls, v: str) -> str:
        return v if v == "auto" else LOADER_BACKENDS.validate(v)

    @field_validator("backend_params")
    @classmethod
    def _params_of_each_backend(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Every named backend's knobs, defaults filled in, so the resolved config shows them."""
        return {name: entry_params(LOADER_BACKENDS.get(LOADER_BACKENDS.validate(name)), name, params or {},
                                   "loader backend") for name, params in v.items()}

    def params_for(self, backend: str) -> dict[str, Any]:
        """``backend``'s knobs: the ones given for it, over its Params model's defaults."""
        return self.backend_params.get(backend) or entry_params(LOADER_BACKENDS.get(backend), backend, {},
                                                                "loader backend")


def loader_device(setting: str, training: torch.device | None = None) -> torch.device:
    """The device a loader with ``device: setting`` makes batches on, with its index (resolved
    in the caller's thread): ``auto`` follows the training device it is built for (the CPU when
    built on its own); a bare ``cuda`` is the training rank's own GPU when that is CUDA, else the
    current one. An explicit index wins."""
    if setting == "auto":
        return with_index(training) if training is not None else torch.device("cpu")
    if setting == "cuda" and training is not None and training.type == "cuda":
        return training
    return with_index(setting)
