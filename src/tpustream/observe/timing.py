"""Where an epoch's time goes: waiting for input, compiling, stepping, saving (evaluation: val_seconds).

Under XLA the training thread traces a step and hands it to the device
asynchronously; it blocks only when it needs something: the next batch (the
device loader's queue is empty: input-bound), a compilation (a new graph), or
the device itself (its queue of steps is full: device-bound, counted in
``step``). ``InputWait`` times the first of these where it happens, in the
device loader's queue, so measuring adds no device synchronisation; the
runtime feeds it, the trainer reads it once per epoch.

That host wait is not the device's idle time: an asynchronous device (XLA,
CUDA) may still run the steps queued before it. Where the device loader can
see the device's gaps between steps (``observe.idle``), it gives the wait a
``gaps`` object, and the epoch also gets the device's idle time and the part
of it the input caused (input-bound).

Whose lateness a wait was: each batch carries the moment its last piece was
made (``MADE``: stamped where the data pipeline ends, in the DataLoader
worker), and the loader splits its consumer's waits into waiting for the
making (the workers' reading and decoding) and for the delivery after it
(``BatchWaits``).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tpustream import progress
from tpustream.observe.trace_gaps import INPUT_WAIT


class StepGaps(Protocol):
    """A device loader's record of the device's gaps between steps (observe.idle)."""

    def settle(self) -> tuple[float | None, float] | None:
        """(seconds the device idled between steps, the part the input caused); None: not measured."""


# Drawn once when this module is imported: a process's own with the start method "spawn", and
# a new one in every train.py (a fork's child has the parent's, and its own pid).
_PROCESS_NONCE = uuid.uuid4().hex[:8]


def process_token() -> str:
    """This process, as an epoch record names it: XLA's compilation count and timers are per process.

    Each process of a resumed run has its own (a restart reuses no token even
    where its pid repeats, as pid 1 in a container does); replicas that are
    threads of one process (TPU v2/v3) share it, and their compilations too.
    """
    return f"{os.getpid()}-{_PROCESS_NONCE}"


# A batch's field: time.monotonic() when its last piece left a data pipeline (one clock for
# every process of a host: CLOCK_MONOTONIC); the loader takes it out (data.read.loader).
MADE = "made"


def stamp_made(item: dict) -> dict:
    """item with the moment it leaves a data pipeline (MADE), for the loader's BatchWaits."""
    item[MADE] = time.monotonic()
    return item


@dataclass
class BatchWaits:
    """A loader's consumer's waits for one pass's batches, and the part of them spent on the making.

    A wait from ``asked`` to ``got`` for a batch whose last piece was made at
    ``made`` waited for the making until then (nothing where it was made
    before the consumer asked) and for its delivery after: the pipe to the
    replica's process, receiving and joining the pieces, the copy out of the
    shared slot (the pin), decoding on the device. More workers shorten only
    the first part: in a replica whose waits are mostly the second, the
    workers had the batches ready and the replica's process took them late.
    Waits for batches without a stamp (made elsewhere) are left out.
    """

    seconds: float = 0.0
    making_seconds: float = 0.0

    def add(self, asked: float, got: float, made: float | None) -> None:
        if made is None:
            return
        wait = max(0.0, got - asked)
        self.seconds += wait
        self.making_seconds += min(max(0.0, made - asked), wait)

    def making_share(self) -> float | None:
        """The share of the waits spent on batches not yet made; None without a wait to split."""
        return self.making_seconds / self.seconds if self.seconds > 0 else None


@dataclass
class InputWait:
    """Seconds the training thread waited for batches, and how many it took."""

    seconds: float = 0.0
    batches: int = 0
    gaps: StepGaps | None = None  # set by a device loader that sees the device's gaps between steps
    output: Any = None  # the latest step's output, until the device loader takes it (XLA: done when ready)

    def add(self, seconds: float) -> None:
        self.seconds += seconds
        self.batches += 1

    def note_output(self, output: Any) -> None:
        """A step's output (its loss): once it is computed, the device has run the step."""
        self.output = output

    def take_output(self) -> Any:
        output, self.output = self.output, None
        return output


def timed(batches: Iterable, wait: InputWait | None) -> Iterator:
    """batches, with the time each one took to arrive added to wait (loaders without a queue of their own).

    Under torch.profiler (the native runtime's debug.profile_steps) each wait
    is marked "input wait" in the trace; otherwise nothing is recorded (a
    record_function costs about 13 us even with no profiler on).
    """
    iterator = iter(batches)
    while True:
        start = time.perf_counter()
        progress.input_wait_started()
        try:
            if torch.autograd._profiler_enabled():
                with torch.profiler.record_function(INPUT_WAIT):
                    batch = next(iterator)
            else:
                batch = next(iterator)
        except StopIteration:
            return
        finally:
            progress.input_wait_ended()
        if wait is not None:
            wait.add(time.perf_counter() - start)
        yield batch


