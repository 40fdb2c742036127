"""What a replica last finished, and when: the heartbeat its watchdog reads (tpustream.watchdog).

Progress is what the replica finishes: a training or evaluation step, a batch
received from its loader, bytes of a checkpoint serialised or written. Each is
a few attribute stores into ``HEARTBEAT`` from whichever thread made it: no
lock, no device sync, well under a microsecond (bench.ab runs with and without
the watchdog). A store is atomic under the GIL, so a torn read can only pair a
time with its neighbour's label, never hide progress.

A leaf: storage, the data pipeline and the trainer report here without
knowing what watches.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

# Training step intervals kept for their median (the most recent).
STEP_HISTORY = 256
# Steps that must finish after something compiles before it counts as done:
# under XLA the first step is traced, and compiled when the next batch cuts its
# graph, so the second step's end is the first after the compile.
COMPILE_STEPS = 2


class Heartbeat:
    """What this process last finished, and when (time.monotonic()); read by the watchdog's thread."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.at = time.monotonic()
        self.what = "nothing yet (starting)"
        self.epoch: int | None = None  # the last training step finished: its epoch, steps done in it
        self.step: int | None = None
        self.step_intervals: deque[float] = deque(maxlen=STEP_HISTORY)
        self.last_step_at: float | None = None
        # What this process compiles now (the first steps, a first evaluation), or None.
        self.compiling: str | None = "the start-up and the first steps"
        self.compile_steps_left = COMPILE_STEPS
        # The training thread waits for a batch: whatever it compiled before is compiled.
        self.waiting_for_input = False

    def beat(self, what: str) -> None:
        self.at = time.monotonic()
        self.what = what

    def step_finished(self, what: str, epoch: int | None = None, step: int | None = None) -> None:
        """A training step (its epoch and the steps of it done given) or an evaluation step finished."""
        now = time.monotonic()
        if self.compile_steps_left:
            self.compile_steps_left -= 1
            if not self.compile_steps_left:
                self.compiling = None
        elif epoch is not None and self.last_step_at is not None:
            self.step_intervals.append(now - self.last_step_at)
        if epoch is not None:
            self.last_step_at = now
            self.epoch, self.step = epoch, step
        self.at = now
        self.what = what

    def expect_compile(self, what: str) -> None:
        """What this process does next compiles graphs: counted as compiling until steps follow."""
        self.compiling = what
        self.compile_steps_left = COMPILE_STEPS
        self.last_step_at = None  # the interval across it is no step's
        self.at = time.monotonic()

    def input_wait_started(self) -> None:
        """The training thread asks for a batch it has not got: the step before it is cut (compiled)."""
        self.at = time.monotonic()
        self.what = "the training thread began waiting for a batch"
        self.waiting_for_input = True

    def input_wait_ended(self) -> None:
        self.waiting_for_input = False

    def last_finished(self) -> str:
        if self.epoch is None:
            return "no training step yet in this process"
        return f"training step {self.step} of epoch {self.epoch}"


HEARTBEAT = Heartbeat()


def beat(what: str) -> None:
    """Progress that is no step: a batch received, checkpoint bytes serialised or written."""
    HEARTBEAT.beat(what)


def step_finished(what: str, epoch: int | None = None, step: int | None = None) -> None:
    HEARTBEAT.step_finished(what, epoch, step)


def expect_compile(what: str) -> None:
    HEARTBEAT.expect_compile(what)


def input_wait_started() -> None:
    HEARTBEAT.input_wait_started()


def input_wait_ended() -> None:
    HEARTBEAT.input_wait_ended()


class ProgressStream:
    """A binary stream whose reads and writes are progress (an upload's reads, a serialisation's writes)."""

    def __init__(self, stream: Any, what: str):
        self._stream = stream
        self._what = what

    def read(self, *args: Any) -> bytes:
        data = self._stream.read(*args)
        HEARTBEAT.beat(self._what)
        return data

    def write(self, data: Any) -> int:
        written = self._stream.write(data)
        HEARTBEAT.beat(self._what)
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
