"""observe.idle: the device's gaps between steps and the part the input caused, on simulated devices.

Each simulated device keeps the truth (its own idle time between steps) and
the measurement is held against it: an asynchronous device that is still
busy while the host waits for a batch is not input-bound (measured: an H100
run at 98% of its own rate had its host wait 29% of the time for batches).
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from tests.conftest import REPO, xla_cpu_env
from tpustream.checkpoint import read_metrics
from tpustream.observe.idle import EventGaps, ReadyGaps, SynchronousGaps, input_caused
from tpustream.observe.timing import Breakdown, InputWait, reduce_breakdowns
from tpustream.runtime import native

STEPS = 12
MS = 0.001


def slow_batches(count: int, delay: float) -> Iterator[dict[str, torch.Tensor]]:
    """count batches, each taking delay seconds to arrive (a slow input pipeline)."""
    for index in range(count):
        time.sleep(delay)
        yield {"image": torch.full((2, 1, 2, 2), index, dtype=torch.uint8)}


def test_the_input_caused_what_it_waited_for_at_most():
    assert input_caused(0.02, 0.03) == 0.02  # the device idled 20 ms of a 30 ms wait
    assert input_caused(0.02, 0.005) == 0.005  # the rest of the gap was the host's own work
    assert input_caused(0.0, 0.03) == 0.0  # busy all along: the wait cost nothing
    assert input_caused(-0.001, 0.03) == 0.0


class FakeStream:
    """A CUDA stream on the host's clock: work runs in order, once queued and the stream is free."""

    def __init__(self):
        self.busy_until = time.perf_counter()
        self.idle = 0.0  # the truth: time between steps with nothing to run

    def enqueue(self, seconds: float) -> None:
        start = max(time.perf_counter(), self.busy_until)
        self.idle += start - self.busy_until
        self.busy_until = start + seconds


class FakeEvent:
    """torch.cuda.Event's timing calls: reached when the stream has run everything queued before it."""

    def __init__(self, stream: FakeStream):
        self.at = max(time.perf_counter(), stream.busy_until)

    def query(self) -> bool:
        return time.perf_counter() >= self.at

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.at - time.perf_counter()))

    def elapsed_time(self, other: FakeEvent) -> float:
        return (other.at - self.at) * 1000


class ImmediateCopies:
    """runtime.native._CopyStream without a GPU: each batch is ready as soon as it is placed."""

    def __init__(self, device: torch.device):
        self.device = device

    def place(self, place_batch, batch):
        return place_batch(batch), None

    def ready(self, moved, copied):
        return moved


def run_cuda_loop(monkeypatch, input_delay: float, step: float) -> tuple[InputWait, FakeStream, float]:
    """NativeRuntime's CUDA device loader over a slow source, each step queuing `step` seconds of work.

    (wait, stream, the loop's seconds until the stream has run every step)
    """
    stream = FakeStream()
    monkeypatch.setattr(native, "_recorded_event", lambda module: FakeEvent(stream))
    monkeypatch.setattr(native, "_to_device", lambda batch, device: batch)  # no GPU here
    monkeypatch.setattr(native, "_CopyStream", ImmediateCopies)  # nor a copy stream
    runtime = native.NativeRuntime(0, 1, 0, torch.device("cuda", 0))
    wait = InputWait()
    start = time.perf_counter()
    for _batch in runtime.device_loader(slow_batches(STEPS, input_delay), wait):
        stream.enqueue(step)  # launched, not run: the host goes on at once
    time.sleep(max(0.0, stream.busy_until - time.perf_counter()))  # the epoch's end reads the loss
    return wait, stream, time.perf_counter() - start


