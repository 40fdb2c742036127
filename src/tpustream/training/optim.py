"""The optimizer and its learning-rate schedule: parameter groups, primed state, warmup and decay."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from tpustream.config import OptimizerName, Schedule, TrainConfig


def xla_safe_scalar(value: float) -> float:
    """Nudge 0.0 and 1.0 off their exact values.

    torch_xla bakes these "special" scalars into the graph as constants while
    every other Python scalar is fed as data, so a learning rate that passes
    through exactly 0 or 1 compiles a new graph (measured: one extra compile
    each). One ulp is no numerical change.
    """
    if value == 0.0:
        return 1e-30
    if value == 1.0:
        return math.nextafter(1.0, 0.0)
    return value


@dataclass
class LRSchedule:
    """Linear warmup to the peak, then cosine decay, step decay or constant; per step."""

    peak: float
    warmup_steps: int
    total_steps: int
    kind: Schedule
    min_ratio: float = 0.0
    # Schedule.step: the peak times decay_factor ** (step // decay_every_steps).
    decay_every_steps: int = 1
    decay_factor: float = 1.0

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            factor = (step + 1) / self.warmup_steps
        elif self.kind == Schedule.step:
            # Counted from step 0, warmup included, as pytorch/xla's
            # WarmupAndExponentialDecayScheduler (test/schedulers.py) counts epochs.
            factor = max(self.min_ratio, self.decay_factor ** (step // self.decay_every_steps))
        elif self.kind == Schedule.constant or self.total_steps <= self.warmup_steps:
            factor = 1.0
        else:
            progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
            factor = self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return xla_safe_scalar(self.peak * factor)


def make_schedule(cfg: TrainConfig, steps_per_epoch: int, devices: int) -> LRSchedule:
    """cfg.optim's schedule in steps, peaking at peak_learning_rate."""
    return LRSchedule(
        peak=peak_learning_rate(cfg, devices),
        warmup_steps=max(1, round(cfg.optim.warmup_epochs * steps_per_epoch)),
        total_steps=cfg.epochs * steps_per_epoch,
        kind=cfg.optim.schedule,
        min_ratio=cfg.optim.min_lr_ratio,
        decay_every_steps=max(1, round(cfg.optim.decay_every_epochs * steps_per_epoch)),
        decay_factor=cfg.optim.decay_factor,
    )


def peak_learning_rate(cfg: TrainConfig, devices: int) -> float:
    """optim.lr, scaled linearly to the global batch when optim.reference_batch_size is set.

    The global batch is batch_size per device times the devices that train in
    data parallel: the replicas, or every device of an spmd mesh.
    """
    reference = cfg.optim.reference_batch_size
    if not reference:
        return cfg.optim.lr
    return cfg.optim.lr * cfg.batch_size * devices / reference


def original_ndim(param: torch.Tensor) -> int:
    """Dimensions of a parameter as the model defined it (FSDP shards are flat; they keep the size)."""
    return len(getattr(param, "_orig_size", param.shape))


def build_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    o = cfg.optim
    # No weight decay on BatchNorm and bias parameters (standard for ResNets).
    decay = [p for p in model.parameters() if original_ndim(p) > 1]
    no_decay = [p for p in model.parameters() if original_ndim(p) <= 1]
    groups = [
        {"params": decay, "weight_decay": o.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if o.name == OptimizerName.sgd:
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov and o.momentum > 0)
    return torch.optim.AdamW(groups, lr=o.lr)


def prime_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer state that torch creates lazily at the first step.

    Lazy creation makes the first step a different graph from every later
    one, i.e. one more compilation of the largest graph (minutes for a
    ResNet-50 on TPU). Zero state gives the same update as lazy state: SGD's
    buffer becomes 0 * momentum + grad = grad, Adam's moments start at 0.
    Zeros are made on the host: zeros made on the device would be constants
    in the first graph, not data, and change its hash all the same.
    """
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            if state:
                continue

            def zeros(p=param):
                return torch.zeros(p.shape, dtype=p.dtype).to(p.device)

            if isinstance(optimizer, torch.optim.SGD) and group["momentum"] > 0:
                state["momentum_buffer"] = zeros()
            elif isinstance(optimizer, torch.optim.AdamW):
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = zeros()
                state["exp_avg_sq"] = zeros()
