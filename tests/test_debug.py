"""training.debug: traces of chosen steps (debug.profile_steps) with the runtime's profiler."""

from __future__ import annotations

import logging
import subprocess
import sys

import torch

from tests.conftest import REPO
from tests.fake_runtime import FakeRuntime, FakeWorld
from tpustream.config import DebugConfig
from tpustream.training.debug import DebugChecks


def steps(debug: DebugChecks, model: torch.nn.Module, first: int, last: int) -> None:
    for step in range(first, last + 1):
        model(torch.ones(1, 2)).sum().backward()
        debug.after_train_step(model, step)


def test_a_trace_window_the_run_ends_inside_is_written_with_the_steps_it_had(tmp_path, caplog):
    model = torch.nn.Linear(2, 2)
    debug = DebugChecks(DebugConfig(profile_steps=[2, 10]), FakeRuntime(FakeWorld(1), 0), str(tmp_path))
    with caplog.at_level(logging.INFO, logger="tpustream"):
        steps(debug, model, 1, 4)
        assert not list(tmp_path.rglob("*.pt.trace.json.gz"))  # still capturing
        debug.finish(4)
    (trace,) = (tmp_path / "tensorboard" / "profile-steps-2-10").glob("*.pt.trace.json.gz")
    assert "torch trace of global steps 3 to 4 (the run ended before step 10) in " in caplog.text
    debug.finish(4)  # nothing left to stop
    assert caplog.text.count("torch trace of") == 1


def test_a_window_the_run_passes_is_written_at_its_end_and_finish_changes_nothing(tmp_path, caplog):
    model = torch.nn.Linear(2, 2)
    debug = DebugChecks(DebugConfig(profile_steps=[1, 3]), FakeRuntime(FakeWorld(1), 0), str(tmp_path))
    with caplog.at_level(logging.INFO, logger="tpustream"):
        steps(debug, model, 1, 5)
        debug.finish(5)
    assert "torch trace of global steps 2 to 3 in " in caplog.text
    assert caplog.text.count("torch trace of") == 1


def test_a_process_that_exits_inside_the_window_exits(tmp_path):
    """A stop or an error inside debug.profile_steps: the capture is dropped, the process does not hang."""
    probe = (
        "import torch\n"
        "from tpustream.observe.profiler import TorchTraceCapture\n"
        f"capture = TorchTraceCapture({str(tmp_path)!r}, 'profile-steps-1-9', cuda=False)\n"
        "capture.start()\n"
        "capture.mark_step(2)\n"
        "torch.ones(3) + 1\n"
        "raise SystemExit(75)\n"
    )
    command = [sys.executable, "-c", probe]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 75, result.stderr[-2000:]
    assert not list(tmp_path.rglob("*.pt.trace.json.gz"))
