"""Stop signals: a process passes them on to the processes it started, until they are gone."""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import subprocess
import time

import pytest

from tests.conftest import REPO, train_command
from tpustream import preemption
from tpustream.checkpoint import checkpoint_url, load_checkpoint
from tpustream.errors import PREEMPTED_EXIT_CODE


@pytest.fixture(autouse=True)
def forwarder_gone():
    """The forwarder thread must be gone before the next test starts children it would signal."""
    yield
    if preemption._forwarder is not None:
        preemption._forwarder.join(timeout=10)
        assert not preemption._forwarder.is_alive()


def test_a_stop_signal_is_passed_on_to_the_processes_this_one_started(monkeypatch):
    context = multiprocessing.get_context("spawn")
    child = context.Process(target=time.sleep, args=(60,))
    child.start()
    try:
        monkeypatch.setattr(preemption, "_requested", type(preemption._requested)())
        preemption._on_signal(signal.SIGINT, None)  # as the handler runs on Ctrl-C
        child.join(timeout=10)
        assert preemption.stop_requested() and child.exitcode == -signal.SIGTERM
    finally:
        if child.is_alive():
            child.kill()


def test_a_child_that_missed_the_first_signal_gets_it_again(monkeypatch):
    # A child that ignores the first SIGTERM (as one still starting up may miss it)
    # and then listens: the forwarder's next round reaches it.
    context = multiprocessing.get_context("spawn")
    deaf = context.Event()
    child = context.Process(target=_deaf_for_a_while, args=(deaf,))
    child.start()
    try:
        assert deaf.wait(timeout=30)
        monkeypatch.setattr(preemption, "FORWARD_AGAIN_SECONDS", 0.2)
        preemption.forward_stop_to_children()
        time.sleep(0.1)
        assert child.is_alive()  # the first SIGTERM was ignored
        child.join(timeout=20)
        assert child.exitcode == -signal.SIGTERM
    finally:
        if child.is_alive():
            child.kill()


def _deaf_for_a_while(deaf) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    deaf.set()
    time.sleep(1.0)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(60)


def start_train(digits_root: str, tmp_path, *overrides: str) -> subprocess.Popen:
    command = train_command(
        f"data.root={digits_root}",
        f"output_dir={tmp_path}/run",
        f"hydra.run.dir={tmp_path}/h",
        "log_steps=1",
        *overrides,
    )
    # A session of its own, so that the test can signal its process group as a terminal would.
    return subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def wait_for(process: subprocess.Popen, pattern: str, lines: list[str]) -> None:
    deadline = time.time() + 300
    for line in process.stderr:
        lines.append(line)
        if re.search(pattern, line):
            return
        assert time.time() < deadline, f"no line matching {pattern!r}"
    pytest.fail(f"train.py ended before {pattern!r}:\n{''.join(lines[-30:])}")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "target", "when", "saved_steps"),
    [
        # docker stop / Kubernetes: SIGTERM to the container's first process only.
        (signal.SIGTERM, "pid", r"Epoch=0 Step=3 Loss", 4),
        # Ctrl-C: SIGINT to the whole foreground group, while DataLoader workers start.
        (signal.SIGINT, "group", r"replica 0 of 1 on xla:0", 0),
        # A preempted VM: SIGTERM to the group right after the epoch's last training
        # step (digits: 23 steps of 64), as validation begins; the epoch's training is kept.
        (signal.SIGTERM, "group", r"Epoch=0 Step=22 Loss", 23),
    ],
    ids=[
        "sigterm-to-train.py-alone",
        "ctrl-c-while-workers-start",
        "sigterm-right-after-an-epochs-last-step",
    ],
)
def test_a_stop_signal_saves_last_pt_and_exits_75(digits_root, tmp_path, signum, target, when, saved_steps):
    process = start_train(digits_root, tmp_path, "epochs=2")
    lines: list[str] = []
    try:
        wait_for(process, when, lines)
        if target == "pid":
            os.kill(process.pid, signum)
        else:
            os.killpg(process.pid, signum)
        lines.extend(process.stderr)
        assert process.wait(timeout=300) == PREEMPTED_EXIT_CODE, "".join(lines[-40:])
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    text = "".join(lines) + process.stdout.read()  # Hydra logs train.py's own lines to stdout
    assert "Traceback" not in text, text[-3000:]
    saved = load_checkpoint(checkpoint_url(f"{tmp_path}/run", "last.pt"))
    assert saved["global_step"] >= saved_steps
    assert "run the same command to continue" in text
