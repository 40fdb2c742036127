"""The optimizer and its learning-rate schedule: parameter groups, clipping, primed state, warmup, decay."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from tpustream.config import OptimizerName, Schedule, TrainConfig
from tpustream.training.optimizers import LAMB, LARS, LayerwiseOptimizer, ShardSum, clip_gradient_norm


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
    """Linear warmup to the peak, then cosine, polynomial or step decay, or constant; per step."""

    peak: float
    warmup_steps: int
    total_steps: int
    kind: Schedule
    min_ratio: float = 0.0
    # Schedule.step: the peak times decay_factor ** (step // decay_every_steps).
    decay_every_steps: int = 1
    decay_factor: float = 1.0
    # Schedule.poly: the peak times (1 - progress) ** poly_power.
    poly_power: float = 2.0

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
            if self.kind == Schedule.poly:
                # MLPerf ResNet-50's LARS schedule (mlcommons/training
                # image_classification/tensorflow2/lars_util.py, power 2), floored
                # at min_ratio instead of adding an end rate.
                factor = max(self.min_ratio, (1 - progress) ** self.poly_power)
            else:
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
        poly_power=cfg.optim.poly_power,
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


def sum_over_shards(model: nn.Module) -> ShardSum:
    """How per-replica sums of squares become whole-parameter ones, for norms.

    torch_xla's FSDP (strategy=fsdp) leaves each replica a flat slice of every
    parameter and gradient, zero-padded (the padding adds nothing): a norm is
    the root of the slices' sums added over its sharding group, with the
    wrapper's own all-reduce (its shards carry ``_is_sharded``). Whole
    parameters (ddp), and GSPMD's sharded tensors, which are global values
    (spmd, spmd_fsdp), need nothing: None.
    """
    sharded = any(getattr(p, "_is_sharded", False) for p in model.parameters())
    if not sharded or model.world_size == 1:
        return None
    all_reduce, groups = model.all_reduce_op, model.sharding_groups
    return lambda sums: all_reduce("sum", sums, groups=groups)


def build_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """cfg.optim's optimizer over two groups: weights, and norm weights and biases.

    Norm weights and biases (1-D; told apart by original_ndim, as FSDP's flat
    shards keep their original size) get no weight decay, and under lars and
    lamb no layer-wise adaptation either (the MLPerf ResNet-50 reference's
    skip list). With optim.clip_grad_norm, gradients are clipped at the start
    of every step() call: after the replicas' gradients are averaged
    (xm.optimizer_step, the gloo all-reduce and FSDP's reduce-scatter all come
    first) and before the update.
    """
    o = cfg.optim
    decay = [p for p in model.parameters() if original_ndim(p) > 1]
    no_decay = [p for p in model.parameters() if original_ndim(p) <= 1]
    groups = [
        {"params": decay, "weight_decay": o.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    shard_sum = sum_over_shards(model)
    if o.name == OptimizerName.sgd:
        optimizer = torch.optim.SGD(
            groups, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov and o.momentum > 0
        )
    elif o.name == OptimizerName.adamw:
        optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    else:
        groups[1]["exclude_from_adaptation"] = True
        if o.name == OptimizerName.lars:
            optimizer = LARS(
                groups,
                lr=o.lr,
                momentum=o.momentum,
                eta=o.lars_eta,
                eps=o.eps,
                nesterov=o.nesterov and o.momentum > 0,
                sum_over_shards=shard_sum,
            )
        else:
            optimizer = LAMB(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, sum_over_shards=shard_sum)
    if o.clip_grad_norm > 0:

        def clip_before_step(opt: torch.optim.Optimizer, args, kwargs) -> None:
            clip_gradient_norm(opt, o.clip_grad_norm, shard_sum)

        optimizer.register_step_pre_hook(clip_before_step)
    return optimizer


def prime_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer state that torch creates lazily at the first step.

    Lazy creation makes the first step a different graph from every later
    one, i.e. one more compilation of the largest graph (minutes for a
    ResNet-50 on TPU). Zero state gives the same update as lazy state: SGD's
    buffer becomes 0 * momentum + grad = grad, Adam's moments start at 0.
    Zeros are made on the host: zeros made on the device would be constants
    in the first graph, not data, and change its hash all the same. LARS and
    LAMB name their state themselves (``initial_state``).
    """

    def host_zeros(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype).to(device)

    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            if state:
                continue

            def zeros(p=param):
                return host_zeros(p.shape, p.dtype, p.device)

            if isinstance(optimizer, LayerwiseOptimizer):
                state.update(optimizer.initial_state(param, group, host_zeros))
            elif isinstance(optimizer, torch.optim.SGD) and group["momentum"] > 0:
                state["momentum_buffer"] = zeros()
            elif isinstance(optimizer, torch.optim.AdamW):
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = zeros()
                state["exp_avg_sq"] = zeros()
