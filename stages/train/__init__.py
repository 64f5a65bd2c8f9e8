"""Selected batches → a trained model. ``rank`` is what one rank runs, top to bottom
(``run_rank`` from a typed job, ``train`` from loaders you built); it wires ``config``
(``TrainConfig``), ``components`` (model, optimizer, scaler, EMA, comm hook, input preparation),
``state``, ``step``, ``checkpointer``, ``metrics``, ``evaluate`` and gradient communication
(``comm/``, one file per hook). Launching ranks, warm starts and promotion are the run's, not a
rank's: ``sluice.stages.run``.

    from sluice.stages.train import TrainConfig, train
    result = train(TrainConfig(max_steps=100), loader, eval_loader)     # one rank, in-process
"""
from sluice.stages.train.components import param_digest
from sluice.stages.train.config import CommConfig, TrainConfig
from sluice.stages.train.rank import TrainResult, train

__all__ = ["TrainConfig", "CommConfig", "TrainResult", "train", "param_digest"]
