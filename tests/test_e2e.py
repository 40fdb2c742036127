"""End to end on the XLA CPU device: shards in a bucket -> train.py -> checkpoints in the bucket -> resume.

Each run is a real `python train.py` in its own process (xmp.spawn, one replica).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import free_port, popen_train, run_train, train_command
from tpustream import storage
from tpustream.checkpoint import load_checkpoint, read_metrics
from tpustream.storage import gcs

pytestmark = pytest.mark.slow


def metrics(run: str) -> list[dict]:
    return read_metrics(run)


def test_train_from_bucket_checkpoint_in_bucket_and_resume(digits_bucket, tmp_path):
    run = f"{digits_bucket}/runs/e2e"
    common = [f"data.root={digits_bucket}/digits", f"output_dir={run}", "data.num_workers=2"]
    port = free_port()
    first = run_train(
        *common,
        "epochs=4",
        "debug.metrics=true",
        f"debug.profiler_port={port}",
        "debug.profile_steps=[25,28]",
        "debug.profile_eval_epoch=1",
        f"hydra.run.dir={tmp_path}/h1",
    )
    assert first.returncode == 0, first.stderr[-3000:]

    assert {"config.yaml", "metrics.jsonl"} <= set(storage.list_names(run))
    assert storage.list_names(f"{run}/checkpoints") == ["best.pt", "last.pt"]  # no temporary objects left
    best = load_checkpoint(f"{run}/checkpoints/best.pt")
    assert best["best_accuracy"] >= 0.6, best["history"]  # chance is 0.1
    assert best["config"]["data"]["root"] == f"{digits_bucket}/digits"
    history = metrics(run)
    assert [m["epoch"] for m in history] == [0, 1, 2, 3]
    # Exact epochs: every training sample once, every validation sample once.
    assert all(m["train_samples"] == 1438 and m["val_samples"] == 359 for m in history)
    assert all(m["replica_steps"] == 23 for m in history)  # ceil(1438 / 64)
    # Static shapes: one train-step graph and one eval graph (plus one for the
    # model's initial buffers), compiled in epoch 0 and never again.
    assert history[0]["compilations"] <= 3
    assert {m["compilations"] for m in history} == {history[0]["compilations"]}
    # Where the time goes: compiles in epoch 0 only; with 2 workers the loop is not starved
    # (measured about 7% after epoch 0, whose first batches wait for the workers to start).
    assert history[0]["compile_seconds"] > 0 and all(m["compile_seconds"] == 0 for m in history[1:])
    assert all(m["input_wait_fraction"] < 0.5 for m in history[1:])
    assert all(m["model_flops_per_sample"] == history[0]["model_flops_per_sample"] > 0 for m in history)

    log = first.stderr
    assert re.search(
        r"\[replica 0/1\] INFO tpustream\.[\w.]+: Training Device=xla:0/1 Epoch=0 Step=0 Loss=\d", log
    )
    assert "Rate=" in log and "GlobalRate=" in log
    assert "best validation accuracy" in first.stdout
    # debug.metrics: a summary per epoch, and no step compiled unexpectedly.
    summaries = re.findall(r"epoch \d: XLA: (\d+) compilations", log)
    assert summaries == [str(history[0]["compilations"])] * 4
    assert "XLA compiled" not in log
    assert f"XLA profiler listening on port {port}" in log  # port + local ordinal 0
    # TensorBoard, written locally and uploaded to the bucket each epoch.
    scalars = bucket_scalars(run, tmp_path / "tb1")
    assert [step for step, _ in scalars["epoch/val_accuracy"]] == [23, 46, 69, 92]
    assert [value for _, value in scalars["epoch/val_accuracy"]] == pytest.approx(
        [m["val_accuracy"] for m in history]
    )
    assert {"train/loss", "train/lr", "rate/global", "rate/replica_000", "xla/compilations"} <= set(scalars)
    assert {"time/input_wait_fraction", "time/compile_seconds", "time/step_seconds"} <= set(scalars)
    assert {"time/input_bound_fraction", "time/device_idle_fraction"} <= set(scalars)  # XLA measures them
    # debug.profile_*: XLA traces of steps 26-28 and of epoch 1's evaluation, copied into the bucket
    # where TensorBoard's profile plugin reads them.
    for name, steps in (("profile-steps-25-28", 3), ("profile-eval-epoch-1", 6)):
        traces = trace_objects(f"{run}/tensorboard/{name}/plugins/profile/")
        assert any(url.endswith(".xplane.pb") for url in traces), traces
        (events,) = [url for url in traces if url.endswith(".trace.json.gz")]
        recorded = json.loads(gzip.decompress(storage.read_bytes(events)))["traceEvents"]
        assert sum(e.get("name") == "StepMarker" for e in recorded) >= steps  # one per step at least

    # Continued for one more epoch, in train.py's own process (the spawn path ran above); the
    # cosine redrawn over 5 epochs (a changed horizon is the user's decision, never silent).
    more = ("epochs=5", "optim.on_epochs_change=stretch")
    second = run_train(*common, *more, "accelerator.in_process=true", f"hydra.run.dir={tmp_path}/h2")
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {run}/checkpoints/last.pt at epoch 4, step 0" in second.stderr
    history = metrics(run)
    assert [m["epoch"] for m in history] == [0, 1, 2, 3, 4]
    last = load_checkpoint(f"{run}/checkpoints/last.pt")
    assert last["epoch"] == 4 and last["global_step"] == 5 * 23
    assert load_checkpoint(f"{run}/checkpoints/best.pt")["best_accuracy"] >= best["best_accuracy"]
    # The resumed run's events continue the same curves.
    steps = [step for step, _ in bucket_scalars(run, tmp_path / "tb2")["epoch/val_accuracy"]]
    assert steps == [23, 46, 69, 92, 115]


def trace_objects(prefix: str) -> list[str]:
    """Every object under a gs:// prefix, at any depth (a trace's session folder has a timestamp)."""
    bucket, name = gcs.split_gcs_url(prefix)
    return [f"gs://{bucket}/{blob.name}" for blob in gcs.gcs_client().list_blobs(bucket, prefix=name)]


