"""tpustream.pod.spec: what the pod tools read from the train.py command line they run."""

from __future__ import annotations

import pytest

from tpustream.pod.spec import command_output_dir, is_bucket_url


@pytest.mark.parametrize(
    "command, output_dir",
    [
        (["python", "train.py", "output_dir=gs://b/runs/x"], "gs://b/runs/x"),
        (["python", "train.py", "+output_dir=gs://b/x", "epochs=3"], "gs://b/x"),
        (["python", "train.py", "++output_dir='gs://b/x y'"], "gs://b/x y"),
        (["python", "train.py", 'output_dir="/data/runs/x"'], "/data/runs/x"),
        (["python", "train.py", "output_dir=a", "output_dir=gs://b/last"], "gs://b/last"),  # the last wins
        (["python", "train.py", "log_dir=gs://b/logs", "data.output_dir=gs://b/x"], None),
        (["python", "train.py"], None),  # conf/config.yaml's default: the Hydra run folder, local
    ],
)
def test_command_output_dir_reads_hydra_overrides(command, output_dir):
    assert command_output_dir(command) == output_dir


@pytest.mark.parametrize(
    "path, bucket",
    [("gs://b/runs/x", True), ("gs://b", True), ("gs://", False), ("gs:///", False),
     ("/data/runs", False), ("outputs/x", False), ("GS://b/x", False), (None, False)],
)  # fmt: skip
def test_is_bucket_url(path, bucket):
    assert is_bucket_url(path) is bucket
