"""strategy=spmd / spmd_fsdp on four real XLA CPU devices in one process (GSPMD), against ddp on one.

Each run is `python train.py` in its own process with
``accelerator.num_devices=4``: one process drives the 4-device mesh, the
batch is sharded along it, and XLA's partitioner inserts the collectives
(across processes, XLA:CPU's collectives deadlock; inside one, GSPMD's work).
A per-device batch of 8 on 4 devices is a global batch of 32: the same
samples in the same order as ddp on one device with batch 32, so the weights
after 5 steps must agree to float rounding; small_cnn has BatchNorm, whose
statistics GSPMD computes over the whole global batch, as one device does.

The runs compile at the launcher's -O1 (XLA:CPU's -O3 costs 15 s more of CPU
a run here). Two programs round apart, and training amplifies it: measured on
the digits at -O1, spmd and ddp differ by 6e-8 after 5 steps and 5e-7 after
10; spmd_fsdp and ddp by 8.7e-6 after 5 and 2.6e-3 after 10 (at the peak
learning rate; 1.9e-7 at -O3, where both happened to round alike). So the
programs are compared at step 5.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import assert_same_run, run_train, xla_cpu_env
from tpustream.checkpoint import checkpoint_url, load_checkpoint, read_metrics
from tpustream.errors import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.slow

TRAIN_SAMPLES = 512  # two of the digits train shards
STEPS_PER_EPOCH = TRAIN_SAMPLES // 32


def common(root: str, out: str, hydra_dir: str, *extra: str) -> list[str]:
    """The runs' shared overrides; log_steps=1 unless extra sets it."""
    logging = [] if any(o.startswith("log_steps=") for o in extra) else ["log_steps=1"]
    return [
        f"data.root={root}",
        f"data.train_shards='{root}/train/train-{{000000..000001}}.tar'",
        f"output_dir={out}",
        "data.num_workers=0",
        *logging,
        "epochs=2",  # in every run: the learning-rate schedule spans them
        f"hydra.run.dir={hydra_dir}",
        *extra,
    ]


def spmd(strategy: str) -> list[str]:
    return [f"strategy={strategy}", "accelerator.num_devices=4", "batch_size=8"]


STOP = 5  # the step the stopped runs end at, mid-epoch 0
STOPPED_AT = (f"debug.stop_at_step={STOP}",)
STOPPED = PREEMPTED_EXIT_CODE


def train(tmp_path_factory, name: str, root: str, *overrides: str, code: int = 0) -> str:
    folder = tmp_path_factory.mktemp(name)
    run = str(folder / "run")
    samples = f"debug.sample_log_dir={folder}/samples"  # beside run/: each pass's sample ids
    result = run_train(
        *common(root, run, str(folder / "h"), "accelerator.in_process=true", samples, *overrides)
    )
    assert result.returncode == code, result.stderr[-3000:]
    return run


def last(run: str) -> dict:
    return load_checkpoint(checkpoint_url(run, "last.pt"))


@pytest.fixture(scope="module")
def ddp_stopped(digits_root, tmp_path_factory) -> str:
    """ddp on one device, batch 32, stopped after STOP steps: the reference trajectory."""
    return train(tmp_path_factory, "ddp", digits_root, "batch_size=32", *STOPPED_AT, code=STOPPED)


@pytest.fixture(scope="module")
def spmd_stopped(digits_root, tmp_path_factory) -> str:
    return train(tmp_path_factory, "spmd-stopped", digits_root, *spmd("spmd"), *STOPPED_AT, code=STOPPED)


# spmd_fsdp with all the rest: micro-batches, bf16, a weight average (sharded as the
# parameters and evaluated by the same graph) and augmentation on the device (pairs within
# each device's share of the global batch, pixel noise hashed per sample on the sharded
# batch). With the default log_steps and saves mid-epoch: a save that no logged loss had
# just waited for read shards still being computed and crashed; log_steps=1 hid it.
FSDP_RECIPE = (
    *spmd("spmd_fsdp"),
    "fsdp_wrap_min_params=1000",
    "micro_batches=2",
    "precision=bf16",
    "log_steps=20",
    "checkpoint.every_n_steps=5",
    "ema.decay=0.8",  # close behind the weights: about 5 updates (0.99 lagged 10 at step 32)
    "ema.warmup=true",
    "augment.mixup_alpha=0.2",
    "augment.mix_mode=pair",
    "augment.erase_prob=0.25",
    "augment.erase_mode=pixel",
)


@pytest.fixture(scope="module")
def fsdp_straight(digits_root, tmp_path_factory) -> str:
    """FSDP_RECIPE for 2 epochs straight: the reference of its stopped run's resume, and the
    uninterrupted sample order of every run here (a function of the data and the global batch
    of 32 only, whatever the strategy, devices and options)."""
    return train(tmp_path_factory, "fsdp2", digits_root, *FSDP_RECIPE)


