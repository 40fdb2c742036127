"""The trainer: schedule, scalars and optimizer set-up in this process; micro-batches
and bf16 in real train.py runs on the XLA CPU device.

Every XLA run has its own process: an eager backward (these tests run some)
before an XLA one in one process trips an autograd assertion.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn

from tests.conftest import run_train
from tpustream.checkpoint import checkpoint_url, load_checkpoint, read_metrics
from tpustream.config import OptimConfig, OptimizerName, Schedule, TrainConfig
from tpustream.errors import PREEMPTED_EXIT_CODE
from tpustream.training.epoch_report import RateTracker
from tpustream.training.optimizer import (
    build_optimizer,
    prime_optimizer_state,
)
from tpustream.training.schedule import LRSchedule, peak_learning_rate, xla_safe_scalar


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


def test_step_schedule_divides_at_fixed_steps_counted_from_the_start():
    """pytorch/xla's WarmupAndExponentialDecayScheduler: warmup, then lr x factor^(step // every)."""
    schedule = LRSchedule(
        peak=0.5, warmup_steps=3, total_steps=40, kind=Schedule.step, decay_every_steps=10, decay_factor=0.2
    )
    values = [schedule(s) for s in range(40)]
    assert values[:3] == pytest.approx([0.5 / 3, 1 / 3, 0.5])  # linear warmup, as every schedule
    assert values[3:10] == [0.5] * 7  # the first decay comes 10 steps after step 0, not after warmup
    for start, lr in ((10, 0.1), (20, 0.02), (30, 0.004)):
        assert values[start : start + 10] == pytest.approx([lr] * 10)
    floored = LRSchedule(
        peak=1.0,
        warmup_steps=1,
        total_steps=40,
        kind=Schedule.step,
        min_ratio=0.05,
        decay_every_steps=10,
        decay_factor=0.1,
    )
    assert floored(15) == pytest.approx(0.1) and floored(25) == pytest.approx(0.05)
    assert all(v not in (0.0, 1.0) for v in (floored(0), floored(5), floored(10**6)))


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


def test_linear_scaling_rule_scales_the_peak_with_the_global_batch():
    cfg = config(OptimizerName.sgd)
    cfg.batch_size = 128
    assert peak_learning_rate(cfg, devices=8) == cfg.optim.lr  # no reference: lr is the peak
    cfg.optim.reference_batch_size = 256
    assert peak_learning_rate(cfg, devices=8) == pytest.approx(cfg.optim.lr * 1024 / 256)
    assert peak_learning_rate(cfg, devices=1) == pytest.approx(cfg.optim.lr / 2)


def test_weight_decay_skips_norm_weights_and_biases():
    decay, no_decay = build_optimizer(config(OptimizerName.sgd), small_model()).param_groups
    assert [p.ndim for p in decay["params"]] == [4, 2] and len(no_decay["params"]) == 4
    assert no_decay["weight_decay"] == 0 and decay["weight_decay"] > 0


# -- on the XLA CPU device: each run is `python train.py` in its own process ----------

# 768 of the 1,438 digits training images: 12 steps of 64 per epoch.
TRAIN_SUBSET = "train/train-{000000..000002}.tar"
SUBSET_STEPS = 12


def quick_run(root: str, out, *overrides: str) -> tuple[str, str]:
    """train.py on the subset, in one process, no DataLoader workers; returns (run folder, stderr)."""
    run = str(out / "run")
    result = run_train(
        f"data.root={root}",
        f"data.train_shards='{root}/{TRAIN_SUBSET}'",  # Hydra needs the braces quoted
        f"output_dir={run}",
        f"hydra.run.dir={out / 'hydra'}",
        "accelerator.in_process=true",
        "data.num_workers=0",
        *overrides,
    )
    assert result.returncode in (0, PREEMPTED_EXIT_CODE), result.stderr[-3000:]
    return run, result.stderr


def last_state(run: str) -> dict:
    return load_checkpoint(checkpoint_url(run, "last.pt"))


@pytest.fixture(scope="module")
def float32_run(digits_root, tmp_path_factory) -> tuple[str, str]:
    """The reference of the micro-batch and bf16 runs: float32, one batch per step.

    GroupNorm: with BatchNorm, micro-batches are normalised separately by design.
    """
    return quick_run(digits_root, tmp_path_factory.mktemp("fp32"), *MICRO_AND_BF16)


MICRO_AND_BF16 = ("epochs=2", "model.options.norm=group", "optim.reference_batch_size=32")


@pytest.mark.slow
def test_micro_batches_give_the_update_of_one_whole_batch(digits_root, tmp_path, float32_run):
    micro, _ = quick_run(digits_root, tmp_path / "k4", *MICRO_AND_BF16, "micro_batches=4")
    whole, micro_state = last_state(float32_run[0]), last_state(micro)
    assert whole["global_step"] == micro_state["global_step"] == 2 * SUBSET_STEPS
    for name, tensor in whole["model"].items():
        # Float sums in another order, over 24 SGD steps at twice the base rate (how far
        # depends on the machine's XLA CPU code: 1.7e-4 measured here; a wrong update,
        # e.g. micro-batch gradients summed instead of averaged, moves weights by ~1e-1).
        torch.testing.assert_close(
            micro_state["model"][name],
            tensor,
            rtol=1e-4,
            atol=1e-3,
            msg=lambda text, name=name: f"{name}: {text}",
        )
    whole_metrics, micro_metrics = read_metrics(float32_run[0]), read_metrics(micro)
    assert micro_metrics[0]["train_loss"] == pytest.approx(whole_metrics[0]["train_loss"], rel=1e-5)
    # The 4 micro-batches are unrolled into the one train-step graph: no extra compilation.
    assert [m["compilations"] for m in micro_metrics] == [m["compilations"] for m in whole_metrics]


@pytest.mark.slow
def test_bf16_computes_in_bfloat16_and_keeps_float32_weights(digits_root, tmp_path, float32_run):
    bf16, stderr = quick_run(digits_root, tmp_path / "bf16", *MICRO_AND_BF16, "precision=bf16")
    assert "peak learning rate 0.2 = 0.1 x global batch 64 / reference batch 32 (linear scaling)" in stderr
    state = last_state(bf16)
    assert {t.dtype for t in state["model"].values() if t.is_floating_point()} == {torch.float32}
    low, full = read_metrics(bf16), read_metrics(float32_run[0])
    # bfloat16 rounding changes the numbers a little, not the training.
    assert low[0]["train_loss"] != full[0]["train_loss"]
    assert low[0]["train_loss"] == pytest.approx(full[0]["train_loss"], rel=0.05)
    assert low[1]["train_loss"] < low[0]["train_loss"]
    assert low[1]["compilations"] == low[0]["compilations"]  # all in epoch 1, none after


def test_a_checkpoint_of_torch_xlas_first_fsdp_resumes_with_its_optimizer_fresh():
    """Its optimizer "shards" (per replica) fit no strategy now; FSDP2's plain layout fits every one."""
    from tpustream.config import Strategy
    from tpustream.training.state import plain_optimizer_state_fits

    xla_fsdp = {"strategy": "fsdp", "optimizer": {"world_size": 2, "layout": ["a"], "shards": [{}, {}]}}
    fsdp2 = {"strategy": "fsdp", "optimizer": {"state": {}, "param_groups": []}}
    for strategy in (Strategy.ddp, Strategy.spmd_fsdp, Strategy.fsdp):
        assert not plain_optimizer_state_fits(xla_fsdp, strategy, "last.pt")
        assert plain_optimizer_state_fits(fsdp2, strategy, "last.pt")
