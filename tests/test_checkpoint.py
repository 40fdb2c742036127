"""Checkpoint writing, verification, the resume rules and the run folder, locally and in a bucket."""

from __future__ import annotations

import io
import logging

import pytest
import torch

from tpustream import storage
from tpustream.checkpoint import (
    BEST,
    LAST,
    CheckpointError,
    checkpoint_url,
    config_differences,
    config_fingerprint,
    encode_checkpoint,
    load_checkpoint,
    read_metrics,
    resolve_resume,
    write_config,
    write_host_state,
    write_metrics,
)
from tpustream.errors import ConfigError, StorageError


def sample_state(epoch: int = 3) -> dict:
    return {
        "position": {"epoch": epoch + 1, "step": 0},
        "epoch": epoch,
        "model": {"w": torch.arange(1000.0), "n": torch.tensor(7)},
        "config": {"lr": 0.1},
        "history": [{"epoch": epoch}],
    }


@pytest.fixture(params=["local", "gcs"])
def output_dir(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "run")
    return f"{request.getfixturevalue('bucket')}/run"


def test_round_trip_layout_and_resume_auto(output_dir):
    assert resolve_resume("auto", output_dir) is None
    url = checkpoint_url(output_dir, LAST)
    assert url == storage.join(output_dir, "checkpoints", "last.pt")
    assert write_host_state(url, sample_state()) == []
    assert resolve_resume("auto", output_dir) == url
    loaded = load_checkpoint(url)
    assert loaded["epoch"] == 3 and torch.equal(loaded["model"]["w"], torch.arange(1000.0))
    # A plain torch.save file: torch.load reads it without tpustream.
    plain = torch.load(io.BytesIO(storage.read_bytes(url)), weights_only=True)
    assert torch.equal(plain["model"]["w"], torch.arange(1000.0)) and "integrity" in plain
    assert resolve_resume(None, output_dir) is None and resolve_resume("", output_dir) is None
    # No temporary object or file is left next to the checkpoint.
    assert storage.list_names(storage.join(output_dir, "checkpoints")) == ["last.pt"]


def test_bfloat16_weights_come_back_as_bfloat16_bit_for_bit(tmp_path):
    """No float32 round trip on the way (xm.save converts under XLA_USE_BF16)."""
    model = torch.nn.Linear(7, 3).to(torch.bfloat16)
    state = {**sample_state(), "model": model.state_dict()}
    write_host_state(str(tmp_path / "bf16.pt"), state)
    loaded = load_checkpoint(str(tmp_path / "bf16.pt"))["model"]
    assert {t.dtype for t in loaded.values()} == {torch.bfloat16}
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    fresh = torch.nn.Linear(7, 3).to(torch.bfloat16)
    fresh.load_state_dict(loaded)
    assert fresh.weight.dtype == torch.bfloat16 and torch.equal(fresh.weight, model.weight)


def flip_byte_in_tensor_data(data: bytes) -> bytes:
    marker = torch.arange(1000.0)[500:501].numpy().tobytes()  # the float 500.0, inside the tensor
    index = data.index(marker)
    return data[:index] + bytes([data[index] ^ 0x01]) + data[index + 1 :]


class NotWeights:
    """A class a weights-only load refuses to unpickle."""


def test_a_file_that_is_not_weights_only_names_its_cause_whole(tmp_path):
    """The cause, not torch's advice cut mid-word ("...only if you t)")."""
    buffer = io.BytesIO()
    torch.save({"model": NotWeights()}, buffer)
    (tmp_path / "pickled.pt").write_bytes(buffer.getvalue())
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(str(tmp_path / "pickled.pt"))
    assert str(refused.value) == (
        f"{tmp_path}/pickled.pt: damaged or not a checkpoint (UnpicklingError: Unsupported global: GLOBAL "
        "tests.test_checkpoint.NotWeights was not an allowed global by default.)"
    )
    assert "two options" in str(refused.value.__cause__)  # torch's whole message stays with it


