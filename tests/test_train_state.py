"""TrainState: the checkpoint's content, read and written the same way, and the resume arithmetic."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch

from tests.fake_runtime import FakeRuntime, FakeWorld
from tpustream.checkpoint import config_fingerprint, content_digest, decode_checkpoint, encode_checkpoint
from tpustream.training.state import TrainState, capture_rng, restore_rng

PLAN = {"world_size": 2, "batch_size": 4, "num_workers": 2, "steps_per_epoch": 12, "seed": 0}
CONFIG = {"seed": 0, "batch_size": 4}
# The keys of a checkpoint without the optional ones (ema, replicas...), in the order the trainer
# writes them: the format checkpoints on disk have, so it must not change.
CHECKPOINT_KEYS = [
    "position",
    "epoch",
    "global_step",
    "partial",
    "pending_train_metrics",
    "best_accuracy",
    "best_epoch",
    "history",
    "model",
    "optimizer",
    "strategy",
    "rng",
    "data_plan",
    "config",
    "config_fingerprint",
]


def mid_epoch_checkpoint() -> dict:
    """A mid-epoch last.pt's content, written in full by hand: what TrainState reads must not drift."""
    return {
        "position": {"epoch": 1, "step": 5},
        "epoch": 0,
        "global_step": 17,
        "partial": {"loss_sum": 80.5, "count": 40, "filled": 0, "seconds": 1.5},
        "pending_train_metrics": None,
        "best_accuracy": 0.25,
        "best_epoch": 0,
        "history": [{"epoch": 0, "wall_time": 1.0, "train_loss": 2.0, "val_accuracy": 0.25}],
        "model": {"w": torch.ones(2)},
        "optimizer": {"state": {}, "param_groups": []},
        "strategy": "ddp",
        "rng": {"python": random.getstate(), "xla": 7},
        "data_plan": dict(PLAN),
        "config": CONFIG,
        "config_fingerprint": config_fingerprint(CONFIG),
    }


def test_a_checkpoint_reads_and_writes_back_the_same():
    old = mid_epoch_checkpoint()
    state = TrainState.from_checkpoint(decode_checkpoint(encode_checkpoint(old), "old.pt"))
    assert (state.epoch, state.step, state.global_step) == (1, 5, 17)
    assert state.partial == old["partial"] and state.history == old["history"]
    again = state.to_checkpoint(
        model=state.model,
        optimizer=state.optimizer,
        strategy=state.strategy,
        rng=state.rng,
        data_plan=state.data_plan,
        config=state.config,
    )
    assert list(again) == CHECKPOINT_KEYS
    # The same content, by the digest the checkpoint's integrity check uses.
    assert content_digest(again) == content_digest(old)


def test_the_last_completed_epoch_is_the_one_before_the_position():
    state = TrainState(epoch=3, step=0)
    content = state.to_checkpoint(
        model={}, optimizer={}, strategy="ddp", rng={}, data_plan=PLAN, config=CONFIG
    )
    assert content["epoch"] == 2 and content["position"] == {"epoch": 3, "step": 0}
    assert (
        TrainState().to_checkpoint(model={}, optimizer={}, strategy="ddp", rng={}, data_plan=PLAN, config={})[
            "epoch"
        ]
        == -1
    )


def test_progress_leaves_the_checkpoints_tensors_behind():
    progress = TrainState.from_checkpoint(mid_epoch_checkpoint()).progress()
    assert progress.model is None and progress.optimizer is None and progress.rng is None
    assert (progress.epoch, progress.step, progress.global_step, progress.best_epoch) == (1, 5, 17, 0)


def test_another_data_plan_restarts_an_epoch_stopped_inside(caplog):
    saved = TrainState.from_checkpoint(mid_epoch_checkpoint())
    other = {**PLAN, "num_workers": 0}
    with caplog.at_level(logging.WARNING, logger="tpustream"):
        restarted = saved.under_data_plan(other, steps_per_epoch=12, source="last.pt")
    assert (restarted.epoch, restarted.step, restarted.global_step, restarted.partial) == (1, 0, 12, None)
    assert (
        "last.pt stopped at step 5 of epoch 1; this run's order differs (2 worker(s) -> 0 worker(s)), so "
        "epoch 1 restarts from its first batch and the samples of its first 5 step(s) are trained again"
    ) in caplog.text
    assert (saved.step, saved.global_step) == (5, 17)  # the saved state itself is left as it was


