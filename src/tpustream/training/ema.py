"""ema.decay: an exponential moving average of the weights, kept and evaluated on the device.

timm's ModelEmaV3 semantics (timm/utils/model_ema.py): after every optimizer
step each parameter and floating buffer moves as ``ema.lerp_(w, 1 - d)``; the
first update copies the weights (d = 0), and with warmup the decay after n
updates is ``1 - (1 + n / gamma) ** -power``, capped at ``decay``.

Written for XLA: the update is part of the train step's graph (no host round
trip), and the update count is a device tensor, so the decay is computed in
the graph too: nothing about it is a constant that changes between steps.
The average is a second copy of the model wrapped by the same strategy
(``Trainer.wrap_model``): sharded as the parameters are under fsdp and
spmd_fsdp, and evaluated by the same compiled evaluation graph, as its
tensors differ from the model's in value only. Its state in a checkpoint is
the whole average under the model's keys (``Trainer.whole_state``).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
import torch.nn as nn

from tpustream.config import EmaConfig
from tpustream.runtime import Runtime
from tpustream.training.state import device_values

log = logging.getLogger(__name__)


def averaged_tensors(module: nn.Module) -> list[torch.Tensor]:
    """What the average follows: parameters and floating buffers, in module order.

    Integer buffers (BatchNorm's num_batches_tracked) are counts, not
    weights; evaluation does not read them.
    """
    return [*module.parameters(), *(b for b in module.buffers() if b.is_floating_point())]


class WeightAverage:
    """The average of one replica's model: a module of the same structure, updated in the step."""

    def __init__(self, cfg: EmaConfig, module: nn.Module, runtime: Runtime, updates: int):
        """module: the model's copy, holding the average so far and wrapped as the model is.

        updates: optimizer steps taken so far (the run's global step), from
        which the warmup continues after a resume.
        """
        self.cfg = cfg
        self.module = module
        self.module.eval()  # never trained: BatchNorm keeps the averaged statistics
        (self.updates,) = device_values(runtime, (float(updates), torch.float32))

    def weight(self) -> torch.Tensor:
        """1 - decay for the update being made (self.updates already counts it), on the device.

        Computed as 1 - decay directly: the power term of the warmup is 1 -
        decay, and 1 - float32(0.9999) is 1.7e-4 away from 1e-4 relatively.
        """
        n = (self.updates - 1).clamp(min=0)
        if self.cfg.warmup:
            weight = (1 + n / self.cfg.warmup_gamma).pow(-self.cfg.warmup_power).clamp(min=1 - self.cfg.decay)
        else:
            weight = torch.full_like(n, 1 - self.cfg.decay)
        # The first update copies the weights (timm: decay 0 at step <= 0).
        return torch.where(n > 0, weight, torch.ones_like(n)).squeeze(0)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """One step of the average towards model (the same structure and wrapping), traced into the step."""
        self.updates += 1
        weight = self.weight()
        for average, current in zip(averaged_tensors(self.module), averaged_tensors(model), strict=True):
            average.lerp_(current.detach(), weight.to(average.dtype))


def average_on_host(
    cfg: EmaConfig, model: nn.Module, resume_from: tuple[dict[str, Any], str] | None, is_master: bool
) -> nn.Module | None:
    """ema.decay: the model's copy that starts the average (the checkpoint's average if it has one).

    Made on the host before the model moves to the device, so a saved average
    loads as the weights do (not copied into device tensors in place).
    """
    if cfg.decay == 0:
        return None
    average = copy.deepcopy(model)
    saved = resume_from[0].get("ema") if resume_from is not None else None
    if saved is not None:
        average.load_state_dict(saved)
    elif resume_from is not None and is_master:
        log.info("%s holds no weight average: ema starts from its weights", resume_from[1])
    return average


def ema_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """The average's evaluation under ema_ names (its time and bad data are the split's, reported once)."""
    return {f"ema_{name}": metrics[name] for name in ("val_accuracy", "val_correct", "val_top5", "val_loss")}
