"""training.schedule: the lr over a phase of the run; a run continued with other `epochs`."""

from __future__ import annotations

import logging
import math

import pytest

from tests.fake_runtime import tiny_config
from tpustream.checkpoint import LAST, checkpoint_url, load_checkpoint
from tpustream.config import EpochsChange, Schedule
from tpustream.training import trainer as step_module
from tpustream.training.schedule import (
    SchedulePhase,
    continued_phase,
    describe_epochs_change,
    make_schedule,
    resumed_phase,
    xla_safe_scalar,
)

STEPS = 24  # tiny_split's 96 samples in batches of 4, one replica


def config(run: str, epochs: int, choice: EpochsChange = EpochsChange.refuse, **changes):
    return tiny_config(
        run, epochs=epochs, **{"optim.warmup_epochs": 0.25, "optim.on_epochs_change": choice, **changes}
    )


@pytest.fixture
def learning_rates(monkeypatch):
    """Every lr the trainer sets, in order (the training steps' own values)."""
    seen: list[float] = []
    set_learning_rate = step_module.set_learning_rate

    def recording(optimizer, lr):
        seen.append(lr)
        set_learning_rate(optimizer, lr)

    monkeypatch.setattr(step_module, "set_learning_rate", recording)
    return seen


@pytest.mark.parametrize("choice", [EpochsChange.keep, EpochsChange.restart, EpochsChange.stretch])
def test_a_finished_run_continued_with_more_epochs_follows_the_chosen_phase(
    fake_job, tmp_path, learning_rates, caplog, choice
):
    run = str(tmp_path / "run")
    fake_job(config(run, 1))
    assert load_checkpoint(checkpoint_url(run, LAST))["schedule_phase"] == {
        "start": 0.0,
        "end": 1.0,
        "epochs": 1,
    }
    learning_rates.clear()
    longer = config(run, 2, choice)
    with caplog.at_level(logging.WARNING, logger="tpustream"):
        fake_job(longer, resume_from=(load_checkpoint(checkpoint_url(run, LAST)), "last.pt"))
    phase = {
        EpochsChange.keep: SchedulePhase(0.0, 1.0, 2),
        EpochsChange.restart: SchedulePhase(1.0, 2.0, 2),
        EpochsChange.stretch: SchedulePhase(0.0, 2.0, 2),
    }[choice]
    expected = make_schedule(longer, STEPS, 1, phase)
    assert learning_rates == [expected(step) for step in range(STEPS, 2 * STEPS)]
    if choice == EpochsChange.keep:
        assert set(learning_rates) == {xla_safe_scalar(0.0)}  # the old cosine's floor
    elif choice == EpochsChange.restart:
        assert learning_rates[:6] == pytest.approx([0.05 * (i + 1) / 6 for i in range(6)])  # warmup again
    else:
        # Step 24 of a 48-step cosine after 6 warmup steps: progress 18/42.
        assert learning_rates[0] == pytest.approx(0.05 * 0.5 * (1 + math.cos(math.pi * 18 / 42)))
    assert load_checkpoint(checkpoint_url(run, LAST))["schedule_phase"] == phase.to_dict()
    assert f"epochs 1 -> 2 at epoch 1, optim.on_epochs_change={choice.value}" in caplog.text


def test_a_restarted_phase_stopped_mid_epoch_resumes_exactly(fake_job, tmp_path, learning_rates):
    """The checkpoint keeps the phase: the next process continues it, not a schedule over all epochs."""
    straight, run = str(tmp_path / "straight"), str(tmp_path / "run")
    for folder in (straight, run):
        fake_job(config(folder, 1))
    learning_rates.clear()
    fake_job(
        config(straight, 2, EpochsChange.restart),
        resume_from=(load_checkpoint(checkpoint_url(straight, LAST)), "last.pt"),
    )
    want = list(learning_rates)
    restarted = make_schedule(config(run, 2), STEPS, 1, SchedulePhase(1.0, 2.0, 2))
    assert want == [restarted(step) for step in range(STEPS, 2 * STEPS)]
    learning_rates.clear()
    fake_job(
        config(run, 2, EpochsChange.restart),
        resume_from=(load_checkpoint(checkpoint_url(run, LAST)), "last.pt"),
        stop_at=(0, "train", 1, 10),
    )
    state = load_checkpoint(checkpoint_url(run, LAST))
    assert state["position"] == {"epoch": 1, "step": 11}
    # The same command again (its choice does not matter: the saved phase already has epochs=2).
    fake_job(config(run, 2), resume_from=(state, "last.pt"))
    assert learning_rates == want and len(want) == STEPS  # 11 steps in one process, 13 in the next


def test_unchanged_epochs_or_a_schedule_without_a_horizon_keep_the_phase_and_say_so():
    cfg = config("unused", 4, EpochsChange.restart)
    saved = SchedulePhase.whole_run(4)
    state = {"config": {"epochs": 4}, "schedule_phase": saved.to_dict()}
    assert resumed_phase(state, cfg, 2.5) == (saved, None)
    # Without a phase or a config (a checkpoint from before both): nothing to compare, nothing changes.
    assert SchedulePhase.from_checkpoint({}, 4) == saved and continued_phase(saved, 2.5, cfg) == saved
    constant = config("unused", 6, EpochsChange.restart, **{"optim.schedule": Schedule.constant})
    phase, line = resumed_phase(state, constant, 4.0)
    assert phase == SchedulePhase(0.0, 4.0, 6)  # the next resume compares with 6
    assert line == "epochs 4 -> 6: the constant schedule has no horizon to change"
    # Written before phases existed: the whole of its run's epochs.
    assert SchedulePhase.from_checkpoint({"config": {"epochs": 3}}, 9) == SchedulePhase.whole_run(3)


def test_the_refusal_says_what_each_choice_would_do_to_the_lr():
    cfg = config("unused", 4)
    text = describe_epochs_change(SchedulePhase.whole_run(2), 2.0, cfg)
    assert text.startswith(
        "epochs=4 continues a run whose cosine schedule was drawn over epochs 0-2 (epochs=2)"
    )
    assert "keep (the old schedule goes on: lr 0 x the peak now, its floor from then on)" in text
    assert "restart (a new phase over epochs 2-4: warmup to the peak again, then the cosine decay)" in text
    # Redrawn over 0-4 after a quarter-epoch warmup: progress 1.75 / 3.75 down the cosine.
    assert "stretch (the schedule redrawn over epochs 0-4: lr 0.552 x the peak now)" in text
