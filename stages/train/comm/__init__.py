"""DDP gradient communication, one file per mode: ``none`` (DDP's all-reduce), ``fp16`` and
``bf16`` (16-bit all-reduce), ``powersgd`` (low-rank with error feedback); see ``base``.

Add one: a new file registering a ``CommHook`` subclass with ``@COMM_HOOKS.register(name)``,
plus one import line below.
"""
from sluice.stages.train.comm.base import COMM_HOOKS, CommHook, uncompressed_bytes
from sluice.stages.train.comm import cast, plain, powersgd  # noqa: F401  (each registers itself)


def build_hook(config, seed: int = 0, group=None) -> CommHook:
    """The hook ``config.mode`` names, for one DDP model."""
    return COMM_HOOKS.get(config.mode)(config, seed=seed, group=group)


__all__ = ["COMM_HOOKS", "CommHook", "build_hook", "uncompressed_bytes"]
