"""The training loop across replicas, in this process: stop votes, partial sums, resume positions.

Replicas are threads of this process on the plain CPU device (tests/fake_runtime.py,
the fake_job fixture), so each test takes about a second where train.py
would take tens. Eager only: nothing here may run an XLA backward.
"""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
import torch.nn as nn

from tests.fake_runtime import FakeRuntime, FakeWorld, tiny_config
from tpustream.checkpoint import BEST, LAST, METRICS, checkpoint_url, load_checkpoint, read_metrics
from tpustream.preemption import Preempted
from tpustream.training import Trainer
from tpustream.training.replicas import restore_replica_part

# 96 training samples in batches of 4: 24 steps on 1 replica, 12 on 2, 8 on 3.
TRAIN_SAMPLES, VAL_SAMPLES = 96, 18
METRICS_KEYS = {
    "epoch",
    "wall_time",
    "train_loss",
    "train_samples",
    "replica_steps",
    "train_seconds",
    "global_rate",
    "train_filled",
    "lr",
    "input_wait_fraction",
    "input_wait_fraction_worst",
    "input_wait_seconds",
    "compile_seconds",
    "step_seconds",
    "checkpoint_stall_seconds",
    "checkpoint_write_seconds",
    "checkpoint_copy_seconds",
    "checkpoint_writer_wait_seconds",
    "val_accuracy",
    "val_correct",
    "val_samples",
    "val_top5",
    "val_top5_correct",
    "val_loss",
    "val_seconds",
    "val_filled",
    "compilations",
    "epoch_seconds",
    "process",
    "train_process",
}


class RecordingTrainer(Trainer):
    """Remembers each step's summed loss (what the epoch's loss_sum adds), by global step."""

    def __init__(self, *args, **kwargs):
        self.step_losses: dict[int, float] = {}
        super().__init__(*args, **kwargs)

    def step_fn(self, batch):
        loss = super().step_fn(batch)
        self.step_losses[self.global_step] = float(loss) * batch["label"].shape[0]
        return loss


def resume_from(run: str) -> tuple[dict, str]:
    url = checkpoint_url(run, LAST)
    return load_checkpoint(url), url


def assert_all_stopped(job, message: str) -> None:
    for rank, result in enumerate(job.results):
        assert isinstance(result, Preempted), f"replica {rank}: {result!r}"
        assert str(result) == message, f"replica {rank}"


def assert_same_weights(run: str, reference: str) -> None:
    got, want = load_checkpoint(checkpoint_url(run, LAST)), load_checkpoint(checkpoint_url(reference, LAST))
    assert got["global_step"] == want["global_step"]
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name  # bitwise
    for mine, theirs in zip(
        got["optimizer"]["state"].values(), want["optimizer"]["state"].values(), strict=True
    ):
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_one_replica_trains_evaluates_and_writes_the_run_folder(fake_job, tmp_path, caplog):
    run = str(tmp_path / "run")
    with caplog.at_level(logging.INFO, logger="tpustream"):
        (summary,) = fake_job(tiny_config(run)).results
    assert [m["epoch"] for m in summary["history"]] == [0, 1]
    records = read_metrics(run)
    assert records == json.loads(json.dumps(summary["history"]))
    assert set(records[0]) == METRICS_KEYS  # no setup_seconds: started_at was not given
    assert records[1]["train_samples"] == TRAIN_SAMPLES and records[1]["replica_steps"] == 24
    assert records[1]["val_samples"] == VAL_SAMPLES
    # tiny_model has 4 classes: top-5 is top-4, every sample.
    assert (records[1]["val_top5"], records[1]["val_top5_correct"]) == (1.0, VAL_SAMPLES)
    assert (tmp_path / "run" / METRICS).exists()
    last, best = load_checkpoint(checkpoint_url(run, LAST)), load_checkpoint(checkpoint_url(run, BEST))
    assert (last["position"], last["epoch"], last["global_step"]) == ({"epoch": 2, "step": 0}, 1, 48)
    assert best["epoch"] == summary["best_epoch"]
    text = caplog.text
    assert re.search(
        r"Training Device=cpu:0/1 Epoch=0 Step=0 Loss=\d+\.\d{5} Rate=[\d.]+ GlobalRate=[\d.]+", text
    )
    assert re.search(
        r"Epoch=1 train: loss=\d\.\d{4} samples=96 \(replica steps 24\) skipped=0 "
        r"GlobalRate=[\d.]+ time=[\d.]+s \(host wait \d+%, worst replica \d+%; "
        r"compile [\d.]+s, step [\d.]+s, checkpoints [\d.]+s \+ [\d.]+s writing\) "
        r"\| val: accuracy=[\d.]+% \(\d+/18\) top5=100\.00% loss=\d\.\d{4} skipped=0 "
        r"\| best=[\d.]+% \(epoch \d\)",
        text,
    )