@pytest.mark.parametrize(
    ("input_delay", "step", "bound"),
    [
        (0.0, 20 * MS, False),  # device-bound: the host runs ahead of the stream
        (30 * MS, 10 * MS, True),  # input-bound: 20 ms of every 30 the stream has nothing to do
        (10 * MS, 30 * MS, False),  # the host waits a third of the time, the stream never idles
    ],
)
def test_cuda_events_measure_the_streams_gaps_not_the_hosts_wait(monkeypatch, input_delay, step, bound):
    wait, stream, loop = run_cuda_loop(monkeypatch, input_delay, step)
    idle, caused = wait.gaps.settle()
    assert idle == pytest.approx(stream.idle, abs=10 * MS)
    assert 0 <= caused <= idle + 1e-9
    if bound:
        # Each 30 ms batch leaves the stream idle about 20 ms, all of it the input's doing.
        assert caused > 0.95 * idle and idle > 0.5 * loop
    else:
        assert caused < 0.15 * loop  # the wait for the first batches (one ahead), no more
    if input_delay and not bound:
        assert wait.seconds > 0.25 * loop  # what the host-side figure alone called input-bound


def test_cuda_events_are_read_as_they_complete_and_at_the_epochs_end():
    stream, wait = FakeStream(), InputWait()
    gaps = EventGaps(wait, lambda: FakeEvent(stream))
    for _ in range(70):  # past FOLD_EVERY: the completed pairs are folded on the way
        gaps.started()
        gaps.ended()
    assert len(gaps.pending) < 64
    assert gaps.settle()[0] >= 0 and not gaps.pending


class FakeXlaDevice:
    """A device thread that runs handed-over steps one after another, as torch_xla 2.9 queues them.

    on_ready follows on_ready_callback: called at once for a step already done,
    else from the device's thread when it is. idle: the truth, the device's own
    time with nothing to run between its first and last step.
    """

    def __init__(self):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.done: set[object] = set()
        self.callbacks: dict[object, list] = {}
        self.idle = 0.0
        self.thread = threading.Thread(target=self.run)
        self.thread.start()

    def hand_over(self, output: object | None, seconds: float = 0.0, inline: bool = False) -> None:
        """Queue a step (None: the end); inline: run it in the caller's sync, as XLA:CPU at times does."""
        if inline:
            finished = threading.Event()
            self.queue.put((output, seconds, finished))
            finished.wait()
        else:
            self.queue.put((output, seconds, None))

    def run(self) -> None:
        finished = time.perf_counter()  # the loop starts with nothing queued
        while True:
            output, seconds, inline = self.queue.get()
            if output is None:
                return
            started = time.perf_counter()
            self.idle += started - finished
            time.sleep(seconds)
            with self.lock:
                self.done.add(output)
                callbacks = self.callbacks.pop(output, [])
            finished = time.perf_counter()
            for callback in callbacks:
                callback(output)
            if inline is not None:
                inline.set()

    def on_ready(self, output: object, callback) -> None:
        with self.lock:
            if output not in self.done:
                self.callbacks.setdefault(output, []).append(callback)
                return
        callback(output)


def run_xla_loop(
    input_delay: float, step: float, hand_outputs: bool = True, inline: bool = False, trace: float = 0.0
) -> tuple[InputWait, FakeXlaDevice, float]:
    """The calls runtime.device.timed_parallel_loader and the trainer make, in order, on a fake device.

    trace: the host's own seconds a step (tracing it). (wait, device, the loop's seconds until
    the device has run every step)
    """
    device, wait = FakeXlaDevice(), InputWait()
    gaps = ReadyGaps(wait, device.on_ready)
    wait.gaps = gaps
    start = time.perf_counter()
    previous = None
    for index in range(STEPS + 1):
        gaps.asked()  # PerDeviceLoader.next: the loop asks for a batch
        if previous is not None:
            device.hand_over(previous, step, inline)  # and cuts the graph of the step before
        asked = time.perf_counter()
        # A slow input leaves the queue empty; so does the end (its marker comes after the last batch).
        gaps.handed_over(will_wait=input_delay > 0 or index == STEPS)
        if index < STEPS:
            time.sleep(input_delay)  # ParallelLoader.next_item
        wait.add(time.perf_counter() - asked)
        gaps.received(last=index == STEPS)
        if index == STEPS:
            break
        time.sleep(trace)
        previous = object()  # the step's output (its loss)
        if hand_outputs:
            wait.note_output(previous)
    device.hand_over(None)
    device.thread.join()  # the epoch's end reads the loss
    return wait, device, time.perf_counter() - start