@dataclass(frozen=True)
class Breakdown:
    """One replica's epoch: its training loop's wall time split, and its saving."""

    train_seconds: float  # the training loop in this process (a resumed epoch: since the resume)
    input_wait_seconds: float
    compile_seconds: float  # graphs compiled during the loop (process-wide XLA metric)
    # Saving since the previous epoch's record (its end-of-epoch saves included): what the
    # loop waited (host copy, barrier, the previous save), and the serialising and writing,
    # in the background or not (only the master writes; a background write counts once done).
    checkpoint_stall_seconds: float
    checkpoint_write_seconds: float = 0.0
    # Of the stall: taking the state and copying it to host memory (under XLA this first waits
    # for the device to run the steps queued before it), and waiting for the background writer
    # to finish the previous save. The rest is synchronous writing and barriers (training.saving).
    checkpoint_copy_seconds: float = 0.0
    checkpoint_writer_wait_seconds: float = 0.0
    # The device's gaps between steps, and the part of them that followed a wait for input;
    # None where the runtime cannot see the device (observe.idle).
    device_idle_seconds: float | None = None
    input_bound_seconds: float | None = None
    # The loader's waits for batches, and for their making; None where its batches carry no stamp.
    input_waits: BatchWaits | None = None

    @property
    def step_seconds(self) -> float:
        """Tracing, dispatching and waiting on the device: the loop minus input waits and compiles."""
        return max(0.0, self.train_seconds - self.input_wait_seconds - self.compile_seconds)

    @property
    def input_wait_fraction(self) -> float:
        """The host's share: the training thread waiting for a batch (the device may be busy meanwhile)."""
        return self.share(self.input_wait_seconds)

    @property
    def input_bound_fraction(self) -> float | None:
        """The device's share idle for input: between steps, after the host waited for a batch."""
        return None if self.input_bound_seconds is None else self.share(self.input_bound_seconds)

    @property
    def device_idle_fraction(self) -> float | None:
        return None if self.device_idle_seconds is None else self.share(self.device_idle_seconds)

    def share(self, seconds: float) -> float:
        return min(1.0, seconds / self.train_seconds) if self.train_seconds > 0 else 0.0


def reduce_breakdowns(replicas: list[Breakdown]) -> dict[str, float | str]:
    """metrics.jsonl's time fields: means over replicas, and the worst replica's input-wait share.

    Also train_process: the process that ran this loop (process_token), so a
    reader tells a process's first loop (its graphs compiled, its rate with
    them) from later ones, even where another process records the epoch.
    """
    count = len(replicas)

    def mean(values) -> float:
        return sum(values) / count

    fields = {
        "input_wait_fraction": mean(r.input_wait_fraction for r in replicas),
        "input_wait_fraction_worst": max(r.input_wait_fraction for r in replicas),
        "input_wait_seconds": mean(r.input_wait_seconds for r in replicas),
        "compile_seconds": mean(r.compile_seconds for r in replicas),
        "step_seconds": mean(r.step_seconds for r in replicas),
        "checkpoint_stall_seconds": mean(r.checkpoint_stall_seconds for r in replicas),
        "checkpoint_write_seconds": max(r.checkpoint_write_seconds for r in replicas),
        # The slowest replica's (the master's: it alone copies and writes), which every replica
        # waits for at the save's barrier: the parts of the stall, not a mean that dilutes them.
        "checkpoint_copy_seconds": max(r.checkpoint_copy_seconds for r in replicas),
        "checkpoint_writer_wait_seconds": max(r.checkpoint_writer_wait_seconds for r in replicas),
        "train_process": process_token(),
    }
    # The device's shares only where every replica measured them: a mean of some would be invented.
    bound = [r.input_bound_fraction for r in replicas]
    if None not in bound:
        fields["input_bound_fraction"] = mean(bound)
        fields["input_bound_fraction_worst"] = max(bound)
    idle = [r.device_idle_fraction for r in replicas]
    if None not in idle:
        fields["device_idle_fraction"] = mean(idle)
    # Weighted by each replica's waits: one that hardly waited says little about the others.
    waits = [r.input_waits for r in replicas]
    if None not in waits:
        total = BatchWaits(sum(w.seconds for w in waits), sum(w.making_seconds for w in waits))
        if total.making_share() is not None:
            fields["input_making_share"] = total.making_share()
    return fields


class LoopTimer:
    """A training loop's clock: started with the loop; the runtime's device loader feeds ``wait``.

    source: the loop's batches; where it keeps its pass's ``waits`` (BatchWaits), the epoch
    also says whose lateness they were.
    """

    def __init__(self, compile_seconds: Callable[[], float], source: Any = None):
        self.compile_seconds = compile_seconds
        self.source = source
        self.wait = InputWait()
        self.compiled_before = compile_seconds()
        self.start = time.time()

    def breakdown(
        self,
        checkpoint_stall_seconds: float,
        checkpoint_write_seconds: float,
        checkpoint_copy_seconds: float = 0.0,
        checkpoint_writer_wait_seconds: float = 0.0,
    ) -> Breakdown:
        """The loop so far; the saving's seconds as training.saving's take_seconds gives them."""
        train_seconds = time.time() - self.start
        # At the epoch's end (the trainer reads its loss next): CUDA events are read here.
        idle = self.wait.gaps.settle() if self.wait.gaps is not None else None
        return Breakdown(
            train_seconds=train_seconds,
            input_wait_seconds=self.wait.seconds,
            compile_seconds=self.compile_seconds() - self.compiled_before,
            checkpoint_stall_seconds=checkpoint_stall_seconds,
            checkpoint_write_seconds=checkpoint_write_seconds,
            checkpoint_copy_seconds=checkpoint_copy_seconds,
            checkpoint_writer_wait_seconds=checkpoint_writer_wait_seconds,
            device_idle_seconds=None if idle is None else idle[0],
            input_bound_seconds=None if idle is None else idle[1],
            input_waits=getattr(self.source, "waits", None),
        )
