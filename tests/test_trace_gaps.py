"""observe.trace_gaps: a traced GPU's idle time between kernels, split by what the next kernel waited for."""

from __future__ import annotations

import gzip
import json

import pytest

from tpustream.observe import trace_gaps

HOST, COMPUTE, COPY = (100, 1), (0, 7), (0, 20)  # (pid, tid): the training thread, two GPU streams


def on(where: tuple[int, int], cat: str, name: str, ts: float, dur: float, **args) -> dict:
    pid, tid = where
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


def launched(correlation: int, at: float, cat: str, start: float, dur: float, stream=COMPUTE) -> list[dict]:
    """A launch on the host and the device work it queued, linked by their correlation id."""
    call = "cudaMemcpyAsync" if cat == "gpu_memcpy" else "cudaLaunchKernel"
    name = "Memcpy HtoD (Pinned -> Device)" if cat == "gpu_memcpy" else f"kernel {correlation}"
    return [
        on(HOST, "cuda_runtime", call, at, 5, correlation=correlation),
        on(stream, cat, name, start, dur, correlation=correlation, stream=stream[1]),
    ]


def two_steps() -> list[dict]:
    """Two marked steps whose compute stream stops for each cause once (times in microseconds)."""
    return [
        on(HOST, "user_annotation", "train step 1", 0, 1000),
        on(HOST, "user_annotation", "train step 2", 1000, 1000),
        *launched(1, 10, "kernel", 100, 300),  # busy 100-400
        # The batch came late: launched at 700, after a 300 us input wait; gap 400-720.
        on(HOST, "user_annotation", "input wait", 400, 300),
        *launched(2, 700, "kernel", 720, 180),  # 720-900
        # Queued at 880 but held for the batch's copy on the copy stream (850-1000): gap 900-1010.
        *launched(3, 840, "gpu_memcpy", 850, 150, stream=COPY),
        *launched(4, 880, "kernel", 1010, 90),  # 1010-1100
        # Queued at 1050 and held for something else: gap 1100-1300.
        *launched(5, 1050, "kernel", 1300, 100),  # 1300-1400
        # Launched late while the host ran aten::nonzero (a synchronisation): gap 1400-1510.
        on(HOST, "cpu_op", "aten::nonzero", 1350, 140),
        on(HOST, "cpu_op", "aten::add", 1380, 10),  # inside it: the outermost is named
        *launched(6, 1500, "kernel", 1510, 90),  # 1510-1600
        # Launched after the traced steps: not theirs.
        *launched(7, 2500, "kernel", 2600, 100),
        {"ph": "i", "name": "instant", "ts": 5},  # not a complete event
    ]


def test_each_gap_goes_to_what_the_kernel_after_it_waited_for():
    found = trace_gaps.summarise(two_steps())
    assert found["steps"] == 2 and found["compute_stream"] == list(COMPUTE)
    assert found["window_ms"] == pytest.approx(1.5)  # 100-1600: what the marked steps launched
    assert found["idle_ms"] == pytest.approx(0.74) and found["gaps"] == 4
    assert found["idle_by_cause_ms"] == pytest.approx(
        {"input": 0.3, "host": 0.02 + 0.11, "copy": 0.11, "other stream": 0.2, "unknown": 0.0}
    )
    ops = {"(no operator: Python or idle)": 0.02, "aten::nonzero": 0.11}
    assert found["host_ops_ms"] == pytest.approx(ops)
    assert found["host_to_device_copies_on_compute_stream"] == 0
    text = trace_gaps.describe("t", found)
    assert "compute stream idle 0.7 ms (49.3%) in 4 gaps: input 0.3 ms (20.0%)" in text
    assert "aten::nonzero 0.1 ms" in text


def test_without_step_marks_the_whole_trace_counts_and_unlinked_kernels_are_unknown():
    events = [*launched(1, 0, "kernel", 10, 10), on(COMPUTE, "kernel", "graph replay", 40, 10)]
    found = trace_gaps.summarise(events)
    assert found["steps"] == 0 and found["idle_by_cause_ms"]["unknown"] == pytest.approx(0.02)
    described = trace_gaps.describe("GPU", found)
    assert described.startswith("GPU: no step marks (an evaluation: the whole trace), ")


def test_a_batch_copied_on_the_compute_stream_is_counted():
    events = [*launched(1, 0, "gpu_memcpy", 10, 10), *launched(2, 0, "kernel", 20, 50)]
    assert trace_gaps.summarise(events)["host_to_device_copies_on_compute_stream"] == 1


def test_a_cpu_trace_says_it_has_no_device_work(tmp_path, capsys):
    assert "error" in trace_gaps.summarise([on(HOST, "cpu_op", "aten::add", 0, 5)])
    folder = tmp_path / "tensorboard" / "profile-steps-2-4"
    folder.mkdir(parents=True)
    with gzip.open(folder / "host_1.2.pt.trace.json.gz", "wt") as handle:
        json.dump({"traceEvents": two_steps()}, handle)
    assert trace_gaps.main([str(tmp_path)]) == 0
    assert "2 steps, 1.5 ms of device work" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        trace_gaps.main([str(tmp_path / "tensorboard" / "nothing")])


def test_a_kernel_whose_launch_is_not_traced_still_counts_inside_the_window():
    events = two_steps()
    events.append(on(COMPUTE, "kernel", "cudnn engine", 1150, 100, correlation=77))  # in gap 1100-1300
    found = trace_gaps.summarise(events)
    assert found["window_ms"] == pytest.approx(1.5) and found["idle_ms"] == pytest.approx(0.64)
    # 1100-1150 has no launch to read; 1250-1300 waited on another stream, as in two_steps().
    assert found["idle_by_cause_ms"]["unknown"] == pytest.approx(0.05)
    assert found["idle_by_cause_ms"]["other stream"] == pytest.approx(0.05)


def test_a_gpu_capture_logs_the_split_with_the_trace_and_a_cpu_one_nothing(tmp_path):
    from tpustream.observe.profiler import gpu_idle_summary

    path = tmp_path / "host_1.2.pt.trace.json.gz"
    with gzip.open(path, "wt") as handle:
        json.dump({"traceEvents": two_steps()}, handle)
    assert gpu_idle_summary(str(path)).startswith("GPU: 2 steps, 1.5 ms of device work, compute stream idle")
    with gzip.open(path, "wt") as handle:
        json.dump({"traceEvents": [on(HOST, "cpu_op", "aten::add", 0, 5)]}, handle)
    assert gpu_idle_summary(str(path)) is None
    path.write_text("not a trace")
    assert gpu_idle_summary(str(path)) is None  # a warning, never an error
