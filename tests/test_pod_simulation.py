"""A simulated pod (accelerator=cpu_pod): 4 replica processes over gloo, streaming from the GCS emulator.

Each replica is its own process with its own XLA CPU device; the trainer,
data splitting, metric reduction and checkpointing are the code a TPU pod runs.
"""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest

from tests.conftest import run_train
from tpustream import storage
from tpustream.checkpoint import load_checkpoint, read_metrics
from tpustream.data.manifest import load_manifest
from tpustream.data.pipeline import SHARD_ID_SHIFT
from tpustream.data.sharding import order_shards, plan_layout, split_by_replica

pytestmark = pytest.mark.slow
REPLICAS = 4


def test_four_replicas_see_every_sample_once_stay_identical_and_evaluate_exactly(digits_bucket, tmp_path):
    run = f"{digits_bucket}/runs/pod"
    samples = tmp_path / "samples"
    result = run_train(
        "accelerator=cpu_pod",
        f"accelerator.num_devices={REPLICAS}",
        f"data.root={digits_bucket}/digits",
        f"output_dir={run}",
        "data.num_workers=2",
        "batch_size=16",
        "epochs=2",
        "debug.check_sync_every=1",  # bit-identical parameters after every step, buffers every epoch
        f"debug.sample_log_dir={samples}",
        f"hydra.run.dir={tmp_path}/h",
    )
    assert result.returncode == 0, result.stderr[-4000:]

    # Every training sample exactly once per epoch across the replicas.
    manifest = load_manifest(f"{digits_bucket}/digits/train")
    expected = {
        (i << SHARD_ID_SHIFT) | j for i, shard in enumerate(manifest.shards) for j in range(shard.samples)
    }
    for epoch in (0, 1):
        per_replica = [
            np.load(samples / f"train-epoch{epoch:03d}-replica{r:03d}.npy") for r in range(REPLICAS)
        ]
        seen = Counter(int(i) for ids in per_replica for i in ids)
        assert set(seen) == expected and set(seen.values()) == {1}
    # Every replica ran the same number of steps: ceil(1438 / (16 x 4)).
    history = read_metrics(run)
    assert [m["replica_steps"] for m in history] == [23, 23]
    assert all(m["train_samples"] == 1438 and m["val_samples"] == 359 for m in history)

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
        f"hydra.run.dir={tmp_path}/h2",
    )
    assert single.returncode == 0, single.stderr[-3000:]
    match = re.search(
        r"evaluation of the checkpoint from epoch (\d+): accuracy=[\d.]+% \((\d+)/(\d+)\)", single.stderr
    )
    assert match and int(match.group(1)) == best["epoch"]
    assert (int(match.group(2)), int(match.group(3))) == (pod["val_correct"], 359)


def test_a_failing_replica_stops_the_whole_pod(digits_bucket, tmp_path):
    # Remove a shard that exactly one replica reads in epoch 0 (seed 0, batch 64).
    manifest = load_manifest(f"{digits_bucket}/digits/train")
    layout = plan_layout(manifest.num_samples, 64, REPLICAS)
    order = order_shards(manifest.shards, seed=0, epoch=0, shuffle=True)
    readers = {
        shard.url: [
            r for r in range(REPLICAS) if shard.url in {s.url for s in split_by_replica(order, layout, r)}
        ]
        for shard in manifest.shards
    }
    shard, (reader,) = next((url, rs) for url, rs in readers.items() if len(rs) == 1)
    bucket, name = storage.split_gcs_url(shard)
    storage.gcs_client().bucket(bucket).blob(name).delete()
    result = run_train(
        "accelerator=cpu_pod",
        f"accelerator.num_devices={REPLICAS}",
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
