"""A simulated pod: 4 replica processes over gloo, streaming from the GCS emulator.

accelerator=cpu_pod: each replica is its own process with its own XLA CPU
device; the trainer, data splitting, metric reduction and checkpointing are
the code a TPU pod runs. Where XLA is not what a test is about (a failing
replica, a stop signal), the replicas run eager PyTorch (accelerator=cpu_eager)
behind the same launcher and trainer, several times faster on 2 cores.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import popen_train, run_train, train_command
from tpustream.checkpoint import load_checkpoint, read_metrics
from tpustream.data.read.layout import order_shards, plan_layout, stream_spans
from tpustream.data.read.partition import choose_partition
from tpustream.data.read.stages import SHARD_ID_SHIFT
from tpustream.data.resolve.split import load_manifest
from tpustream.errors import PREEMPTED_EXIT_CODE
from tpustream.storage import gcs

pytestmark = pytest.mark.slow
REPLICAS = 4
# Half of the digits training split (768 samples), to keep 4 replicas on 2 cores quick.
TRAIN_SUBSET = "train/train-{000000..000002}.tar"


def test_four_replicas_see_every_sample_once_stay_identical_and_evaluate_exactly(digits_bucket, tmp_path):
    run = f"{digits_bucket}/runs/pod"
    samples = tmp_path / "samples"
    result = run_train(
        "accelerator=cpu_pod",
        f"accelerator.num_devices={REPLICAS}",
        f"data.root={digits_bucket}/digits",
        f"data.train_shards='{digits_bucket}/digits/{TRAIN_SUBSET}'",  # Hydra needs braces quoted
        f"output_dir={run}",
        # Readers in the replicas' processes: 4 replicas share 2 cores, and a worker and its
        # fork server per replica would be 8 more processes importing torch. (Workers in a pod:
        # the SIGTERM test below.)
        "data.num_workers=0",
        "batch_size=16",
        "epochs=2",
        "debug.check_sync_every=1",  # bit-identical parameters after every step, buffers every epoch
        f"debug.sample_log_dir={samples}",
        f"hydra.run.dir={tmp_path}/h",
    )
    assert result.returncode == 0, result.stderr[-4000:]

    # Every training sample exactly once per epoch across the replicas.
    manifest = load_manifest(f"{digits_bucket}/digits/{TRAIN_SUBSET}")
    expected = {
        (i << SHARD_ID_SHIFT) | j for i, shard in enumerate(manifest.shards) for j in range(shard.samples)
    }
    for epoch in (0, 1):
        per_replica = [
            np.load(samples / f"train-epoch{epoch:03d}-replica{r:03d}.npy") for r in range(REPLICAS)
        ]
        seen = Counter(int(i) for ids in per_replica for i in ids)
        assert set(seen) == expected and set(seen.values()) == {1}
    # Every replica ran the same number of steps: 768 / (16 x 4).
    history = read_metrics(run)
    assert [m["replica_steps"] for m in history] == [12, 12]
    assert all(m["train_samples"] == 768 and m["val_samples"] == 359 for m in history)

    # Only rank 0 wrote checkpoints; every replica logged as itself.
    saved = re.findall(r"\[replica (\d+)/4\] INFO tpustream.checkpoint: saved", result.stderr)
    assert saved and set(saved) == {"0"}
    for r in range(REPLICAS):  # each replica's own log file holds its own lines only
        lines = (tmp_path / "h" / f"replica-{r}.log").read_text().splitlines()
        assert lines and all(f"[replica {r}/4" in line for line in lines if line[:4].isdigit())
        assert any(f"replica {r} of 4 on xla:0" in line for line in lines)

    # The pod's reduced accuracy is the accuracy of the checkpoint it saved,
    # evaluated again by one replica.
    best = load_checkpoint(f"{run}/checkpoints/best.pt")
    pod = next(m for m in history if m["epoch"] == best["epoch"])
    single = run_train(
        f"data.root={digits_bucket}/digits",
        f"output_dir={tmp_path}/eval",
        f"resume={run}/checkpoints/best.pt",
        "eval_only=true",
        "accelerator.in_process=true",  # one replica: no process of its own needed
        f"hydra.run.dir={tmp_path}/h2",
    )
    assert single.returncode == 0, single.stderr[-3000:]
    match = re.search(
        r"evaluation of the checkpoint from epoch (\d+): accuracy=[\d.]+% \((\d+)/(\d+)\)", single.stderr
    )
    assert match and int(match.group(1)) == best["epoch"]
    assert (int(match.group(2)), int(match.group(3))) == (pod["val_correct"], 359)


def test_a_failing_replica_stops_the_whole_pod(digits_bucket, tmp_path):
    # Remove a shard that exactly one replica reads in epoch 0 (seed 0, batch 64, no workers).
    # Two replicas: the other waits in a collective for it, as the rest of a bigger pod would.
    replicas = 2
    manifest = load_manifest(f"{digits_bucket}/digits/train")
    layout = plan_layout(manifest.num_samples, 64, replicas)
    order = order_shards(manifest.shards, seed=0, epoch=0, shuffle=True)
    partition = choose_partition("auto", replicas, 64, 0, len(manifest.shards), 0)
    assert partition is not None

    def urls(rank: int) -> set[str]:
        streams = partition.streams_of(rank, replicas, 0, 0)
        return {span.url for c in streams for span in stream_spans(order, layout, partition, c)}

    readers = {shard.url: [r for r in range(replicas) if shard.url in urls(r)] for shard in manifest.shards}
    shard, (reader,) = next((url, rs) for url, rs in readers.items() if len(rs) == 1)
    bucket, name = gcs.split_gcs_url(shard)
    gcs.gcs_client().bucket(bucket).blob(name).delete()
    result = run_train(
        "accelerator=cpu_eager",  # the launcher's code whichever runtime the replicas use
        f"accelerator.num_devices={replicas}",
        f"data.root={digits_bucket}/digits",
        f"output_dir={digits_bucket}/runs/broken",
        "data.num_workers=0",
        "data.shuffle_buffer=0",
        "epochs=1",
        f"hydra.run.dir={tmp_path}/h",
        timeout=300,  # the others wait in an all-reduce: they must be stopped, not hang
    )
    assert result.returncode == 2
    output = result.stdout + result.stderr
    assert f"{shard}: no such object (404)" in output
    errors = [line for line in result.stdout.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and f"replica {reader}: {shard}" in errors[0]
    # The other replica, left alone in the all-reduce, says so in a line: no traceback of a bug.
    assert f"replica {1 - reader} stopped: another replica left the collective" in result.stderr
    assert "Traceback" not in output


def sample_log_steps(folder: Path, pass_name: str, replicas: int, batch: int) -> np.ndarray:
    """A pass's global batches, (steps, replicas x batch) sample ids, from its replicas' sample logs."""
    parts = [np.load(folder / f"train-epoch000-replica{rank:03d}{pass_name}.npy") for rank in range(replicas)]
    return np.concatenate([part.reshape(-1, batch) for part in parts], axis=1)


def test_sigterm_to_one_replica_stops_the_pod_and_it_resumes_on_another_shape(digits_bucket, tmp_path):
    # Replica processes over gloo without XLA (accelerator=cpu_eager): the launcher, stop votes,
    # checkpoints and resume are the XLA pod's code, at eager speed. A slow input stage (30 ms a
    # sample) keeps the 12 steps from ending before the signal lands; the resumed run reads at
    # full speed. (A starved run's measure and advice: tests/test_observe_idle.py, test_observe_time.py.)
    run = f"{digits_bucket}/runs/preempted"
    samples = tmp_path / "samples"
    common = [
        "accelerator=cpu_eager",
        f"data.root={digits_bucket}/digits",
        f"data.train_shards='{digits_bucket}/digits/{TRAIN_SUBSET}'",  # Hydra needs braces quoted
        "epochs=1",
        "eval_every=0",  # the slow stage would read the 359 validation samples too (12 s)
        "log_steps=1",
        f"debug.sample_log_dir={samples}",
    ]
    # 2 replicas x 32 x 2 workers: 4 canonical streams (auto), so 1 x 64 x 1 worker continues it.
    # (Fewer processes than the 4-replica pod above: 2 replicas show the stop vote as well.)
    stopped = [
        *common,
        f"output_dir={run}",
        "data.stages=[tests.user_stages:slow]",
        "checkpoint.stop_check_every=2",
    ]
    first_shape = ["batch_size=32", "data.num_workers=2", "accelerator.num_devices=2"]
    command = train_command(*stopped, *first_shape)
    process = popen_train([*command, f"hydra.run.dir={tmp_path}/h1"], stderr=subprocess.PIPE)
    pids: dict[int, int] = {}
    lines = []
    for line in process.stderr:
        lines.append(line)
        if match := re.search(r"replica (\d+) of 2 on cpu \(pid (\d+)\)", line):
            pids[int(match.group(1))] = int(match.group(2))
        if re.search(r"Epoch=0 Step=5 Loss", line):
            os.kill(pids[1], signal.SIGTERM)  # one replica only; the other must stop with it
            break
    lines.extend(process.stderr)
    text = "".join(lines)
    assert process.wait(timeout=300) == PREEMPTED_EXIT_CODE, text[-4000:]
    saved = load_checkpoint(f"{run}/checkpoints/last.pt")
    stop = saved["position"]["step"]
    assert saved["position"]["epoch"] == 0 and 6 <= stop < 12
    assert saved["data_plan"]["world_size"] == 2 and saved["data_plan"]["streams"] == 4
    assert "received SIGTERM" in text

    # One replica of 64 with one worker now: the same global batch of 64, so the run
    # continues at the step it stopped (batch_size differs from the run folder's: allowed).
    # (The replica in train.py's process: a spawned one would only add a process importing torch.)
    second_shape = [
        "batch_size=64",
        "data.num_workers=1",
        "accelerator.num_devices=1",
        "accelerator.in_process=true",
    ]
    resumed = run_train(
        *stopped, *second_shape, f"hydra.run.dir={tmp_path}/h2", env={"SLOW_STAGE_SECONDS": "0"}
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"stopped at step {stop} of epoch 0 under 2 replica(s) x batch 32, 2 worker(s); continuing" in (
        resumed.stderr
    )
    history = read_metrics(run)
    assert [m["epoch"] for m in history] == [0]
    assert history[0]["train_samples"] == 768 and history[0]["replica_steps"] == 12  # 768 / 64
    # Every sample trained once across the stop, in whole global batches on both shapes. That each
    # global batch is the uninterrupted run's, on any shape and from any step, is the canonical
    # streams' promise, held in process by test_pipeline's
    # test_canonical_global_batches_are_the_same_on_every_shape_and_resume_from_any_step.
    before = sample_log_steps(samples, f"-to{stop:05d}", 2, 32)
    after = sample_log_steps(samples, f"-from{stop:05d}", 1, 64)
    assert before.shape == (stop, 64) and after.shape == (12 - stop, 64)
    assert len(set(np.concatenate([before, after]).ravel())) == 768