def test_a_position_at_an_epochs_start_holds_under_any_data_plan(caplog):
    saved = TrainState(epoch=1, step=0, global_step=12, data_plan=PLAN)
    assert saved.under_data_plan({**PLAN, "world_size": 8}, steps_per_epoch=3, source="x") is saved
    assert not caplog.records


@pytest.mark.parametrize("world_size, steps", [(8, 3), (1, 24)], ids=["fewer-steps", "more-steps"])
def test_a_trained_epoch_stays_trained_under_another_count_of_steps(world_size, steps, caplog):
    """12 of 24 steps is not mid-epoch when the run stopped after all 12 of its own."""
    saved = TrainState(epoch=1, step=12, global_step=24, data_plan=PLAN)
    plan = {**PLAN, "world_size": world_size, "steps_per_epoch": steps}
    resumed = saved.under_data_plan(plan, steps_per_epoch=steps, source="x")
    assert (resumed.epoch, resumed.step, resumed.global_step) == (1, steps, 24)  # evaluated, not retrained
    assert not caplog.records


def test_the_same_data_plan_keeps_the_position():
    saved = TrainState.from_checkpoint(mid_epoch_checkpoint())
    assert saved.under_data_plan(dict(PLAN), steps_per_epoch=12, source="x") is saved


def test_random_generators_come_back_to_the_captured_states():
    runtime = FakeRuntime(FakeWorld(1), 0)
    runtime.set_rng_state(1234)
    captured = capture_rng(runtime)
    want = (random.random(), np.random.rand(), torch.rand(1))
    runtime.set_rng_state(0)
    restore_rng(decode_checkpoint(encode_checkpoint({"rng": captured}), "rng")["rng"], runtime)
    assert (random.random(), np.random.rand(), torch.rand(1)) == want
    assert runtime.rng_state() == 1234


CANONICAL = {**PLAN, "streams": 8, "stream_buffer": 250, "global_batch": 8}


def test_a_canonical_position_holds_on_another_shape_with_the_same_global_batch(caplog):
    saved = TrainState(epoch=1, step=5, global_step=17, data_plan=CANONICAL)
    other_shape = {**CANONICAL, "world_size": 4, "batch_size": 2, "num_workers": 1}
    with caplog.at_level(logging.INFO, logger="tpustream"):
        assert saved.under_data_plan(other_shape, steps_per_epoch=12, source="last.pt") is saved
    assert (
        "last.pt stopped at step 5 of epoch 1 under 2 replica(s) x batch 4, 2 worker(s); continuing at "
        "that step under 4 replica(s) x batch 2, 1 worker(s)"
    ) in caplog.text


@pytest.mark.parametrize(
    "change",
    [
        {"global_batch": 16, "batch_size": 8},
        {"streams": 4},
        {"stream_buffer": 100},
        {"seed": 1},
        {"streams": 0},
    ],
)
def test_a_canonical_position_restarts_its_epoch_under_another_order(change):
    saved = TrainState(epoch=1, step=5, global_step=17, data_plan=CANONICAL)
    restarted = saved.under_data_plan({**CANONICAL, **change}, steps_per_epoch=12, source="x")
    assert (restarted.step, restarted.global_step) == (0, 12)


def test_resume_force_with_another_global_batch_says_in_words_what_changed(caplog):
    """The warning says what changed in words, not as the two data plans' dicts."""
    saved = TrainState(epoch=1, step=5, global_step=17, data_plan=CANONICAL)
    doubled = {**CANONICAL, "batch_size": 8, "global_batch": 16, "steps_per_epoch": 6}
    with caplog.at_level(logging.WARNING, logger="tpustream"):
        saved.under_data_plan(doubled, steps_per_epoch=6, source="last.pt")
    assert (
        "last.pt stopped at step 5 of epoch 1; this run's order differs (a global batch of 8 -> "
        "a global batch of 16, 12 steps an epoch -> 6 steps an epoch), so epoch 1 restarts from its "
        "first batch and the samples of its first 5 step(s) are trained again"
    ) in caplog.text
