"""Checkpoint writing, reading and the resume rules, locally and in a bucket."""

from __future__ import annotations

import io

import pytest
import torch

from tpustream import storage
from tpustream.checkpoint import LAST, load_checkpoint, resolve_resume, save_checkpoint, write_metrics
from tpustream.errors import ConfigError, StorageError


class HostRuntime:
    """The Runtime methods checkpointing uses, for one replica on the host."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.barriers: list[str] = []

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    def serialize(self, state):
        if not self.is_master:
            return None
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return buffer.getvalue()

    def barrier(self, tag: str) -> None:
        self.barriers.append(tag)


@pytest.fixture(params=["local", "gcs"])
def output_dir(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "run")
    return f"{request.getfixturevalue('bucket')}/run"


def test_round_trip_and_resume_auto(output_dir):
    runtime = HostRuntime()
    assert resolve_resume("auto", output_dir) is None
    state = {"epoch": 3, "model": {"w": torch.arange(4.0)}, "config": {"lr": 0.1}, "history": [{"epoch": 3}]}
    save_checkpoint(runtime, storage.join(output_dir, LAST), state)
    assert runtime.barriers == [f"checkpoint:{storage.join(output_dir, LAST)}"]
    url = resolve_resume("auto", output_dir)
    assert url == storage.join(output_dir, LAST)
    loaded = load_checkpoint(url)
    assert loaded["epoch"] == 3 and torch.equal(loaded["model"]["w"], torch.arange(4.0))
    assert resolve_resume(None, output_dir) is None and resolve_resume("", output_dir) is None
    write_metrics(runtime, output_dir, [{"epoch": 0, "val_accuracy": 0.5}])
    assert b'"val_accuracy": 0.5' in storage.read_bytes(storage.join(output_dir, "metrics.json"))


def test_only_the_master_writes_but_everyone_waits(tmp_path):
    worker = HostRuntime(rank=1)
    save_checkpoint(worker, str(tmp_path / "x.pt"), {"epoch": 0})
    assert not (tmp_path / "x.pt").exists() and worker.barriers


def test_bad_checkpoints_and_paths_are_named(tmp_path):
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="junk.pt: not a readable tpustream checkpoint"):
        load_checkpoint(str(tmp_path / "junk.pt"))
    buffer = io.BytesIO()
    torch.save({"weights": torch.zeros(1)}, buffer)
    (tmp_path / "other.pt").write_bytes(buffer.getvalue())
    with pytest.raises(ConfigError, match="not a tpustream checkpoint"):
        load_checkpoint(str(tmp_path / "other.pt"))
    with pytest.raises(ConfigError, match="no checkpoint at"):
        resolve_resume(str(tmp_path / "missing.pt"), str(tmp_path))


def test_a_failed_write_is_raised_after_the_barrier(tmp_path, monkeypatch):
    runtime = HostRuntime()

    def fail(url, data):
        raise StorageError(f"{url}: permission denied (403)")

    monkeypatch.setattr(storage, "write_bytes", fail)
    with pytest.raises(StorageError, match="403"):
        save_checkpoint(runtime, str(tmp_path / "best.pt"), {"epoch": 1})
    assert runtime.barriers  # peers are not left waiting for the master
