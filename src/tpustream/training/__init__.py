"""Training one replica: the trainer and one module per strategy, chosen by ``make_trainer``.

- ``trainer``: ``Trainer`` (strategy=ddp), the loop, the compiled step, exact
  evaluation, stop votes, and the hooks a strategy overrides;
- ``fsdp2``: ``Fsdp2Trainer`` (strategy=fsdp, on the native runtime), PyTorch's FSDP2;
- ``spmd``: ``SpmdTrainer`` / ``SpmdFsdpTrainer`` (strategy=spmd / spmd_fsdp), one
  GSPMD program over the host's device mesh, the model replicated or sharded (FSDPv2);
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


def make_trainer(cfg: TrainConfig, *args: Any, **kwargs: Any) -> Trainer:
    """The trainer of cfg.strategy, built with Trainer's arguments."""
    return TRAINERS[cfg.strategy](cfg, *args, **kwargs)
