"""Training one replica: the trainer and one module per strategy, chosen by ``make_trainer``.

- ``trainer``: ``Trainer`` (strategy=ddp), the loop, the compiled step, exact
  evaluation, stop votes, and the hooks a strategy overrides;
- ``fsdp2``: ``Fsdp2Trainer`` (strategy=fsdp, on the native runtime), PyTorch's FSDP2;
- ``spmd``: ``SpmdTrainer`` / ``SpmdFsdpTrainer`` (strategy=spmd / spmd_fsdp), one
  GSPMD program over the named device mesh (mesh.*), the model replicated or split
  (FSDPv2, and tensor-parallel by ``sharding_rules``);
- ``state``: ``TrainState``, what a checkpoint holds, and the resume arithmetic;
- ``report``: ``EpochRecord``, one typed record per epoch, and where it is written
  (log, TensorBoard, metrics.jsonl);
- ``debug``: the debug.* checks (recompilations, replicas in sync, sample logs);
- ``source``: ``EpochSource``, what the trainer needs from a split's batches;
- ``optimizer``: the optimizer (LARS and LAMB, parameter groups, primed state, the step's lr);
  ``schedule`` draws the learning rate.
"""

from __future__ import annotations

from typing import Any

from tpustream.config import Strategy, TrainConfig
from tpustream.training.fsdp2 import Fsdp2Trainer
from tpustream.training.spmd import SpmdFsdpTrainer, SpmdTrainer
from tpustream.training.trainer import Trainer

__all__ = ["Fsdp2Trainer", "SpmdFsdpTrainer", "SpmdTrainer", "Trainer", "make_trainer"]

TRAINERS: dict[Strategy, type[Trainer]] = {
    Strategy.ddp: Trainer,
    Strategy.fsdp: Fsdp2Trainer,  # the native runtime's only (launch refuses it on XLA)
    Strategy.spmd: SpmdTrainer,
    Strategy.spmd_fsdp: SpmdFsdpTrainer,
}


def make_trainer(
    cfg: TrainConfig, config_dict: dict[str, Any], runtime: Any, *args: Any, **kwargs: Any
) -> Trainer:
    """The trainer of cfg.strategy (of the mesh, under spmd), built with Trainer's arguments."""
    trainer = TRAINERS[cfg.strategy]
    if trainer is SpmdTrainer and runtime.mesh_shape.shards_parameters:
        trainer = SpmdFsdpTrainer  # strategy=spmd with mesh.fsdp or mesh.tensor above 1
    return trainer(cfg, config_dict, runtime, *args, **kwargs)
