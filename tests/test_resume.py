"""Stop and resume on the XLA CPU device: the result equals a run that was never interrupted.

Every run is `python train.py` in its own process with 2 DataLoader workers
(the resumed epoch's batches must come from the right worker in the right
order). Weights are compared bitwise.
"""

from __future__ import annotations

import os
import random

import pytest

from tests.conftest import assert_same_run, run_train, sigterm_at_step, train_command
from tpustream.checkpoint import checkpoint_url, load_checkpoint
from tpustream.errors import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.slow
STEPS_PER_EPOCH = 23  # ceil(1438 / 64)


def common(root: str, out: str, hydra_dir: str) -> list[str]:
    return [
        f"data.root={root}",
        f"output_dir={out}",
        "epochs=4",
        "data.num_workers=2",
        # The replica in train.py's own process: the spawn path is test_e2e's;
        # here it would only add seconds per run.
        "accelerator.in_process=true",
        f"hydra.run.dir={hydra_dir}",
    ]


@pytest.fixture(scope="module")
def uninterrupted(digits_root, tmp_path_factory):
    """4 epochs straight: the reference every interrupted run must reproduce."""
    out = tmp_path_factory.mktemp("straight")
    result = run_train(*common(digits_root, str(out / "run"), str(out / "h")))
    assert result.returncode == 0, result.stderr[-3000:]
    return str(out / "run")


# A stop during evaluation (the epoch-boundary case) and a resume under another
# data plan are tested in process (tests/test_trainer_loop.py), and on XLA by
# test_preemption's SIGTERM right after an epoch's last step.
@pytest.mark.parametrize(
    "stop_at, position",
    [(2 * STEPS_PER_EPOCH + 11, (2, 11))],  # inside epoch 2
    ids=["mid-epoch"],
)
def test_stop_and_resume_equals_uninterrupted(digits_root, uninterrupted, tmp_path, stop_at, position):
    run = str(tmp_path / "run")
    stopped = run_train(*common(digits_root, run, str(tmp_path / "h1")), f"debug.stop_at_step={stop_at}")
    assert stopped.returncode == PREEMPTED_EXIT_CODE, stopped.stderr[-3000:]
    saved = load_checkpoint(checkpoint_url(run, "last.pt"))
    assert (saved["position"]["epoch"], saved["position"]["step"]) == position
    assert saved["global_step"] == stop_at

    resumed = run_train(*common(digits_root, run, str(tmp_path / "h2")))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        f"resumed from {checkpoint_url(run, 'last.pt')} at epoch {position[0]}, step {position[1]}"
        in resumed.stderr
    )
    assert_same_run(run, uninterrupted, steps=4 * STEPS_PER_EPOCH)


def test_sigterm_at_a_random_step_saves_and_resumes_to_the_same_result(digits_root, uninterrupted, tmp_path):
    run = str(tmp_path / "run")
    target = random.Random(os.getpid()).randrange(5, 3 * STEPS_PER_EPOCH)
    command = train_command(*common(digits_root, run, str(tmp_path / "h1")), "log_steps=1")
    code, stderr = sigterm_at_step(command, target, STEPS_PER_EPOCH)
    assert code == PREEMPTED_EXIT_CODE, stderr[-3000:]
    saved = load_checkpoint(checkpoint_url(run, "last.pt"))
    assert saved["global_step"] >= target

    resumed = run_train(*common(digits_root, run, str(tmp_path / "h2")))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(run, uninterrupted, steps=4 * STEPS_PER_EPOCH)
