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
from tpustream.checkpoint import checkpoint_url, load_checkpoint, read_metrics
from tpustream.data import ShardLoader
from tpustream.errors import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.slow
# The last two digits training shards: 414 samples, 7 steps of 64 an epoch, the last one
# padded (and masked): a resume must get that right too.
TRAIN_SHARDS = "train/train-{000004..000005}.tar"
STEPS_PER_EPOCH = 7  # ceil(414 / 64)


def common(root: str, out: str, hydra_dir: str) -> list[str]:
    return [
        f"data.root={root}",
        f"data.train_shards='{root}/{TRAIN_SHARDS}'",  # Hydra needs the braces quoted
        f"output_dir={out}",
        "epochs=4",
        "data.num_workers=2",
        # LAMB: its step count is a device tensor the checkpoint must put back on
        # the device (LARS's state is momentum buffers as SGD's; both optimizers'
        # resumes in process are test_optimizers').
        "optim=lamb",
        "optim.warmup_epochs=0.5",
        "optim.clip_grad_norm=1.0",
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


def test_the_lamb_recipe_learns_and_compiles_in_epoch_0_only(uninterrupted):
    records = read_metrics(uninterrupted)
    assert records[-1]["train_loss"] < records[0]["train_loss"]
    assert len({r["compilations"] for r in records}) == 1  # all in epoch 0, none after


# A stop during evaluation (the epoch-boundary case) and a resume under another
# data plan are tested in process (tests/test_trainer_loop.py), and on XLA by
# test_preemption's SIGTERM right after an epoch's last step; debug.stop_at_step
# stops (as SIGTERM does) in test_training's, test_spmd's and test_native's resumes.
def test_sigterm_at_a_random_step_saves_and_resumes_to_the_same_result(digits_root, uninterrupted, tmp_path):
    run = str(tmp_path / "run")
    target = random.Random(os.getpid()).randrange(5, 3 * STEPS_PER_EPOCH)
    command = train_command(*common(digits_root, run, str(tmp_path / "h1")), "log_steps=1")
    code, stderr = sigterm_at_step(command, target, STEPS_PER_EPOCH)
    assert code == PREEMPTED_EXIT_CODE, stderr[-3000:]
    saved = load_checkpoint(checkpoint_url(run, "last.pt"))
    assert saved["global_step"] >= target
    epoch, step = saved["position"]["epoch"], saved["position"]["step"]
    assert epoch * STEPS_PER_EPOCH + step == saved["global_step"]
    # Its data plan is the training loader's state at that step: a loop of one's own
    # reading the same shards through tpustream.data.ShardLoader takes it.
    data = saved["data_plan"]
    assert (data["epoch"], data["step"], data["steps_per_epoch"]) == (epoch, step, STEPS_PER_EPOCH)
    reader = ShardLoader(
        f"{digits_root}/{TRAIN_SHARDS}", batch_size=data["global_batch"], num_workers=0, seed=data["seed"]
    )
    reader.load_state_dict(data)
    assert (reader.epoch, reader.step) == (epoch, step)

    resumed = run_train(*common(digits_root, run, str(tmp_path / "h2")))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoint_url(run, 'last.pt')} at epoch {epoch}, step {step}" in resumed.stderr
    assert_same_run(run, uninterrupted, steps=4 * STEPS_PER_EPOCH)
