"""Where a traced GPU stood idle, and why: python -m tpustream.observe.trace_gaps TRACE_OR_FOLDER [...]

Reads a torch.profiler trace of training steps (``debug.profile_steps`` on the
native runtime writes one: ``tensorboard/profile-steps-S-E/*.pt.trace.json.gz``;
``python -m bench.feed --trace-steps S,E`` makes one per row; the capture logs
this summary itself when it stops) and splits the
compute stream's idle time during those steps by what the kernel after each gap
was waiting for:

- ``input``: it was launched after the stream went idle, and the training
  thread was in an ``input wait`` (its wait for the next batch) during the gap:
  that part of the gap is the input's;
- ``host``: launched after the stream went idle, the rest of such a gap: the
  host was busy elsewhere (Python, launching, a synchronisation, the GIL held
  by another thread); the operator the launching thread was running when the
  gap began is tallied, to say where;
- ``copy``: launched before the gap, it waited for a copy on another stream
  that ended during the gap (the batch's copy to the device, which the compute
  stream waits for);
- ``other stream``: launched before the gap, waiting for anything else;
- ``unknown``: no launch event for it in the trace.

The window is the device work the traced steps launched: from the first to
the last device event whose launch lies inside the ``train step N`` marks.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
STEP_MARK = "train step "
INPUT_WAIT = "input wait"
CAUSES = ("input", "host", "copy", "other stream", "unknown")
# A copy that ends within this many microseconds of a gap's end released the kernel after it.
COPY_SLACK_US = 50.0


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return json.load(handle)["traceEvents"]


def find_traces(path: Path) -> list[Path]:
    """path itself, or every torch.profiler trace under the folder path."""
    if path.is_file():
        return [path]
    return sorted([*path.rglob("*.pt.trace.json.gz"), *path.rglob("*.pt.trace.json")])


def _end(event: dict) -> float:
    return event["ts"] + event.get("dur", 0.0)


def _complete(events: Iterable[dict], categories: Sequence[str]) -> list[dict]:
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in categories and "ts" in e]


def _overlap(start: float, end: float, intervals: Iterable[tuple[float, float]]) -> float:
    """Microseconds of [start, end] covered by the (sorted, disjoint) intervals."""
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in intervals)


def _merged(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _outermost_op(ops: list[dict], at: float) -> str:
    """The name of the outermost operator on a thread running at time `at` (ops sorted by start)."""
    covering = [op for op in ops if op["ts"] <= at < _end(op)]
    if not covering:
        return "(no operator: Python or idle)"
    return max(covering, key=lambda op: op.get("dur", 0.0))["name"]


class _Trace:
    """A trace's events, indexed: device work, launches by correlation, annotations, operators by thread."""

    def __init__(self, events: list[dict]):
        self.device = _complete(events, DEVICE_CATEGORIES)
        self.launches = {
            e["args"]["correlation"]: e
            for e in _complete(events, LAUNCH_CATEGORIES)
            if "correlation" in e.get("args", {})
        }
        annotations = _complete(events, ("user_annotation",))
        self.marks = sorted(
            (e for e in annotations if e["name"].startswith(STEP_MARK)), key=lambda e: e["ts"]
        )
        self.input_waits = _merged((e["ts"], _end(e)) for e in annotations if e["name"] == INPUT_WAIT)
        self.ops_by_thread: dict[Any, list[dict]] = defaultdict(list)
        for op in _complete(events, ("cpu_op",)):
            self.ops_by_thread[(op.get("pid"), op.get("tid"))].append(op)
        kernel_time: Counter = Counter()
        for e in self.device:
            if e["cat"] == "kernel":
                kernel_time[_stream(e)] += e.get("dur", 0.0)
        # The stream with the most kernel time: the training step's.
        self.compute = kernel_time.most_common(1)[0][0] if kernel_time else None

    def launch_of(self, event: dict) -> dict | None:
        return self.launches.get(event.get("args", {}).get("correlation"))

    def window(self) -> list[dict]:
        """The device events from the first to the last one the traced steps launched (all without marks).

        Events between them whose launch is not in the trace (a library that
        launches through an API the profiler does not record) are kept.
        """
        if not self.marks:
            return self.device
        start, end = self.marks[0]["ts"], _end(self.marks[-1])
        launched = [e for e in self.device if start <= self.launch_ts(e, default=-1.0) <= end]
        if not launched:
            return []
        first, last = min(e["ts"] for e in launched), max(_end(e) for e in launched)
        return [e for e in self.device if first <= e["ts"] and _end(e) <= last]

    def launch_ts(self, event: dict, default: float) -> float:
        launch = self.launch_of(event)
        return default if launch is None else launch["ts"]

    def attribute(
        self, stream: list[dict], copies_ended: list[float]
    ) -> tuple[dict[str, float], Counter, int]:
        """(microseconds of gaps by cause, host gaps' microseconds by the operator under way, gaps)."""
        causes = dict.fromkeys(CAUSES, 0.0)
        host_ops: Counter = Counter()
        gaps = 0
        for before, after in zip(stream, stream[1:], strict=False):
            gap_start, gap_end = _end(before), after["ts"]
            gap = gap_end - gap_start
            if gap <= 0:
                continue
            gaps += 1
            launch = self.launch_of(after)
            if launch is None:
                causes["unknown"] += gap
            elif launch["ts"] >= gap_start:  # the host queued it only after the stream ran dry
                waited = _overlap(gap_start, gap_end, self.input_waits)
                causes["input"] += waited
                causes["host"] += gap - waited
                if gap > waited:
                    thread = self.ops_by_thread[(launch.get("pid"), launch.get("tid"))]
                    host_ops[_outermost_op(thread, gap_start)] += gap - waited
            elif any(gap_start <= copied <= gap_end + COPY_SLACK_US for copied in copies_ended):
                causes["copy"] += gap
            else:
                causes["other stream"] += gap
        return causes, host_ops, gaps


