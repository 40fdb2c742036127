"""The device's idle time between training steps, and the part of it the input caused.

The host's wait for a batch (observe.timing.InputWait) is not the device's
idle time: an asynchronous device may still be running the steps queued
before the wait. What idles the device is a gap between two steps: the
previous step done, the next not yet handed over. A gap that followed a wait
for input is the input's doing up to the length of that wait (the rest of
the gap is the host's own work: tracing, compiling, launching), so

    input-caused idle = min(gap, host wait before the next step)

summed over the epoch's steps (``input_caused``). Each device loader sees the
step boundaries (a batch asked for: the step before is handed to the device;
a batch returned: the next step follows) and records them its own way, with
no synchronisation per step; the numbers are settled at the epoch's end,
where the trainer reads the epoch's loss anyway:

- ``SynchronousGaps`` (cpu_eager): ops run when called, so the only gaps are
  the host's waits; device idle = input-bound = host wait.
- ``EventGaps`` (CUDA): timing events recorded on the compute stream at
  each step's start and end; a gap is the time between one step's end event
  and the next one's start event on the stream.
- ``ReadyGaps`` (XLA): a step is done when its output's buffer is ready
  (torch_xla's on_ready_callback); a gap is from then to the moment the next
  step's graph is cut and handed to the device.

docs/watching.md says what each includes and how far it can be off.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from tpustream.observe.timing import InputWait

# CUDA events read (non-blocking) once this many steps are pending: a bounded list, few queries.
FOLD_EVERY = 64
# Why ReadyGaps watched a step: the host was about to wait for a batch, or it is a sample.
WAITED, SAMPLED = "waited", "sampled"


def input_caused(gap: float, host_wait: float) -> float:
    """The part of a device gap between steps that the host's wait for the next batch caused."""
    return max(0.0, min(gap, host_wait))


class SynchronousGaps:
    """cpu_eager: ops run as the loop calls them, so the device idles exactly while the host waits."""

    def __init__(self, wait: InputWait):
        self.wait = wait

    def settle(self) -> tuple[float, float]:
        return self.wait.seconds, self.wait.seconds


class EventGaps:
    """CUDA: events on the compute stream where each step starts (its batch handed over) and ends.

    make_event: a new timing event recorded on the current stream when called
    (torch.cuda.Event(enable_timing=True) then .record()). Completed pairs are
    folded with query() as the epoch goes, the rest at its end.
    """

    def __init__(self, wait: InputWait, make_event: Callable[[], Any]):
        self.wait = wait
        self.make_event = make_event
        self.pending: deque[tuple[Any, Any, float]] = deque()  # (end event, next start event, host wait)
        self.idle = self.caused = 0.0
        self.ended()  # the loop's start: the device's gap before the first step counts too

    def ended(self) -> None:
        """The loop asks for the next batch: the step's work is queued on the stream."""
        self.end = self.make_event()
        self.waited_before = self.wait.seconds

    def started(self) -> None:
        """A batch is handed to the loop (its copy queued): the next step's work follows on the stream."""
        self.pending.append((self.end, self.make_event(), self.wait.seconds - self.waited_before))
        if len(self.pending) >= FOLD_EVERY:
            self.fold(block=False)

    def fold(self, block: bool) -> None:
        while self.pending:
            end, start, waited = self.pending[0]
            if block:
                start.synchronize()
            elif not start.query():  # the stream has not reached it: nor any later one
                return
            gap = max(0.0, end.elapsed_time(start) / 1000)  # milliseconds
            self.idle += gap
            self.caused += input_caused(gap, waited)
            self.pending.popleft()

    def settle(self) -> tuple[float, float]:
        self.fold(block=True)
        return self.idle, self.caused


class ReadyGaps:
    """XLA: a step's output reports when its buffer is ready; the device loader marks the rest.

    on_ready(tensor, callback): calls callback(tensor) once tensor's device
    buffer is ready (torch_xla.experimental.callback.on_ready_callback), at
    once if it is, else on a runtime thread, without blocking the caller. The
    loop hands each step's output over through InputWait.note_output; without
    it nothing is measured.

    Not every step is watched. The runtime's thread that runs a callback waits
    for the GIL first, and on the XLA CPU device the next step waited with it:
    a callback every step cost 10% of the rate at 12 ms steps. A step is
    watched when the host is about to wait for a batch (the input-bound share
    needs exactly those: without a wait the input caused nothing), and one in
    SAMPLE_EVERY of the others, whose gaps stand for all of them in the device
    idle time (None while there is no such sample).

    A step is taken to start when the loop asks for the next batch, before
    the graph is cut: the cut itself (graph building, a compile, and on the
    XLA CPU device at times the step's execution, which the sync may run
    inline) is host work the device may spend idle, but counted as busy.
    """

    SAMPLE_EVERY = 16

    def __init__(self, wait: InputWait, on_ready: Callable[[Any, Callable[[Any], None]], None]):
        self.wait = wait
        self.on_ready = on_ready
        # Per batch asked for: [asked, waited, when the step trained on it began to be cut,
        # why the step before it was watched: WAITED, SAMPLED or None].
        self.asks: list[list[Any]] = []
        self.done: dict[int, float] = {}  # step index -> when its output was ready
        self.wait_started = 0.0
        self.measured = True

    def asked(self) -> None:
        """The loop asks for the next batch: the step on the last one is traced; its graph is cut next."""
        now = time.perf_counter()
        if self.asks:
            self.asks[-1][2] = now
        self.asks.append([now, None, None, None])

    def handed_over(self, will_wait: bool) -> None:
        """The step before the batch asked for (if any) was cut and handed over; the wait starts.

        will_wait: the device loader has no batch ready, so the host is about to wait.
        """
        step = len(self.asks) - 2
        output = self.wait.take_output()
        if step >= 0 and output is None:
            self.measured = False  # a loop that does not hand its outputs over
        elif step >= 0 and (will_wait or step % self.SAMPLE_EVERY == 0):
            self.asks[-1][3] = WAITED if will_wait else SAMPLED
            self.watch(step, output)
        self.wait_started = time.perf_counter()

    def watch(self, step: int, output: Any) -> None:
        def ready(_tensor: Any) -> None:
            self.done[step] = time.perf_counter()

        try:
            self.on_ready(output, ready)
        except RuntimeError:  # not device data (a loop that read its output on the host already)
            self.measured = False

    def received(self, last: bool) -> None:
        """The batch asked for arrived (last: the loader is exhausted and no step follows)."""
        now = time.perf_counter()
        ask = self.asks[-1]
        ask[1] = now - self.wait_started
        if last:
            ask[2] = now

    def settle(self) -> tuple[float | None, float] | None:
        if not self.measured or not self.asks:
            return None
        waited_idle = caused = sampled_idle = 0.0
        sampled = unwatched = 0
        for index, (asked, waited, next_step, why) in enumerate(self.asks):
            if waited is None or next_step is None:
                continue  # the loop stopped before this batch's step was cut
            if index > 0 and why is None:
                unwatched += 1  # a batch was ready: the input caused none of this gap
                continue
            # Nothing of this loop's was queued before its first batch; a step not done yet
            # (no callback so far) is still running, after the next step was handed over.
            done = asked if index == 0 else self.done.get(index - 1, float("inf"))
            gap = max(0.0, next_step - done)
            caused += input_caused(gap, waited)
            if why == SAMPLED:
                sampled, sampled_idle = sampled + 1, sampled_idle + gap
            else:
                waited_idle += gap
        if unwatched and not sampled:
            return None, caused
        return waited_idle + sampled_idle * (1 + unwatched / sampled if sampled else 1), caused