def test_a_long_load_error_is_cut_at_a_word():
    from tpustream.checkpoint import MAX_LOAD_ERROR_CHARS, describe_load_error

    described = describe_load_error(RuntimeError("zipfile " * 100))
    assert (
        described.endswith("zipfile ...") and len(described) <= len("RuntimeError: ") + MAX_LOAD_ERROR_CHARS
    )
    assert describe_load_error(EOFError()) == "EOFError"


def test_damage_is_detected_with_a_clear_message(tmp_path):
    good = encode_checkpoint(sample_state())
    (tmp_path / "flipped.pt").write_bytes(flip_byte_in_tensor_data(good))
    with pytest.raises(CheckpointError, match="flipped.pt: checksum mismatch, the file is damaged"):
        load_checkpoint(str(tmp_path / "flipped.pt"))
    (tmp_path / "truncated.pt").write_bytes(good[: len(good) // 2])
    with pytest.raises(CheckpointError, match="truncated.pt: damaged or not a checkpoint"):
        load_checkpoint(str(tmp_path / "truncated.pt"))
    buffer = io.BytesIO()
    torch.save({"weights": torch.zeros(1)}, buffer)
    (tmp_path / "other.pt").write_bytes(buffer.getvalue())
    with pytest.raises(CheckpointError, match="other.pt: not a tpustream checkpoint"):
        load_checkpoint(str(tmp_path / "other.pt"))


def test_resume_auto_falls_back_to_best_and_never_silently_past_damaged_checkpoints(tmp_path, caplog):
    out = str(tmp_path / "run")
    write_host_state(checkpoint_url(out, BEST), sample_state(epoch=2))
    write_host_state(checkpoint_url(out, LAST), sample_state(epoch=3))
    last = tmp_path / "run" / "checkpoints" / "last.pt"
    last.write_bytes(flip_byte_in_tensor_data(last.read_bytes()))
    with caplog.at_level(logging.ERROR):
        assert resolve_resume("auto", out) == checkpoint_url(out, BEST)
    assert "last.pt: checksum mismatch" in caplog.text
    best = tmp_path / "run" / "checkpoints" / "best.pt"
    best.write_bytes(best.read_bytes()[:100])
    # Neither usable: an error naming both, not a fresh start that would overwrite them.
    with pytest.raises(
        ConfigError, match=r"no usable checkpoint .*last.pt: checksum mismatch.*best.pt: damaged"
    ):
        resolve_resume("auto", out)
    best.unlink()
    last.write_bytes(b"")  # a zero-byte last.pt (a disk that filled up) and no best.pt
    with pytest.raises(
        ConfigError, match=r"last.pt: damaged or not a checkpoint \(the file is empty\).*resume=overwrite"
    ):
        resolve_resume("auto", out)
    elsewhere = tmp_path / "elsewhere.pt"
    elsewhere.write_bytes(b"")
    with pytest.raises(CheckpointError, match="the file is empty"):
        resolve_resume(str(elsewhere), str(tmp_path / "new-run"))  # an explicit checkpoint must be valid
    with pytest.raises(ConfigError, match="no checkpoint at"):
        resolve_resume(str(tmp_path / "missing.pt"), str(tmp_path / "new-run"))


def test_a_failed_write_keeps_the_checkpoint_locally_and_says_where(tmp_path, monkeypatch, caplog):

    def fail(url, data):
        raise StorageError(f"{url}: HTTPConnectionPool: connection refused")

    monkeypatch.setattr(storage, "write_bytes_verified", fail)
    url = "gs://bkt/run/checkpoints/last.pt"
    with caplog.at_level(logging.ERROR):
        kept = write_host_state(url, sample_state(), fallback_dir=str(tmp_path / "unsaved"))
    assert kept == [str(tmp_path / "unsaved" / "gs" / "bkt" / "run" / "checkpoints" / "last.pt")]
    assert load_checkpoint(kept[0])["epoch"] == 3
    assert f"could not write {url}" in caplog.text and kept[0] in caplog.text
    with pytest.raises(StorageError, match="connection refused"):
        write_host_state(url, sample_state())  # without a fallback folder the error is raised


def test_run_folder_files(output_dir):
    write_metrics(output_dir, [{"epoch": 0, "val_accuracy": 0.5}, {"epoch": 1, "val_accuracy": 0.75}])
    assert [m["val_accuracy"] for m in read_metrics(output_dir)] == [0.5, 0.75]
    write_config(output_dir, {"batch_size": 64, "data": {"root": "gs://b/x"}})
    text = storage.read_bytes(storage.join(output_dir, "config.yaml")).decode()
    assert "batch_size: 64" in text and "root: gs://b/x" in text


def test_config_fingerprint_ignores_what_a_resumed_run_may_change():
    base = {"epochs": 10, "output_dir": "a", "optim": {"lr": 0.1}, "debug": {"stop_at_step": 0}}
    assert config_fingerprint(base) == config_fingerprint(
        {**base, "epochs": 20, "output_dir": "b", "debug": {}, "eval_every": 5, "xla_cache_dir": "/c"}
    )
    assert config_fingerprint(base) != config_fingerprint({**base, "micro_batches": 2})
    assert config_fingerprint(base) != config_fingerprint({**base, "optim": {"lr": 0.2}})


def test_config_differences_name_dotted_keys_outside_the_ignored_ones():
    saved = {"epochs": 10, "optim": {"lr": 0.1, "momentum": 0.9}, "accelerator": {"num_devices": 1}}
    saved["seed"] = 0
    current = {"epochs": 20, "optim": {"lr": 0.2, "momentum": 0.9}, "accelerator": {"num_devices": 4}}
    assert config_differences(saved, current, ("epochs", "accelerator")) == [
        "optim.lr: 0.1 -> 0.2",
        "seed: 0 -> (unset)",
    ]
    assert config_differences(saved, saved) == []
    # A key added since the run was made: no difference at its default, one otherwise.
    from tpustream.checkpoint import schema_defaults

    newer = {**saved, "model": {"library": "tpustream"}}
    assert config_differences(saved, newer, defaults=schema_defaults()) == []
    newer["model"]["library"] = "timm"
    assert config_differences(saved, newer, defaults=schema_defaults()) == ["model.library: (unset) -> timm"]


def test_a_run_may_continue_decoding_its_jpegs_elsewhere():
    """data.decode=device on a GPU, continued on a TPU with data.decode=host: how input is fed, not what."""
    from tpustream.checkpoint import RESUME_MAY_DIFFER

    saved = {"data": {"decode": "device", "train_crop": "random_resized"}, "accelerator": {"device": "CUDA"}}
    resumed = {"data": {"decode": "host", "train_crop": "random_resized"}, "accelerator": {"device": "TPU"}}
    assert config_differences(saved, resumed, RESUME_MAY_DIFFER) == []


def test_a_checkpoint_and_its_copies_are_serialised_once(tmp_path, monkeypatch, caplog):
    """A new best epoch writes last.pt and copies it to best.pt, one encode for both."""
    from tpustream import checkpoint as checkpoint_module

    encoded = []
    encode = checkpoint_module.encode_checkpoint
    monkeypatch.setattr(
        checkpoint_module, "encode_checkpoint", lambda state: encoded.append(1) or encode(state)
    )
    out = str(tmp_path / "run")
    last, best = checkpoint_url(out, LAST), checkpoint_url(out, BEST)
    assert write_host_state(last, sample_state(epoch=2), copies=[best]) == []
    assert len(encoded) == 1 and storage.read_bytes(best) == storage.read_bytes(last)
    assert load_checkpoint(best)["epoch"] == 2
    # A copy that fails is written from the bytes in hand instead.
    monkeypatch.setattr(storage, "copy", lambda source, url: (_ for _ in ()).throw(StorageError("no copy")))
    with caplog.at_level(logging.WARNING):
        write_host_state(last, sample_state(epoch=3), copies=[best])
    assert load_checkpoint(best)["epoch"] == 3 and len(encoded) == 2
    assert f"could not copy {last} to {best} (no copy); writing it" in caplog.text