@pytest.fixture(scope="module")
def spmd_resumed_on_2(digits_root, tmp_path_factory, spmd_stopped) -> tuple[str, str]:
    """The spmd run stopped at step 5 on 4 devices x 8, continued to its end on 2 devices x 16
    (the same global batch) in a copy of its folder; returns (run folder, stderr)."""
    folder = tmp_path_factory.mktemp("spmd-resumed")
    run = str(folder / "run")
    shutil.copytree(spmd_stopped, run)
    two_devices = ("strategy=spmd", "accelerator.num_devices=2", "batch_size=16")
    samples = f"debug.sample_log_dir={folder}/samples"
    options = ("accelerator.in_process=true", samples, *two_devices)
    resumed = run_train(*common(digits_root, run, str(folder / "h"), *options))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return run, resumed.stderr


# Float rounding after 5 steps of two programs: up to 8.7e-6 measured (see above).
WEIGHT_TOLERANCE = 5e-5


def assert_close_weights(got: dict, want: dict, tolerance: float) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        if tensor.is_floating_point():
            difference = (got[name] - tensor).abs().max().item()
            assert difference <= tolerance, f"{name} differs by {difference}"
        else:
            assert torch.equal(got[name], tensor), name  # BatchNorm's num_batches_tracked


def test_spmd_on_4_devices_matches_one_device_with_the_global_batch(ddp_stopped, spmd_stopped):
    got, want = last(spmd_stopped), last(ddp_stopped)
    assert got["global_step"] == want["global_step"] == STOP
    assert got["strategy"] == "spmd"
    # BatchNorm included: its running statistics are compared like the weights.
    assert any("running_mean" in name for name in want["model"])
    assert_close_weights(got["model"], want["model"], WEIGHT_TOLERANCE)


def test_spmd_fsdp_follows_the_ddp_trajectory(digits_root, tmp_path_factory, ddp_stopped):
    run = train(
        tmp_path_factory,
        "fsdp-stopped",
        digits_root,
        *spmd("spmd_fsdp"),
        "fsdp_wrap_min_params=1000",
        *STOPPED_AT,
        code=PREEMPTED_EXIT_CODE,
    )
    got, want = last(run), last(ddp_stopped)
    # The plain model's keys (no wrapper names): best.pt loads into ddp as it is.
    assert_close_weights(got["model"], want["model"], WEIGHT_TOLERANCE)
    # The optimizer state in the plain layout, whole, as ddp's.
    assert [s["momentum_buffer"].shape for s in got["optimizer"]["state"].values()] == [
        s["momentum_buffer"].shape for s in want["optimizer"]["state"].values()
    ]


def sample_log(run: str, epoch: int, part: str = "") -> np.ndarray:
    """A pass's sample ids (debug.sample_log_dir beside the run folder); part: -fromSTEP, -toSTEP."""
    return np.load(Path(run).parent / "samples" / f"train-epoch{epoch:03d}-replica000{part}.npy")


def test_spmd_evaluates_exactly_compiles_once_and_resumes_on_2_devices(
    spmd_stopped, spmd_resumed_on_2, fsdp_straight
):
    # The run stopped at step 5 (mid-epoch 0) on 4 devices x 8 continues on 2 devices x 16
    # (the same global batch): at step 5, on the uninterrupted run's samples, step by step.
    # (The same shape resumes bit for bit: test_spmd_fsdp_sigterm_saves_and_resumes_bitwise.)
    stopped = last(spmd_stopped)
    assert (stopped["position"]["epoch"], stopped["position"]["step"]) == (0, STOP)
    run, stderr = spmd_resumed_on_2
    # (A host's batch is 32 either way: its data plan is the same.)
    assert f"at epoch 0, step {STOP}" in stderr and "restarts" not in stderr
    assert last(run)["global_step"] == 2 * STEPS_PER_EPOCH
    epoch0 = np.concatenate(
        [sample_log(spmd_stopped, 0, f"-to{STOP:05d}"), sample_log(run, 0, f"-from{STOP:05d}")]
    )
    assert np.array_equal(epoch0, sample_log(fsdp_straight, 0))
    assert np.array_equal(sample_log(run, 1), sample_log(fsdp_straight, 1))

    records = read_metrics(run)
    assert [r["val_samples"] for r in records] == [359, 359]  # 12 steps of 32, 25 padded and masked
    assert [r["train_samples"] for r in records] == [TRAIN_SAMPLES] * 2
    # One train graph and one eval graph: nothing compiles after the first epoch.
    assert records[0]["compilations"] == records[1]["compilations"]


def test_spmd_fsdp_stopped_in_epoch_1_saves_and_resumes_bitwise(digits_root, tmp_path_factory, fsdp_straight):
    """FSDP_RECIPE stopped 3 steps into epoch 1 (after an epoch's end, between periodic saves), then
    resumed: bit for bit the straight run, weight average included. (debug.stop_at_step is the stop
    a SIGTERM requests; the signal's way to it, into replica processes, is test_preemption's.)"""
    straight = fsdp_straight
    records = read_metrics(straight)
    assert records[0]["compilations"] == records[1]["compilations"]
    # A warmed-up average lags the weights: 32% vs 43% measured (chance is 10%).
    assert records[1]["ema_val_accuracy"] > 0.2
    assert [r["val_samples"] for r in records] == [359, 359]
    assert records[1]["val_accuracy"] > 0.3  # chance is 10%; mixup and erasing slow 2 epochs down

    stop = STEPS_PER_EPOCH + 3
    stopped_at = f"debug.stop_at_step={stop}"
    run = train(tmp_path_factory, "fsdp-stopped", digits_root, *FSDP_RECIPE, stopped_at, code=STOPPED)
    saved = last(run)
    assert saved["strategy"] == "spmd_fsdp" and saved["global_step"] == stop
    assert (saved["position"]["epoch"], saved["position"]["step"]) == (1, 3)

    resumed = run_train(*common(digits_root, run, f"{run}-h2", "accelerator.in_process=true", *FSDP_RECIPE))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(run, straight, steps=2 * STEPS_PER_EPOCH)


