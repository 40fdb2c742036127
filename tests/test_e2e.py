"""End to end on the XLA CPU device: shards in a bucket -> train.py -> checkpoints in the bucket -> resume.

Each run is a real `python train.py` in its own process (xmp.spawn, one replica).
"""

from __future__ import annotations

import re

import pytest

from tests.conftest import run_train
from tpustream import storage
from tpustream.checkpoint import load_checkpoint, read_metrics

pytestmark = pytest.mark.slow


def metrics(run: str) -> list[dict]:
    return read_metrics(run)


def test_train_from_bucket_checkpoint_in_bucket_and_resume(digits_bucket, tmp_path):
    run = f"{digits_bucket}/runs/e2e"
    common = [f"data.root={digits_bucket}/digits", f"output_dir={run}", "data.num_workers=2"]
    first = run_train(*common, "epochs=4", f"hydra.run.dir={tmp_path}/h1")
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

    log = first.stderr
    assert re.search(
        r"\[replica 0/1\] INFO tpustream.training: Training Device=xla:0/1 Epoch=0 Step=0 Loss=\d", log
    )
    assert "Rate=" in log and "GlobalRate=" in log
    assert "best validation accuracy" in first.stdout

    second = run_train(*common, "epochs=6", f"hydra.run.dir={tmp_path}/h2")
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {run}/checkpoints/last.pt at epoch 4, step 0" in second.stderr
    history = metrics(run)
    assert [m["epoch"] for m in history] == [0, 1, 2, 3, 4, 5]
    last = load_checkpoint(f"{run}/checkpoints/last.pt")
    assert last["epoch"] == 5 and last["global_step"] == 6 * 23
    assert load_checkpoint(f"{run}/checkpoints/best.pt")["best_accuracy"] >= best["best_accuracy"]


def test_a_shard_missing_from_the_bucket_fails_the_run_naming_it(digits_bucket, tmp_path):
    shard = f"{digits_bucket}/digits/train/train-000003.tar"
    bucket_name, object_name = storage.split_gcs_url(shard)
    storage.gcs_client().bucket(bucket_name).blob(object_name).delete()
    result = run_train(
        f"data.root={digits_bucket}/digits",
        f"output_dir={digits_bucket}/runs/broken",
        "epochs=2",
        f"hydra.run.dir={tmp_path}/h",
    )
    assert result.returncode == 2
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and errors[0].endswith(f"{shard}: no such object (404)")
    assert "Traceback" not in output
    # The run stopped at the error instead of finishing a short epoch.
    assert not storage.exists(f"{digits_bucket}/runs/broken/checkpoints/last.pt")