def _stream(event: dict) -> tuple[Any, Any]:
    return event.get("pid"), event.get("tid")


def summarise(events: list[dict]) -> dict[str, Any]:
    """The traced steps' compute-stream idle time by cause; {"error": ...} if the trace has no device work."""
    trace = _Trace(events)
    if not trace.device:
        return {"error": "no device events (a CPU run, or the trace holds no GPU activity)"}
    device = trace.window()
    if not device:
        return {"error": "no device event was launched inside the traced steps' marks"}
    stream = sorted((e for e in device if _stream(e) == trace.compute), key=lambda e: e["ts"])
    copies_ended = [_end(e) for e in device if e["cat"] == "gpu_memcpy" and _stream(e) != trace.compute]
    causes, host_ops, gaps = trace.attribute(stream, copies_ended)
    start, end = min(e["ts"] for e in device), max(_end(e) for e in device)
    window = end - start
    idle = max(0.0, window - sum(b - a for a, b in _merged((e["ts"], _end(e)) for e in stream)))
    batch_copies = [e for e in stream if e["cat"] == "gpu_memcpy" and "HtoD" in e["name"]]
    return {
        "steps": len(trace.marks),
        "window_ms": window / 1000,
        "compute_stream": list(trace.compute) if trace.compute else None,
        "idle_ms": idle / 1000,
        "idle_fraction": idle / window if window else 0.0,
        "gaps": gaps,
        "idle_by_cause_ms": {cause: causes[cause] / 1000 for cause in CAUSES},
        "host_ops_ms": {name: us / 1000 for name, us in host_ops.most_common(5)},
        "host_to_device_copies_on_compute_stream": len(batch_copies),
    }


def describe(name: str, found: dict[str, Any]) -> str:
    if "error" in found:
        return f"{name}: {found['error']}"
    causes = ", ".join(
        f"{cause} {ms:.1f} ms ({ms / found['window_ms']:.1%})"
        for cause, ms in found["idle_by_cause_ms"].items()
        if ms > 0
    )
    idle = f"{found['idle_ms']:.1f} ms ({found['idle_fraction']:.1%})"
    steps = f"{found['steps']} steps" if found["steps"] else "no step marks (an evaluation: the whole trace)"
    lines = [
        f"{name}: {steps}, {found['window_ms']:.1f} ms of device work, "
        f"compute stream idle {idle} in {found['gaps']} gaps: {causes or 'none'}"
    ]
    if found["host_ops_ms"]:
        ops = ", ".join(f"{op} {ms:.1f} ms" for op, ms in found["host_ops_ms"].items())
        lines.append(f"  host gaps began during: {ops}")
    if copies := found["host_to_device_copies_on_compute_stream"]:
        lines.append(f"  {copies} host-to-device copies on the compute stream")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tpustream.observe.trace_gaps", description=__doc__.splitlines()[0]
    )
    parser.add_argument("paths", nargs="+", type=Path, help="trace files, or folders to search for them")
    parser.add_argument("--json", action="store_true", help="print the summaries as JSON")
    args = parser.parse_args(argv)
    traces = [trace for path in args.paths for trace in find_traces(path)]
    if not traces:
        parser.error(f"no torch.profiler trace (*.pt.trace.json[.gz]) in {', '.join(map(str, args.paths))}")
    found = {str(trace): summarise(load_events(trace)) for trace in traces}
    if args.json:
        print(json.dumps(found, indent=1))
    else:
        for name, summary in found.items():
            print(describe(name, summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