def bucket_scalars(run: str, local: Path) -> dict[str, list[tuple[int, float]]]:
    """The TensorBoard scalars under <run>/tensorboard in the bucket, as TensorBoard would read them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    names = storage.list_names(f"{run}/tensorboard")
    assert names, "no event files in the bucket"
    local.mkdir(parents=True)
    for name in names:
        (local / name).write_bytes(storage.read_bytes(f"{run}/tensorboard/{name}"))
    accumulator = EventAccumulator(str(local), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def test_a_shard_missing_from_the_bucket_fails_the_run_naming_it(digits_bucket, tmp_path):
    shard = f"{digits_bucket}/digits/train/train-000003.tar"
    bucket_name, object_name = gcs.split_gcs_url(shard)
    gcs.gcs_client().bucket(bucket_name).blob(object_name).delete()
    result = run_train(
        f"data.root={digits_bucket}/digits",
        f"output_dir={digits_bucket}/runs/broken",
        "epochs=1",
        "accelerator=cpu_eager",  # the data path's error, whichever runtime reads it
        "accelerator.in_process=true",  # a worker's error through the replica in train.py
        f"hydra.run.dir={tmp_path}/h",
    )
    assert result.returncode == 2
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and errors[0].endswith(f"{shard}: no such object (404)")
    assert "Traceback" not in output
    # The run stopped at the error instead of finishing a short epoch.
    assert not storage.exists(f"{digits_bucket}/runs/broken/checkpoints/last.pt")


def test_a_split_of_unreadable_shards_stops_the_run_naming_them(digits_root, tmp_path):
    """on_error=skip fills bad data's places, but training on fill is not training: past the limit, stop."""
    import shutil

    root = tmp_path / "digits"
    shutil.copytree(digits_root, root)
    for shard in sorted((root / "train").glob("*.tar")):
        shard.write_bytes(b"\0not a tar" * 100)
    run = str(tmp_path / "run")
    result = run_train(
        f"data.root={root}",
        f"output_dir={run}",
        "epochs=1",
        "data.num_workers=0",
        "accelerator=cpu_eager",
        "accelerator.in_process=true",
        f"hydra.run.dir={tmp_path}/h",
    )
    assert result.returncode == 2
    output = result.stdout + result.stderr
    assert re.search(
        r"train: 1438 of 1438 samples \(100.0%\) were bad or missing in epoch 0, over "
        rf"data.max_bad_fraction=0.01 \(first in {root}/train/train-00000\d.tar, ",
        output,
    ), output[-3000:]
    assert not os.path.exists(f"{run}/checkpoints/best.pt")


