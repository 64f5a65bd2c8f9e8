"""Where a run computes and whom it talks to: rank, world size and device, and the process
group a torchrun worker joins."""
from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist

from sluice.errors import ConfigError
from sluice.stages.host import rank_device
from sluice.stages.train.config import TrainConfig


@dataclasses.dataclass
class DistContext:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def on(self) -> bool:
        return self.world > 1

    def tensor(self, values: list[float]) -> torch.Tensor:
        """A float64 tensor on the device the process group communicates from."""
        return torch.tensor(values, dtype=torch.float64, device=self.device)


def wants_cuda(device: str) -> bool:
    """Whether a ``train.device`` setting (auto, cpu, cuda) trains on CUDA here."""
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def place_rank(cfg: TrainConfig, local_rank: int | None = None) -> torch.device:
    """This rank's device, set as the current CUDA device before anything allocates (the
    loaders, the process group and the model all follow it): CUDA rank ``LOCAL_RANK`` on its own
    GPU, else the CPU. Checked against ``cfg`` (CUDA asked but absent; fp16 without CUDA)."""
    cuda = wants_cuda(cfg.device)
    if cuda and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but CUDA is not available")
    if cfg.amp == "fp16" and not cuda:
        raise ConfigError("amp='fp16' needs CUDA (GradScaler); use amp='bf16' on CPU")
    local = int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else local_rank
    device = rank_device(cuda, local)
    if cuda:
        if local >= torch.cuda.device_count():
            raise ConfigError(f"local rank {local} has no GPU: {torch.cuda.device_count()} visible "
                              "(one rank per GPU: nproc: auto)")
        torch.cuda.set_device(device)
    return device


def dist_context(cfg: TrainConfig) -> DistContext:
    """This process's rank, world and device (its own GPU per ``LOCAL_RANK``), checked against ``cfg``."""
    device = place_rank(cfg)
    if dist.is_available() and dist.is_initialized():
        return DistContext(dist.get_rank(), dist.get_world_size(), device)
    return DistContext(0, 1, device)


def init_process_group(cfg: TrainConfig) -> None:
    """Join torchrun's group (gloo on CPU, nccl on CUDA); nothing to do for one process."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return
    backend = "nccl" if wants_cuda(cfg.device) else "gloo"
    timeout = datetime.timedelta(seconds=cfg.dist_timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # After torchrun restarts a group (a rank was killed), peers could read the dead
        # attempt's addresses from the agent's store and fail to connect ("Connection refused"),
        # burning every restart in seconds. Keys prefixed by the attempt keep attempts apart.
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                             is_master=False, timeout=timeout)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"sluice/attempt-{attempt}", base)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)
