"""One train.py run of the sweep in its own process: measured, its logs kept, never raising for a failure."""

from __future__ import annotations

import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.epoch_time.collect import DESERIALIZE_FAILURE, RunResult, summarize
from bench.epoch_time.plan import REPO, RunSpec

STDERR_TAIL_LINES = 25
STDOUT_TAIL_LINES = 10


def train_command(spec: RunSpec, folder: Path) -> list[str]:
    return [
        sys.executable,
        str(REPO / "train.py"),
        *spec.overrides,
        f"output_dir={folder}",
        "resume=null",
        f"hydra.run.dir={folder}",
    ]


def busy_cpu_seconds() -> float:
    """CPU seconds all programs on this machine have used (for the other-load column)."""
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - t.iowait - t.guest - t.guest_nice  # guest time is also in user


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def tail(path: Path, lines: int = STDERR_TAIL_LINES) -> str:
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def run_one(spec: RunSpec, folder: Path, timeout: float | None, keep_checkpoints: bool) -> RunResult:
    """Run train.py once in its own session; measure it; never raise for a failed run."""
    if folder.exists():
        shutil.rmtree(folder)  # a stale metrics.jsonl would pass for this run's
    folder.mkdir(parents=True)
    result = RunResult(spec, train_command(spec, folder), folder)
    (folder / "command.txt").write_text(shlex.join(result.command) + "\n")
    busy0, ours0 = busy_cpu_seconds(), children_cpu_seconds()
    with open(folder / "stdout.log", "wb") as out, open(folder / "stderr.log", "wb") as err:
        launched_at, start = time.time(), time.perf_counter()
        # Own session: a timeout or Ctrl-C stops train.py and its replicas and workers together.
        process = subprocess.Popen(result.command, stdout=out, stderr=err, cwd=REPO, start_new_session=True)
        try:
            result.returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        except BaseException:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise
        process_seconds = time.perf_counter() - start
    result.cpu_s = children_cpu_seconds() - ours0
    result.other_load = max(0.0, busy_cpu_seconds() - busy0 - result.cpu_s) / process_seconds
    stderr = folder / "stderr.log"
    result.stderr_tail = tail(stderr)
    result.stdout_tail = tail(folder / "stdout.log", STDOUT_TAIL_LINES)
    result.deserialize_failures = stderr.read_text(errors="replace").count(DESERIALIZE_FAILURE)
    from tpustream.training.epoch_report import read_epoch_records  # after the measurements: it imports torch

    records = read_epoch_records(str(folder))
    if result.returncode is None:
        result.error = f"timed out after {timeout:g} s"
    elif result.returncode != 0:
        result.error = f"exit code {result.returncode}"
    elif not records:
        result.error = "exit code 0 but no metrics.jsonl lines"
    if records:
        result.summary = summarize(records, process_seconds, launched_at)
    if not keep_checkpoints:
        shutil.rmtree(folder / "checkpoints", ignore_errors=True)
    return result