def test_a_new_best_epoch_is_serialised_once_and_best_pt_is_a_copy_of_last_pt(
    fake_job, tmp_path, monkeypatch
):
    """An epoch that is a new best and last.pt costs one encode; best.pt is its copy."""
    from tpustream import checkpoint as checkpoint_module
    from tpustream import storage

    encoded, copied = [], []
    encode, copy = checkpoint_module.encode_checkpoint, storage.copy
    monkeypatch.setattr(checkpoint_module, "encode_checkpoint", lambda s: encoded.append(1) or encode(s))
    monkeypatch.setattr(storage, "copy", lambda source, url: copied.append(url) or copy(source, url))
    run = str(tmp_path / "run")
    (summary,) = fake_job(tiny_config(run, epochs=1)).results
    assert summary["best_epoch"] == 0  # the first evaluated epoch is always a new best
    assert len(encoded) == 1 and copied == [checkpoint_url(run, BEST)]
    assert storage.read_bytes(checkpoint_url(run, BEST)) == storage.read_bytes(checkpoint_url(run, LAST))


def test_replicas_split_the_epoch_and_reduce_its_metrics_exactly(fake_job, tmp_path):
    job = fake_job(tiny_config(str(tmp_path / "run"), epochs=1), world_size=3)
    # Every replica computed the same reduced numbers (times are each replica's own).
    local = {"wall_time", "train_seconds", "val_seconds", "epoch_seconds"}
    records = [{k: v for k, v in s["history"][0].items() if k not in local} for s in job.results]
    assert all(r == records[0] for r in records)
    record = records[0]
    assert (record["train_samples"], record["replica_steps"]) == (TRAIN_SAMPLES, 8)
    assert record["val_samples"] == VAL_SAMPLES
    assert len({tuple(runtime) for runtime in [t.runtime.collectives for t in job.trainers]}) == 1


@pytest.mark.parametrize("stop_check_every, stops_at", [(1, 3), (2, 4)])
def test_a_stop_request_on_one_replica_stops_every_replica_at_the_same_step(
    fake_job, tmp_path, stop_check_every, stops_at
):
    run = str(tmp_path / "run")
    cfg = tiny_config(run, **{"checkpoint.stop_check_every": stop_check_every})
    # Replica 2 alone is asked to stop as it takes batch 2 of epoch 0.
    job = fake_job(cfg, world_size=3, stop_at=(2, "train", 0, 2))
    assert_all_stopped(job, f"stopped at epoch 0, step {stops_at}")
    assert [job.world.stop_requested_by(rank) for rank in range(3)] == [False, False, True]
    state = load_checkpoint(checkpoint_url(run, LAST))
    assert state["position"] == {"epoch": 0, "step": stops_at} and state["global_step"] == stops_at
    assert {t.step for t in job.trainers} == {stops_at}