@pytest.mark.parametrize(
    ("input_delay", "step", "bound", "inline"),
    [
        (0.0, 20 * MS, False, False),
        (30 * MS, 10 * MS, True, False),
        (10 * MS, 30 * MS, False, False),
        (30 * MS, 10 * MS, True, True),  # the step runs inside the cut: done before it is watched
    ],
)
def test_xla_ready_callbacks_measure_the_devices_gaps_not_the_hosts_wait(input_delay, step, bound, inline):
    # Once more on a miss: a device-bound loop's idle time is sampled and extrapolated, so one
    # scheduler hiccup of the fake device's thread on 2 busy cores counts about 11 times (seen
    # once: 12.8 ms off against 10); a wrong measure misses twice. 10 ms or 5%, whichever is
    # more: an input-bound loop's 0.38 s of gaps measured 12 ms short on both tries once, under
    # a suite slowed by accounting hooks.
    try:
        check_xla_gaps(input_delay, step, bound, inline)
    except AssertionError:
        check_xla_gaps(input_delay, step, bound, inline)


def check_xla_gaps(input_delay: float, step: float, bound: bool, inline: bool) -> None:
    wait, device, loop = run_xla_loop(input_delay, step, inline=inline)
    idle, caused = wait.gaps.settle()
    assert idle == pytest.approx(device.idle, abs=10 * MS, rel=0.05)
    assert 0 <= caused <= idle + 1e-9
    if bound:
        assert caused > 0.95 * idle and idle > 0.5 * loop  # the rest: the host's own work between
    else:
        assert caused < 0.15 * loop  # the wait for the first batch, no more
    if input_delay and not bound:
        assert wait.seconds > 0.25 * loop


def test_steps_without_a_wait_are_sampled_for_the_devices_idle_time(monkeypatch):
    """A host slower than the device (15 ms of tracing, 5 ms steps): 10 ms gaps, none of them the input's."""
    monkeypatch.setattr(ReadyGaps, "SAMPLE_EVERY", 4)
    wait, device, loop = run_xla_loop(0.0, 5 * MS, trace=15 * MS)
    watched = sorted(wait.gaps.done)
    assert watched == [0, 4, 8, STEPS - 1]  # the samples, and the last step (the end is waited for)
    idle, caused = wait.gaps.settle()
    assert idle == pytest.approx(device.idle, rel=0.25) and idle > 0.4 * loop
    assert caused < 0.1 * loop


def test_steps_still_running_at_the_epochs_end_count_as_busy():
    """No synchronisation to settle: a step whose output is not ready yet was running."""
    wait = InputWait()
    gaps = ReadyGaps(wait, lambda output, callback: None)  # nothing ever reports ready
    for index in range(3):
        gaps.asked()
        gaps.handed_over(will_wait=True)
        gaps.received(last=index == 2)
        wait.note_output(object())
    idle, caused = gaps.settle()
    assert idle == pytest.approx(gaps.asks[0][2] - gaps.asks[0][0]) and caused <= idle


def test_a_loop_without_outputs_or_with_host_values_measures_nothing():
    wait, _device, _loop = run_xla_loop(0.0, MS, hand_outputs=False)
    assert wait.gaps.settle() is None

    def not_device_data(output, callback):
        raise RuntimeError("Could not get the buffer pointer for XLATensor with IR that's not DeviceData")

    wait = InputWait()
    gaps = ReadyGaps(wait, not_device_data)
    for _ in range(2):
        gaps.asked()
        gaps.handed_over(will_wait=True)
        gaps.received(last=False)
        wait.note_output(torch.zeros(()))
    assert gaps.settle() is None


