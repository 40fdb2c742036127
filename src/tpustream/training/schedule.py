"""The learning-rate schedule: warmup and decay per step over a phase of the run; a changed `epochs`.

A cosine or polynomial decay is drawn over a horizon (``epochs``). When a run
is continued with another ``epochs``, that horizon is no longer the one its
steps so far followed, and recomputing it silently jumps the learning rate
(seen: a finished 2-epoch cosine at lr 0.00047 continued with epochs=4 went to
0.027 and lost half its accuracy). ``optim.on_epochs_change`` makes that a
decision: the schedule keeps its horizon, restarts as a new phase, or is
stretched; the default refuses before spawning and says what each would do.
The phase the schedule follows is stored in every checkpoint
(``schedule_phase``), so later resumes continue it exactly.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import asdict, dataclass
from typing import Any

from tpustream.config import EpochsChange, Schedule, TrainConfig

log = logging.getLogger(__name__)

# Schedules whose values depend on the horizon (epochs); constant and step do not.
HORIZON_SCHEDULES = (Schedule.cosine, Schedule.poly)
# Steps per epoch for the epoch-level estimates in messages (the real count is known only in the replicas).
NOMINAL_STEPS_PER_EPOCH = 1000


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
    """Linear warmup to the peak, then cosine, polynomial or step decay, or constant; per step.

    Steps count from `start_step`, the first step of the schedule's phase (0
    unless a continued run restarted it).
    """

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
    start_step: int = 0

    def __call__(self, step: int) -> float:
        step -= self.start_step
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


@dataclass(frozen=True)
class SchedulePhase:
    """The stretch of the run one schedule spans, in epochs: warmup from `start`, decay until `end`.

    A fresh run's phase is (0, epochs). Epochs, not steps: a continued run may
    have another number of steps per epoch. `epochs` is the run's setting the
    last time the phase was followed, what a continued run's `epochs` is
    compared with.
    """

    start: float
    end: float
    epochs: int

    @classmethod
    def whole_run(cls, epochs: int) -> SchedulePhase:
        return cls(0.0, float(epochs), epochs)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_checkpoint(cls, state: dict[str, Any], epochs: int) -> SchedulePhase:
        """The phase a checkpoint's steps followed; one written before phases: all of its config's epochs
        (or of `epochs`, the current setting, without a config to say)."""
        saved = state.get("schedule_phase")
        if saved is None:
            return cls.whole_run(int((state.get("config") or {}).get("epochs", epochs)))
        return cls(float(saved["start"]), float(saved["end"]), int(saved["epochs"]))


def make_schedule(
    cfg: TrainConfig, steps_per_epoch: int, devices: int, phase: SchedulePhase | None = None
) -> LRSchedule:
    """cfg.optim's schedule in steps over `phase` (default: the whole run), peaking at peak_learning_rate."""
    phase = phase or SchedulePhase.whole_run(cfg.epochs)
    start_step = round(phase.start * steps_per_epoch)
    return LRSchedule(
        peak=peak_learning_rate(cfg, devices),
        warmup_steps=max(1, round(cfg.optim.warmup_epochs * steps_per_epoch)),
        total_steps=round(phase.end * steps_per_epoch) - start_step,
        kind=cfg.optim.schedule,
        min_ratio=cfg.optim.min_lr_ratio,
        decay_every_steps=max(1, round(cfg.optim.decay_every_epochs * steps_per_epoch)),
        decay_factor=cfg.optim.decay_factor,
        poly_power=cfg.optim.poly_power,
        start_step=start_step,
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


def epochs_changed(saved: SchedulePhase, cfg: TrainConfig) -> bool:
    """A continued run asks for another horizon than its last process did, under a schedule that has one."""
    return saved.epochs != cfg.epochs and cfg.optim.schedule in HORIZON_SCHEDULES


def continued_phase(saved: SchedulePhase, position: float, cfg: TrainConfig) -> SchedulePhase:
    """The phase a run continued at `position` (in epochs) follows, per optim.on_epochs_change.

    Unchanged epochs (or a schedule without a horizon) keep the saved phase:
    the continuation is exact. refuse is checked before spawning
    (launch.resume_checks); here it keeps the phase too.
    """
    epochs = cfg.epochs
    if not epochs_changed(saved, cfg):
        return dataclasses.replace(saved, epochs=epochs)
    choice = cfg.optim.on_epochs_change
    if choice == EpochsChange.restart:
        return SchedulePhase(position, float(epochs), epochs)
    if choice == EpochsChange.stretch:
        return SchedulePhase(saved.start, float(epochs), epochs)
    return dataclasses.replace(saved, epochs=epochs)


def factor_at(cfg: TrainConfig, phase: SchedulePhase, position: float) -> float:
    """The schedule's lr at `position` (epochs) over `phase`, as a multiple of the peak."""
    schedule = make_schedule(cfg, NOMINAL_STEPS_PER_EPOCH, 1, phase)
    schedule.peak = 1.0
    value = schedule(round(position * NOMINAL_STEPS_PER_EPOCH))
    return 0.0 if value < 1e-20 else value  # xla_safe_scalar's nudge is no value to show


def describe_epochs_change(saved: SchedulePhase, position: float, cfg: TrainConfig) -> str:
    """What each optim.on_epochs_change would do to the lr when `epochs` changes at `position`."""
    kind = cfg.optim.schedule.value
    new = float(cfg.epochs)
    keep = factor_at(cfg, saved, position)
    stretched = factor_at(cfg, SchedulePhase(saved.start, new, cfg.epochs), position)
    return (
        f"epochs={cfg.epochs} continues a run whose {kind} schedule was drawn over epochs "
        f"{saved.start:g}-{saved.end:g} (epochs={saved.epochs}), at epoch {position:g} now: set "
        f"optim.on_epochs_change=keep (the old schedule goes on: lr {keep:.3g} x the peak now"
        f"{', its floor from then on' if position >= saved.end else ''}), restart (a new phase over epochs "
        f"{position:g}-{new:g}: warmup to the peak again, then the {kind} decay), or stretch (the schedule "
        f"redrawn over epochs {saved.start:g}-{new:g}: lr {stretched:.3g} x the peak now)"
    )


def resumed_phase(
    state: dict[str, Any], cfg: TrainConfig, position: float
) -> tuple[SchedulePhase, str | None]:
    """The phase a run continued from checkpoint `state` at `position` follows, and a line on any change.

    A changed `epochs` is never silent: under a horizon-free schedule the line
    says it changes nothing; otherwise it says what on_epochs_change did.
    """
    saved = SchedulePhase.from_checkpoint(state, cfg.epochs)
    phase = continued_phase(saved, position, cfg)
    if saved.epochs == cfg.epochs:
        return phase, None
    kind = cfg.optim.schedule.value
    if not epochs_changed(saved, cfg):
        return phase, f"epochs {saved.epochs} -> {cfg.epochs}: the {kind} schedule has no horizon to change"
    choice = cfg.optim.on_epochs_change.value
    return phase, (
        f"epochs {saved.epochs} -> {cfg.epochs} at epoch {position:g}, optim.on_epochs_change={choice}: "
        f"the {kind} schedule is drawn over epochs {phase.start:g}-{phase.end:g}"
        + (" (warmup, then decay, from here)" if phase.start != saved.start else "")
    )


class LearningRate:
    """The run's lr at each global step, and the phase it follows (what a checkpoint keeps of it)."""

    def __init__(self, cfg: TrainConfig, steps_per_epoch: int, devices: int):
        self.cfg, self.steps_per_epoch, self.devices = cfg, steps_per_epoch, devices
        self.follow(SchedulePhase.whole_run(cfg.epochs))

    def follow(self, phase: SchedulePhase) -> None:
        self.phase = phase
        self.schedule = make_schedule(self.cfg, self.steps_per_epoch, self.devices, phase)

    def resume(self, state: dict[str, Any], position: float) -> None:
        """Go on with checkpoint `state`'s phase at `position` (epochs), or what other `epochs` make of it."""
        phase, change = resumed_phase(state, self.cfg, position)
        if change:
            log.warning("%s", change)
        self.follow(phase)

    def __call__(self, step: int) -> float:
        return self.schedule(step)

    @property
    def peak(self) -> float:
        return self.schedule.peak

    @property
    def warmup_steps(self) -> int:
        return self.schedule.warmup_steps
