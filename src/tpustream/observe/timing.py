"""Where an epoch's time goes: waiting for input, compiling, stepping, saving (evaluation: val_seconds).

Under XLA the training thread traces a step and hands it to the device
asynchronously; it blocks only when it needs something: the next batch (the
device loader's queue is empty: input-bound), a compilation (a new graph), or
the device itself (its queue of steps is full: device-bound, counted in
``step``). ``InputWait`` times the first of these where it happens, in the
device loader's queue, so measuring adds no device synchronisation; the
runtime feeds it, the trainer reads it once per epoch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass


@dataclass
class InputWait:
    """Seconds the training thread waited for batches, and how many it took."""

    seconds: float = 0.0
    batches: int = 0

    def add(self, seconds: float) -> None:
        self.seconds += seconds
        self.batches += 1


def timed(batches: Iterable, wait: InputWait | None) -> Iterator:
    """batches, with the time each one took to arrive added to wait (loaders without a queue of their own)."""
    iterator = iter(batches)
    while True:
        start = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            return
        if wait is not None:
            wait.add(time.perf_counter() - start)
        yield batch


@dataclass(frozen=True)
class Breakdown:
    """One replica's epoch: its training loop's wall time split, and its saving."""

    train_seconds: float  # the training loop in this process (a resumed epoch: since the resume)
    input_wait_seconds: float
    compile_seconds: float  # graphs compiled during the loop (process-wide XLA metric)
    checkpoint_seconds: float  # saving since the previous epoch's record (its end-of-epoch saves included)

    @property
    def step_seconds(self) -> float:
        """Tracing, dispatching and waiting on the device: the loop minus input waits and compiles."""
        return max(0.0, self.train_seconds - self.input_wait_seconds - self.compile_seconds)

    @property
    def input_wait_fraction(self) -> float:
        return min(1.0, self.input_wait_seconds / self.train_seconds) if self.train_seconds > 0 else 0.0


def reduce_breakdowns(replicas: list[Breakdown]) -> dict[str, float]:
    """metrics.jsonl's time fields: means over replicas, and the worst replica's input-wait share."""
    count = len(replicas)

    def mean(values) -> float:
        return sum(values) / count

    return {
        "input_wait_fraction": mean(r.input_wait_fraction for r in replicas),
        "input_wait_fraction_worst": max(r.input_wait_fraction for r in replicas),
        "input_wait_seconds": mean(r.input_wait_seconds for r in replicas),
        "compile_seconds": mean(r.compile_seconds for r in replicas),
        "step_seconds": mean(r.step_seconds for r in replicas),
        "checkpoint_seconds": mean(r.checkpoint_seconds for r in replicas),
    }


class LoopTimer:
    """A training loop's clock: started with the loop; the runtime's device loader feeds ``wait``."""

    def __init__(self, compile_seconds: Callable[[], float]):
        self.compile_seconds = compile_seconds
        self.wait = InputWait()
        self.compiled_before = compile_seconds()
        self.start = time.time()

    def breakdown(self, checkpoint_seconds: float) -> Breakdown:
        return Breakdown(
            train_seconds=time.time() - self.start,
            input_wait_seconds=self.wait.seconds,
            compile_seconds=self.compile_seconds() - self.compiled_before,
            checkpoint_seconds=checkpoint_seconds,
        )