def test_eager_on_the_cpu_idles_exactly_while_the_host_waits():
    runtime = native.NativeRuntime(0, 1, 0, torch.device("cpu"))
    wait = InputWait()
    assert len(list(runtime.device_loader(slow_batches(4, 5 * MS), wait))) == 4
    assert isinstance(wait.gaps, SynchronousGaps)
    assert wait.gaps.settle() == (wait.seconds, wait.seconds) and wait.seconds >= 4 * 5 * MS


def test_replicas_reduce_to_the_mean_and_the_worst_and_only_when_all_measured():
    def replica(bound: float | None, idle: float | None) -> Breakdown:
        return Breakdown(10.0, 3.0, 0.0, 0.0, device_idle_seconds=idle, input_bound_seconds=bound)

    fields = reduce_breakdowns([replica(1.0, 2.0), replica(3.0, 4.0)])
    assert fields["input_wait_fraction"] == pytest.approx(0.3)
    assert fields["input_bound_fraction"] == pytest.approx(0.2)
    assert fields["input_bound_fraction_worst"] == pytest.approx(0.3)
    assert fields["device_idle_fraction"] == pytest.approx(0.3)
    fields = reduce_breakdowns([replica(1.0, 2.0), replica(None, None)])
    assert "input_bound_fraction" not in fields and "device_idle_fraction" not in fields


def epoch_shares(accelerator: str, output_dir: str) -> list[dict]:
    """tests/idle_epochs.py's epochs on this accelerator, in a process of its own (XLA: not beside eager)."""
    env = xla_cpu_env() if accelerator == "cpu" else dict(os.environ)
    command = [sys.executable, "-m", "tests.idle_epochs", accelerator, output_dir]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(output_dir)


@pytest.mark.slow
def test_the_input_bound_share_is_what_the_input_cost_the_rate(tmp_path):
    """Within 5 points of 1 - real/device-only rate, starved or not.

    A starved epoch (batches 0.6 s apart, steps of well under 0.1 s) is held
    against the delay-free epochs on either side of it (the device-only rate);
    a delay-free epoch is device-bound, and its own reference: under XLA the
    host still waits for batches there at times (ParallelLoader moves them to
    the device in groups while steps run), which is not input-bound.

    The XLA device only: there the share comes from the device's ready gaps,
    which can be wrong. Eager on the CPU idles exactly while the host waits
    (test_eager_on_the_cpu_idles_exactly_while_the_host_waits), and its run
    here (`python -m tests.idle_epochs cpu_eager DIR`) measures the machine:
    beside the suite's other worker its delay-free epochs ran 380 to 850
    samples/s, and one in two starved epochs missed its neighbours' reference
    by 5 to 10 points, both ways.
    """
    # Once more on a miss: on 2 shared cores a burst of another test's work can slow one
    # epoch's steps (not its waits) past the 5 points (seen once in about ten full suites:
    # 0.868 against 0.920); a wrong measure misses both times.
    try:
        check_shares(epoch_shares("cpu", str(tmp_path / "run")))
    except AssertionError:
        check_shares(epoch_shares("cpu", str(tmp_path / "again")))


def check_shares(records: list[dict]) -> None:
    from tests.idle_epochs import EPOCH_DELAYS

    assert [r["epoch"] for r in records] == list(range(len(EPOCH_DELAYS)))
    for before, epoch, after in zip(records[1:], records[2:], records[3:], strict=False):
        if not EPOCH_DELAYS[epoch["epoch"]]:
            continue
        device_only = (before["global_rate"] + after["global_rate"]) / 2
        cost = 1 - epoch["global_rate"] / device_only
        assert epoch["input_bound_fraction"] == pytest.approx(cost, abs=0.05), (epoch, device_only)
    for record in records[1:]:
        if not EPOCH_DELAYS[record["epoch"]]:
            assert record["input_bound_fraction"] < 0.05, record
        assert record["input_bound_fraction"] <= record["device_idle_fraction"] + 1e-9
