"""The training stage's config: what is trained, for how long, how fast, and what is kept.

JSON-serialisable, so the same shape comes from YAML, a Prefect parameter or Python. Names that
point into a registry (``model``, ``comm.mode``) are checked against it here, so an unknown one
fails at validation, before anything runs.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sluice.plugins import entry_params
from sluice.stages.precision import AmpMode
from sluice.stages.models import MODELS
from sluice.stages.train.comm import COMM_HOOKS
from sluice.storage.fingerprint import hash_obj


class CommConfig(BaseModel):
    """Gradient communication: a registered hook (``sluice.stages.train.comm``) and its own
    params, checked against the ``Params`` model the hook declares beside its code."""
    model_config = ConfigDict(extra="forbid")
    mode: str = Field("none", description="a registered compression hook: none, fp16, bf16, powersgd, ...")
    bucket_cap_mb: float = Field(25.0, gt=0, description="DDP's gradient bucket size")
    params: dict[str, Any] = Field(default_factory=dict, description="the hook's own knobs (e.g. powersgd: "
                                   "rank, start_iter, error_feedback, warm_start, dtype); unknown ones are refused")

    @field_validator("mode")
    @classmethod
    def _registered(cls, v: str) -> str:
        return COMM_HOOKS.validate(v)

    @model_validator(mode="after")
    def _params_of_the_hook(self) -> "CommConfig":
        """Every knob the hook takes, defaults filled in, so the resolved config shows them."""
        self.params = entry_params(COMM_HOOKS.get(self.mode), self.mode, self.params, "compression hook")
        return self


# Fields that do not change what is trained: excluded from the checkpoint compatibility hash.
# Fields added after checkpoints were written, at their defaults: left out of the compatibility hash.
LATER_DEFAULTS = {"input_size": None}
OPERATIONAL = {"checkpoint_dir", "checkpoint_every_steps", "checkpoint_every_seconds", "resume",
               "halt_at_step", "eval_every_steps", "log_every_steps", "metrics_path", "progress",
               "torch_threads", "compile", "dist_timeout_s", "max_skipped_steps", "resize",
               "resize_lr", "log_samples"}


class TrainConfig(BaseModel):
    """Everything a training run needs.

    Budget: ``max_steps`` optimizer steps if set, else ``max_seconds`` of wall-clock time if set,
    else ``epochs`` passes over the loader; with both ``max_steps`` and ``max_seconds`` the run
    ends at whichever comes first. The LR schedule follows the fraction of the budget used.
    """
    model_config = ConfigDict(extra="forbid")
    # model
    model: str = Field("small_cnn", description="a registered model (sluice.stages.models); auto: the "
                       "pipeline's kind of data picks one for the data (images: bn_cnn up to 32 px, resnet_small "
                       "above; stages/kinds/image_recipe.py)")
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    in_channels: int = Field(1, ge=1)
    num_classes: int = Field(10, ge=2)
    normalize_mean: list[float] | Literal["auto"] = Field(
        default_factory=lambda: [0.5], description="per channel, 0..1; auto: the pipeline takes the train "
        "split's own (recorded when it was sharded)")
    normalize_std: list[float] | Literal["auto"] = Field(default_factory=lambda: [0.5])
    input_size: int | Literal["auto"] | None = Field(
        None, description="images are resized to input_size x input_size to train (a random resized crop) and "
        "to be evaluated (the whole image resized: center_crop, squash), also when a checkpoint is graded later; "
        "None: as stored; auto: the pipeline's image kind derives it from the data's sizes and the host "
        "(stages/kinds/image_recipe.py)")
    # budget
    epochs: float = Field(1.0, gt=0)
    max_steps: int | None = Field(None, ge=1)
    max_seconds: float | None = Field(None, gt=0)
    # optimisation
    batch_size: int = Field(128, ge=1)  # per rank and micro-batch (used by loader specs)
    accum_steps: int = Field(1, ge=1)
    optimizer: Literal["sgd", "adamw"] = "sgd"
    lr: float = Field(0.1, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    momentum_cycle: tuple[float, float] | None = Field(
        None, description="one-cycle only: momentum falls from the second value to the first "
        "while the lr warms up, and rises back as it anneals (e.g. [0.85, 0.95])")
    lr_reference_batch: int | None = Field(
        None, ge=1, description="scale lr linearly with the global batch (batch_size x ranks x "
        "accum_steps) over this reference batch; None = lr as given")
    weight_decay: float = Field(5e-4, ge=0)
    betas: tuple[float, float] = Field(
        (0.9, 0.999), description="adam/adamw: the decay rates of the gradient's running mean and "
        "of its square (torch's defaults; nanoGPT's language-model recipe: [0.9, 0.95]); unused by sgd")
    schedule: Literal["constant", "linear", "onecycle"] = "onecycle"
    warmup_fraction: float = Field(0.1, ge=0, lt=1)  # linear warm-up; one-cycle peak position
    warmup_min_steps: int | None = Field(
        None, ge=1, description="a step budget whose warm-up (warmup_fraction of it) is shorter "
        "than this gets its peak lr lowered in proportion, so the lr never rises faster per step "
        "(the pipeline's recipe: 100; a few dozen steps warming up to its full peak diverge); "
        "None = the lr as given")
    clip_grad_norm: float | None = Field(None, gt=0)
    label_smoothing: float = Field(0.0, ge=0, lt=1)
    ema_decay: float | None = Field(None, gt=0, lt=1)  # evaluate an EMA of the weights
    eval_tta: Literal["none", "flip"] = Field("none", description="flip: evaluate the mean of the "
                                              "logits of each image and its mirror image")
    # speed
    amp: AmpMode = Field("none", description="autocast dtype; 'auto' = bf16/fp16 where the "
                         "device computes it natively, else fp32 (sluice.stages.precision)")
    channels_last: bool = False
    compile: bool = False
    comm: CommConfig = Field(default_factory=CommConfig)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    torch_threads: int | None = Field(None, ge=1)
    dist_timeout_s: float = Field(300.0, gt=0)
    # checkpoints, evaluation, logging
    seed: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every_steps: int | None = Field(None, ge=1)
    checkpoint_every_seconds: float | None = Field(None, gt=0)
    resume: bool = True  # continue from checkpoint_dir/last.pt when it exists
    init_from: str | None = Field(None, description="a checkpoint whose trained weights start the model "
                                  "(a warm start: weights only, a new schedule); the run's own checkpoint, "
                                  "when resuming, wins")
    halt_at_step: int | None = Field(None, ge=1)  # checkpoint and stop here (schedule unchanged)
    resize: Literal["keep_global_batch", "scale_global_batch", "refuse"] = Field(
        "keep_global_batch", description="resuming a checkpoint of another world size: keep the "
        "global batch (per-rank sizes × old/new world), scale it with the world (and the lr by "
        "resize_lr), or refuse (sluice.stages.train.elastic)")
    resize_lr: Literal["linear", "sqrt", "none"] = Field(
        "linear", description="scale_global_batch: the lr × (new/old global batch), its square "
        "root, or unchanged")
    log_samples: bool = Field(False, description="each rank appends the split indices of every "
                              "batch it takes to samples-rank<R>.jsonl beside metrics_path")
    eval_every_steps: int | None = Field(None, ge=1)
    log_every_steps: int = Field(1, ge=1, description="steps between reads of the step metrics on the host "
                                 "(each read waits for the device); only every Nth step's record is written, "
                                 "its clocks averaged over the N steps (the pipeline's recipe: auto = 1 on "
                                 "CPUs, 50 on CUDA)")
    metrics_path: str | None = None  # JSON lines, rank 0
    progress: bool = True
    max_skipped_steps: int = Field(20, ge=1)  # fp16: consecutive overflow skips before failing

    @field_validator("model")
    @classmethod
    def _registered(cls, v: str) -> str:
        return v if v == "auto" else MODELS.validate(v)

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        given = [v for v in (self.normalize_mean, self.normalize_std) if v != "auto"]
        if len(given) == 2 and len(self.normalize_mean) != len(self.normalize_std):
            raise ValueError("normalize_mean and normalize_std must have the same length")
        if self.normalize_std != "auto" and any(s <= 0 for s in self.normalize_std):
            raise ValueError("normalize_std must be positive")
        if isinstance(self.input_size, int) and self.input_size < 1:
            raise ValueError("input_size must be at least 1 px")
        if self.momentum_cycle is not None:
            lo, hi = self.momentum_cycle
            if not 0 <= lo <= hi < 1:
                raise ValueError("momentum_cycle must be [low, high] with 0 <= low <= high < 1")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must both be in [0, 1), got {list(self.betas)}")
        return self

    def compat(self, world_size: int) -> dict[str, Any]:
        """What a checkpoint must match to be resumed by this config."""
        # a field added later counts only when set away from its default: older checkpoints resume
        later = {k for k, v in LATER_DEFAULTS.items() if getattr(self, k) == v}
        trained = self.model_dump(exclude=OPERATIONAL | later)
        return {"model": self.model, "config_hash": hash_obj(trained), "world_size": world_size}