def test_replicas_do_not_outlive_a_killed_train_py(digits_root, tmp_path):
    command = train_command(
        f"data.root={digits_root}", f"output_dir={tmp_path}/run", "epochs=50", f"hydra.run.dir={tmp_path}/h"
    )
    process = popen_train(command, stderr=subprocess.PIPE)
    replica = None
    for line in process.stderr:
        if match := re.search(r"replica 0 of 1 on xla:0 \(pid (\d+)\)", line):
            replica = int(match.group(1))
        if "Epoch=0 Step=0 " in line:
            break  # the DataLoader workers are up
    assert replica is not None and replica != process.pid
    process.kill()  # SIGKILL: no handler, no cleanup in train.py
    process.wait()
    # Nor do its DataLoader workers, even those still starting when it died, nor the fork
    # server they are forked from (the replica's child; the workers are its children).
    workers = descendants(replica)
    assert len(workers) >= 3  # the fork server, and the train and validation loaders' persistent workers
    deadline = time.time() + 30
    while time.time() < deadline:
        alive = [pid for pid in [replica, *workers] if os.path.exists(f"/proc/{pid}") and not _zombie(pid)]
        if not alive:
            return
        time.sleep(0.2)
    pytest.fail(f"processes {alive} outlived train.py (replica {replica}, workers {workers})")


def descendants(pid: int) -> list[int]:
    children = [
        int(p)
        for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    ]
    return [grandchild for child in children for grandchild in (child, *descendants(child))]


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def test_data_from_memory_and_validation_off_change_the_cost_not_the_run(digits_root, tmp_path):
    """The epoch-time benchmark's switches (source: memory, validation: off) through train.py.

    That memory serves the batches streaming serves, bit for bit on any shape, workers and
    resume point, is test_pipeline's (in process); here train.py takes the switches.
    """
    run = str(tmp_path / "in_memory")
    result = run_train(
        f"data.root={digits_root}",
        f"output_dir={run}",
        "epochs=2",
        "eval_every=0",
        "data.num_workers=2",  # the split in shared memory, read by the workers
        "accelerator=cpu_eager",  # the data's source is the subject, not XLA
        "accelerator.in_process=true",  # the replica in train.py: seconds less per run
        "data.in_memory=true",
        f"hydra.run.dir={tmp_path}/h",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 epoch(s), no validation; checkpoints in" in result.stdout
    assert "train split in memory: 1438 of 1438 listed samples" in result.stderr
    assert storage.exists(f"{run}/checkpoints/last.pt")
    assert not storage.exists(f"{run}/checkpoints/best.pt")  # nothing was evaluated
    history = metrics(run)
    assert [m["epoch"] for m in history] == [0, 1] and not any("val_accuracy" in m for m in history)
    assert all(m["train_samples"] == 1438 for m in history)  # every sample, from memory
    assert "setup_seconds" in history[0] and all(m["epoch_seconds"] == m["train_seconds"] for m in history)