def test_a_mid_epoch_checkpoint_holds_every_replicas_sums_and_resuming_completes_the_same_epoch(
    fake_job, tmp_path
):
    straight = str(tmp_path / "straight")
    reference = fake_job(tiny_config(straight), world_size=2, trainer_class=RecordingTrainer)
    run = str(tmp_path / "run")
    stopped = fake_job(
        tiny_config(run), world_size=2, stop_at=(1, "train", 1, 3), trainer_class=RecordingTrainer
    )
    assert_all_stopped(stopped, "stopped at epoch 1, step 4")
    saved = load_checkpoint(checkpoint_url(run, LAST))
    assert saved["position"] == {"epoch": 1, "step": 4} and saved["global_step"] == 12 + 4
    # The partial sums are the epoch's so far over both replicas, not the master's alone.
    epoch_1 = range(12, 16)
    want = sum(t.step_losses[s] for t in stopped.trainers for s in epoch_1)
    assert saved["partial"]["count"] == 2 * 4 * 4
    assert saved["partial"]["loss_sum"] == pytest.approx(want, rel=1e-6)
    assert saved["partial"]["loss_sum"] != pytest.approx(sum(stopped.master.step_losses[s] for s in epoch_1))

    resumed = fake_job(tiny_config(run), world_size=2, resume_from=resume_from(run))
    assert all(isinstance(r, dict) for r in resumed.results), resumed.results
    got, want_records = read_metrics(run), reference.results[0]["history"]
    assert [r["epoch"] for r in got] == [0, 1]
    for mine, theirs in zip(got, want_records, strict=True):
        for key in (
            "train_samples",
            "replica_steps",
            "val_correct",
            "val_top5_correct",
            "val_samples",
            "train_filled",
        ):
            assert mine[key] == theirs[key], key
        assert mine["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-6)
        assert mine["val_loss"] == pytest.approx(theirs["val_loss"], rel=1e-6)
    assert_same_weights(run, straight)


def batch_norm_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Flatten(), nn.Linear(3 * 8 * 8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)
    )


def test_each_replica_resumes_its_own_batch_norm_statistics_mid_epoch(fake_job, tmp_path):
    # Each replica updates BatchNorm's running statistics from its own batches until the
    # epoch's end averages them: a mid-epoch checkpoint holds every replica's.
    straight, run = str(tmp_path / "straight"), str(tmp_path / "run")
    fake_job(tiny_config(straight), world_size=2, model=batch_norm_model)
    fake_job(tiny_config(run), world_size=2, stop_at=(1, "train", 1, 3), model=batch_norm_model)
    saved = load_checkpoint(checkpoint_url(run, LAST))
    own = [part["buffers"] for part in saved["replicas"]]
    assert len(own) == 2 and not torch.equal(own[0][0], own[1][0])  # running means differ mid-epoch
    resumed = fake_job(tiny_config(run), world_size=2, resume_from=resume_from(run), model=batch_norm_model)
    assert all(isinstance(r, dict) for r in resumed.results), resumed.results
    assert_same_weights(run, straight)  # buffers included: the state_dict holds them


def test_on_another_world_size_replicas_start_from_the_saved_statistics_average():
    model = batch_norm_model()
    parts = [
        {"rng": None, "buffers": [torch.full((16,), 1.0), torch.full((16,), 3.0)]},
        {"rng": None, "buffers": [torch.full((16,), 3.0), torch.full((16,), 6.0)]},
    ]
    restore_replica_part(parts, FakeRuntime(FakeWorld(1), 0), [model])
    assert torch.equal(model[2].running_mean, torch.full((16,), 2.0))
    assert torch.equal(model[2].running_var, torch.full((16,), 4.5))


