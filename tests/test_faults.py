"""Training through a faulty GCS: 503s and connections dropped mid-transfer, or no GCS at all.

fake-gcs-server sits behind tests/fault_proxy.py; train.py runs in its own
process and talks only to the proxy.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch

from tests.conftest import popen_train, run_train, train_command
from tpustream import storage
from tpustream.checkpoint import checkpoint_url, load_checkpoint, read_metrics
from tpustream.data.write.command import main as make_shards_main
from tpustream.errors import StorageError

pytestmark = pytest.mark.slow


def test_ten_percent_faults_change_nothing(faulty_gcs, tmp_path):
    proxy = faulty_gcs
    assert make_shards_main(["digits", "gs://faulty/digits", "--no-progress", "--workers", "1"]) == 0

    def train(run: str) -> None:
        result = run_train(
            "data.root=gs://faulty/digits",
            f"output_dir={run}",
            "epochs=1",
            "data.num_workers=1",
            # The replica in train.py, eager: storage faults are this test's subject, not XLA.
            "accelerator=cpu_eager",
            "accelerator.in_process=true",
            f"hydra.run.dir={tmp_path}/{run.rsplit('/', 1)[1]}",
        )
        assert result.returncode == 0, result.stderr[-4000:]

    train("gs://faulty/clean")
    before = proxy.stats.requests
    proxy.fault_rate = 0.10
    train("gs://faulty/faulty")
    proxy.fault_rate = 0.0
    assert proxy.stats.requests - before > 40
    assert proxy.stats.unavailable > 0 and proxy.stats.dropped > 0, proxy.stats

    clean, faulty = (
        load_checkpoint(checkpoint_url(f"gs://faulty/{r}", "last.pt")) for r in ("clean", "faulty")
    )
    for name, tensor in clean["model"].items():
        assert torch.equal(faulty["model"][name], tensor), name  # the same samples, in the same order
    assert [m["val_correct"] for m in read_metrics("gs://faulty/faulty")] == [
        m["val_correct"] for m in read_metrics("gs://faulty/clean")
    ]
    # No partial or temporary checkpoint object was ever left behind.
    assert storage.list_names("gs://faulty/faulty/checkpoints") == ["best.pt", "last.pt"]


def test_gcs_vanishing_before_the_final_upload_keeps_the_checkpoint_locally(
    faulty_gcs, digits_root, tmp_path
):
    proxy = faulty_gcs
    hydra_dir = tmp_path / "h"
    command = train_command(
        f"data.root={digits_root}",
        "output_dir=gs://faulty/run",
        "epochs=2",
        "data.num_workers=0",
        "accelerator=cpu_eager",  # storage is this test's subject, not XLA
        f"hydra.run.dir={hydra_dir}",
    )
    env = {**os.environ, "TPUSTREAM_GCS_RETRY_SECONDS": "1"}
    process = popen_train(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = []
    for line in process.stdout:
        output.append(line)
        if "saved gs://faulty/run/checkpoints/last.pt" in line and proxy.mode != "down":
            proxy.mode = "down"  # epoch 0 is safely in the bucket; epoch 1's uploads will fail
    text = "".join(output)
    assert process.wait(timeout=300) == 2, text[-3000:]

    kept = str(hydra_dir / "unsaved" / "gs" / "faulty" / "run" / "checkpoints" / "last.pt")
    assert "could not write gs://faulty/run/checkpoints/last.pt" in text and kept in text
    error = [line for line in output if "ERROR" in line and "[train]" in line]
    assert len(error) == 1 and re.search(
        r"checkpoint\(s\) could not be written to gs://faulty/run; kept locally: ", error[0]
    )
    assert load_checkpoint(kept)["epoch"] == 1  # the final epoch's state is not lost
    proxy.mode = "faults"
    assert (
        load_checkpoint("gs://faulty/run/checkpoints/last.pt")["epoch"] == 0
    )  # the bucket still has epoch 0


@pytest.mark.parametrize("copied", [True, False], ids=["our-copy-went-through", "another-writer"])
def test_a_copy_that_fails_its_generation_precondition(bucket, monkeypatch, copied):
    """Real GCS answers 412 to a retried copy whose first attempt went through (its
    answer lost on the way back); that object is ours. A 412 for an object someone
    else wrote is a clear error, and their object stays. fake-gcs-server does not
    enforce ifGenerationMatch on copyTo (seen with its current release), so the
    412 is raised here the way the client would raise it."""
    from google.api_core import exceptions as gexc
    from google.cloud.storage.bucket import Bucket

    url = f"{bucket}/run/checkpoints/last.pt"
    storage.write_bytes_verified(url, b"epoch 0")
    original = Bucket.copy_blob

    def copy_then_412(self, blob, destination_bucket, new_name=None, **kwargs):
        if copied:
            original(self, blob, destination_bucket, new_name, **kwargs)
        else:
            destination_bucket.blob(new_name).upload_from_string(b"someone else's")
        raise gexc.PreconditionFailed("conditionNotMet")

    monkeypatch.setattr(Bucket, "copy_blob", copy_then_412)
    if copied:
        storage.write_bytes_verified(url, b"epoch 1")
        assert storage.read_bytes(url) == b"epoch 1"
    else:
        with pytest.raises(StorageError, match="changed by another writer"):
            storage.write_bytes_verified(url, b"epoch 1")
        assert storage.read_bytes(url) == b"someone else's"
    monkeypatch.undo()
    assert storage.list_names(f"{bucket}/run/checkpoints") == ["last.pt"]  # no temporary left
