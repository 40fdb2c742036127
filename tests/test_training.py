"""Trainer pieces that need no XLA device: schedule, scalars, optimizer set-up.

The training loop itself runs on the XLA CPU device in test_e2e.py (in its own
process: an eager backward before an XLA one in one process trips an autograd
assertion).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn

from tpustream.config import OptimConfig, OptimizerName, Schedule, TrainConfig
from tpustream.training import (
    LRSchedule,
    RateTracker,
    build_optimizer,
    prime_optimizer_state,
    xla_safe_scalar,
)


def test_xla_safe_scalar_moves_only_special_values():
    assert xla_safe_scalar(0.0) != 0.0 and 0 < xla_safe_scalar(0.0) < 1e-20
    assert xla_safe_scalar(1.0) != 1.0 and abs(xla_safe_scalar(1.0) - 1.0) < 1e-15
    assert xla_safe_scalar(0.1) == 0.1


def test_schedule_warms_up_linearly_then_decays_to_the_floor_without_special_values():
    schedule = LRSchedule(peak=1.0, warmup_steps=4, total_steps=20, kind=Schedule.cosine, min_ratio=0.0)
    values = [schedule(s) for s in range(20)]
    assert values[:4] == [0.25, 0.5, 0.75, xla_safe_scalar(1.0)]
    assert all(a >= b for a, b in zip(values[3:], values[4:], strict=False))
    assert math.isclose(values[4 + 8], 0.5 * (1 + math.cos(math.pi * 8 / 16)))
    assert all(v not in (0.0, 1.0) for v in values + [schedule(10**6)])
    constant = LRSchedule(peak=0.1, warmup_steps=2, total_steps=10, kind=Schedule.constant)
    assert [constant(s) for s in range(5)] == [0.05, 0.1, 0.1, 0.1, 0.1]


def test_rate_tracker_counts_samples():
    tracker = RateTracker()
    tracker.start -= 2.0
    tracker.last -= 2.0
    tracker.add(100)
    assert 40 < tracker.rate() < 60 and 40 < tracker.global_rate() < 60


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))


def config(name: OptimizerName) -> TrainConfig:
    cfg = TrainConfig()
    cfg.optim = OptimConfig()
    cfg.optim.name = name
    cfg.optim.lr = 0.05 if name == OptimizerName.sgd else 1e-3
    return cfg


def test_no_weight_decay_on_norm_and_bias_parameters():
    optimizer = build_optimizer(config(OptimizerName.sgd), small_model())
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] > 0 and all(p.ndim > 1 for p in decay["params"])
    assert no_decay["weight_decay"] == 0 and all(p.ndim == 1 for p in no_decay["params"])


def train_three_steps(name: OptimizerName, primed: bool) -> list[torch.Tensor]:
    model = small_model()
    optimizer = build_optimizer(config(name), model)
    if primed:
        prime_optimizer_state(optimizer)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(5, 3, 6, 6, generator=generator)
        y = torch.randint(0, 3, (5,), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return [copy.deepcopy(p.detach()) for p in model.parameters()]


def test_primed_optimizer_state_gives_the_same_updates_as_lazy_state():
    for name in (OptimizerName.sgd, OptimizerName.adamw):
        for lazy, primed in zip(train_three_steps(name, False), train_three_steps(name, True), strict=True):
            torch.testing.assert_close(lazy, primed, rtol=0, atol=1e-6)