def test_a_stop_while_evaluating_keeps_the_trained_epoch_and_resuming_only_evaluates(
    fake_job, tmp_path, caplog
):
    straight = str(tmp_path / "straight")
    fake_job(tiny_config(straight), world_size=2)
    run = str(tmp_path / "run")
    # The request comes with the epoch's last batch; the epoch's end looks for it while evaluating.
    stopped = fake_job(tiny_config(run), world_size=2, stop_at=(0, "train", 0, 11))
    assert_all_stopped(stopped, "stopped while evaluating epoch 0")
    saved = load_checkpoint(checkpoint_url(run, LAST))
    assert saved["position"] == {"epoch": 0, "step": 12} and saved["partial"] is None
    assert saved["pending_train_metrics"]["train_samples"] == TRAIN_SAMPLES and saved["history"] == []

    with caplog.at_level(logging.INFO, logger="tpustream"):
        fake_job(tiny_config(run), world_size=2, resume_from=resume_from(run))
    assert f"resumed from {checkpoint_url(run, LAST)} at epoch 0, step 12" in caplog.text
    assert read_metrics(run)[0]["train_loss"] == saved["pending_train_metrics"]["train_loss"]
    assert_same_weights(run, straight)


def test_resuming_under_another_data_plan_restarts_the_epoch(fake_job, tmp_path, caplog):
    run = str(tmp_path / "run")
    stopped = fake_job(tiny_config(run), world_size=2, stop_at=(0, "train", 1, 3))
    assert_all_stopped(stopped, "stopped at epoch 1, step 4")
    with caplog.at_level(logging.INFO, logger="tpustream"):
        resumed = fake_job(tiny_config(run), world_size=1, resume_from=resume_from(run))
    assert (
        "stopped at step 4 of epoch 1; this run's order differs (2 replica(s) -> 1 replica(s), 12 steps an "
        "epoch -> 24 steps an epoch), so epoch 1 restarts from its first batch and the samples of its "
        "first 4 step(s) are trained again"
    ) in caplog.text
    assert "at epoch 1, step 0" in caplog.text
    (summary,) = resumed.results
    assert [r["replica_steps"] for r in summary["history"]] == [12, 24]
    assert summary["history"][1]["train_samples"] == TRAIN_SAMPLES  # the partial sums were dropped
    assert load_checkpoint(checkpoint_url(run, LAST))["global_step"] == 12 + 24


def test_without_evaluation_the_epoch_end_looks_for_stop_requests(fake_job, tmp_path):
    run = str(tmp_path / "run")
    stopped = fake_job(tiny_config(run, eval_every=0), world_size=2, stop_at=(1, "train", 0, 11))
    assert_all_stopped(stopped, "stopped after epoch 0")
    saved = load_checkpoint(checkpoint_url(run, LAST))
    assert saved["position"] == {"epoch": 1, "step": 0} and len(saved["history"]) == 1
    assert "val_accuracy" not in saved["history"][0]


def test_saves_slower_than_steps_overlap_training_and_a_stop_ends_only_once_its_save_is_durable(
    fake_job, tmp_path, monkeypatch
):
    """checkpoint.asynchronous (the default) with every_n_steps; each write takes 0.3 s."""
    import time

    from tpustream import storage

    write = storage.write_bytes_verified
    monkeypatch.setattr(
        storage, "write_bytes_verified", lambda url, data: time.sleep(0.3) or write(url, data)
    )
    run = str(tmp_path / "run")
    job = fake_job(
        tiny_config(run, **{"checkpoint.every_n_steps": 2}), world_size=2, stop_at=(1, "train", 1, 5)
    )
    assert_all_stopped(job, "stopped at epoch 1, step 6")
    # The replicas returned (exit 75 in train.py) with the stop's last.pt written, not in flight.
    state = load_checkpoint(checkpoint_url(run, LAST))
    assert state["position"] == {"epoch": 1, "step": 6} and state["global_step"] == 12 + 6
    # metrics.jsonl is written after the epoch's checkpoints, naming no epoch they lack.
    (record,) = read_metrics(run)
    assert record["epoch"] == 0 and state["history"] == [record]
    # Epoch 0's window: five mid-epoch saves of 0.3 s; at least the first four had finished by
    # its end (a write counts once done; the epoch's end save is epoch 1's).
    assert record["checkpoint_write_seconds"] >= 4 * 0.3
