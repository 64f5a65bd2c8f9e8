"""Selected batches → a trained model: ``config`` (``TrainConfig``), the loop (``loop.train``)
wiring its parts (``parts``, ``state``, ``step``, ``checkpointer``, ``metrics``), ``evaluate``,
gradient communication (``comm/``, one file per hook), the typed job (``job``) and launching it
under torchrun (``launch``, ``worker``).

    from sluice.stages.train import TrainConfig, train
    result = train(TrainConfig(max_steps=100), loader, eval_loader)     # one rank, in-process
"""
from sluice.stages.train.config import CommConfig, TrainConfig
from sluice.stages.train.loop import TrainResult, train
from sluice.stages.train.parts import param_digest

__all__ = ["TrainConfig", "CommConfig", "TrainResult", "train", "param_digest"]