SHARDING_PROBE = r"""
import json, sys
import torch
import torch_xla
from tpustream.runtime import SpmdRuntime
from tpustream.config import MeshConfig, Strategy
from tpustream.training.sharding_rules import BUILTIN_RULES
from tpustream.training.spmd import shard_model, device_bytes
from tpustream.models import create_model

runtime = SpmdRuntime(MeshConfig(), Strategy.spmd_fsdp)
torch.manual_seed(0)
model = create_model("wrn_seed", num_classes=10, image_size=32, channels=3)
total = sum(p.numel() * p.element_size() for p in model.parameters())
wrapped, _ = shard_model(model.to(runtime.device), runtime, int(sys.argv[1]), BUILTIN_RULES)
specs = {name: torch_xla._XLAC._get_xla_sharding_spec(p) for name, p in wrapped.named_parameters()}
print(json.dumps({"total": total, "per_device": device_bytes(list(wrapped.parameters())), "specs": specs}))
"""


def test_spmd_fsdp_shards_wrn_seed_four_ways():
    """The full-size wrn_seed (103M parameters): each device holds a quarter of the weights."""
    env = xla_cpu_env(devices=4)
    command = [sys.executable, "-c", SHARDING_PROBE, "1000000"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    assert probe["total"] > 100_000_000 * 4  # float32 bytes of 103M parameters
    for name, spec in probe["specs"].items():
        # Every parameter, wrapped units' and the root's leftovers: split 4 ways along one dimension.
        assert re.fullmatch(r"\{devices=\[(1,)*4(,1)*\]0,1,2,3\}", spec), (name, spec)
    assert probe["per_device"] == pytest.approx(probe["total"] / 4, rel=0.001)


def test_checkpoints_cross_between_ddp_and_spmd(
    digits_root, tmp_path_factory, ddp_stopped, spmd_resumed_on_2, fsdp_straight
):
    in_process = "accelerator.in_process=true"
    # best.pt of an spmd run, evaluated by ddp on one device: the accuracy the spmd run recorded.
    spmd_run, spmd_log = spmd_resumed_on_2
    folder = tmp_path_factory.mktemp("cross")
    best = checkpoint_url(spmd_run, "best.pt")
    evaluated = run_train(
        *common(digits_root, str(folder / "eval"), str(folder / "h1"), in_process),
        "batch_size=32",
        "eval_only=true",
        f"resume={best}",
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    record = next(r for r in read_metrics(spmd_run) if r["epoch"] == load_checkpoint(best)["epoch"])
    assert f"({record['val_correct']}/359)" in evaluated.stderr

    # ddp's last.pt, 5 steps into epoch 0, continues on the 4-device mesh: the same global
    # batch of 32 (batch_size 32 -> 8 is the same run), so the same sample order; the
    # optimizer state carries over.
    run = str(folder / "run")
    shutil.copytree(ddp_stopped, run)
    options = (in_process, *spmd("spmd"), f"debug.sample_log_dir={folder}/samples")
    resumed = run_train(*common(digits_root, run, str(folder / "h2"), *options))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at epoch 0, step {STOP}" in resumed.stderr and "starts fresh" not in resumed.stderr
    assert last(run)["global_step"] == 2 * STEPS_PER_EPOCH
    # The uninterrupted run's samples, step by step, and the next steps' losses of the spmd
    # run resumed at the same step (its state at step 5 is ddp's to float rounding). (Such
    # trajectories agree to float rounding for a few steps; from step 12 or 13, at the peak
    # learning rate, rounding differences grow by orders of magnitude per step, in any two
    # runs that differ in reduction order.)
    epoch0 = np.concatenate(
        [sample_log(ddp_stopped, 0, f"-to{STOP:05d}"), sample_log(run, 0, f"-from{STOP:05d}")]
    )
    assert np.array_equal(epoch0, sample_log(fsdp_straight, 0))
    theirs = step_losses(spmd_log)
    mine = step_losses(resumed.stderr)
    for step in (STOP, STOP + 1):
        assert mine[0, step] == pytest.approx(theirs[0, step], abs=1e-4), step


def step_losses(log: str) -> dict[tuple[int, int], float]:
    pattern = r"Epoch=(\d+) Step=(\d+) Loss=([0-9.]+)"
    return {(int(e), int(s)): float(loss) for e, s, loss in re.findall(pattern, log)}
