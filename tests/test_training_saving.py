"""training.saving: what the loop waits for when it saves (a host copy), and what it never loses."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import threading
import time

import pytest
import torch

from tests.conftest import popen_train, train_command
from tests.fake_runtime import FakeRuntime, FakeWorld, tiny_config
from tpustream import storage
from tpustream.checkpoint import LAST, checkpoint_url, load_checkpoint
from tpustream.checkpoint.local_tier import local_checkpoint_url
from tpustream.errors import PREEMPTED_EXIT_CODE, StorageError
from tpustream.training.saving import CheckpointWriter


@pytest.fixture
def held_writes(monkeypatch, tmp_path):
    """Writes into the run folder wait until released; yields (release event, urls written, in order)."""
    release = threading.Event()
    written: list[str] = []
    original = storage.write_bytes_verified

    def write(url: str, data: bytes) -> None:
        if url.startswith(str(tmp_path / "run")):
            assert release.wait(20), "never released"
        original(url, data)
        written.append(url)

    monkeypatch.setattr(storage, "write_bytes_verified", write)
    return release, written


def make_writer(tmp_path, **changes) -> CheckpointWriter:
    cfg = tiny_config(str(tmp_path / "run"), **changes)
    cfg.log_dir = str(tmp_path / "logs")
    return CheckpointWriter(cfg, FakeRuntime(FakeWorld(1), 0))


def state_of(weights: torch.Tensor, step: int = 1) -> dict:
    return {"model": {"w": weights}, "global_step": step, "position": {"epoch": 0, "step": step}}


def test_only_the_master_writes_and_every_replica_waits_for_the_write(tmp_path, monkeypatch):
    """A synchronous save: the master writes, then every replica meets it at a barrier."""
    written: list[str] = []
    original = storage.write_bytes_verified
    monkeypatch.setattr(
        storage, "write_bytes_verified", lambda url, data: written.append(url) or original(url, data)
    )
    world = FakeWorld(2)
    cfg = tiny_config(str(tmp_path / "run"), **{"checkpoint.asynchronous": False})
    cfg.log_dir = str(tmp_path / "logs")
    runtimes = [FakeRuntime(world, rank) for rank in range(2)]

    def replica(runtime: FakeRuntime) -> None:
        world.bind(runtime.rank)
        writer = CheckpointWriter(cfg, runtime)
        writer.save(LAST, lambda: state_of(torch.ones(2)), position=(1, 0, 1))
        writer.wait_durable()

    threads = [threading.Thread(target=replica, args=(runtime,)) for runtime in runtimes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    url = checkpoint_url(str(tmp_path / "run"), LAST)
    assert written == [url]
    for runtime in runtimes:
        assert f"barrier:checkpoint:{url}" in runtime.collectives


def test_training_goes_on_while_the_save_is_written_and_the_file_holds_the_state_taken(tmp_path, held_writes):
    release, _ = held_writes
    writer = make_writer(tmp_path)
    weights = torch.arange(6.0)
    start = time.perf_counter()
    writer.save(LAST, lambda: state_of(weights), position=(1, 0, 1))
    assert time.perf_counter() - start < 5 and writer.background.in_flight == LAST
    url = checkpoint_url(str(tmp_path / "run"), LAST)
    assert not os.path.exists(url)
    weights += 100  # the next steps change the live tensors in place
    release.set()
    writer.wait_durable()
    assert torch.equal(load_checkpoint(url)["model"]["w"], torch.arange(6.0))
    seconds = writer.take_seconds()
    assert seconds.write > 0 and writer.take_seconds() == (0.0, 0.0, 0.0, 0.0)


def test_metrics_follow_the_checkpoint_they_describe(tmp_path, held_writes):
    release, written = held_writes
    writer = make_writer(tmp_path)
    order: list[str] = []
    writer.save(
        LAST, lambda: state_of(torch.ones(2)), position=(1, 0, 1), then=lambda: order.append("metrics")
    )
    time.sleep(0.1)
    assert order == []  # metrics.jsonl would name an epoch last.pt does not hold yet
    release.set()
    writer.wait_durable()
    assert order == ["metrics"] and written[-1].endswith(LAST)


def test_a_write_that_fails_in_the_background_is_kept_locally_and_fails_the_run(
    tmp_path, monkeypatch, caplog
):
    original = storage.write_bytes_verified

    def refuse(url: str, data: bytes) -> None:
        if url.startswith(str(tmp_path / "run")):
            raise StorageError(f"{url}: 503 after retries")
        original(url, data)

    monkeypatch.setattr(storage, "write_bytes_verified", refuse)
    writer = make_writer(tmp_path)
    with caplog.at_level(logging.ERROR):
        writer.save(LAST, lambda: state_of(torch.ones(3)), position=(1, 0, 1))
        writer.wait_durable()
    kept = str(tmp_path / "logs" / "unsaved") + str(tmp_path / "run" / "checkpoints" / LAST)
    assert f"kept the checkpoint at {kept}" in caplog.text
    assert torch.equal(load_checkpoint(kept)["model"]["w"], torch.ones(3))
    with pytest.raises(StorageError, match=r"1 checkpoint\(s\) could not be written to .*; kept locally: "):
        writer.raise_if_unsaved()


def test_an_unexpected_error_in_the_background_is_raised_by_the_next_wait(tmp_path, monkeypatch):
    def broken(*args):
        raise RuntimeError("serialiser bug")

    monkeypatch.setattr("tpustream.checkpoint.encode_checkpoint", broken)
    writer = make_writer(tmp_path)
    writer.save(LAST, lambda: state_of(torch.ones(3)), position=(1, 0, 1))
    with pytest.raises(RuntimeError, match="serialiser bug"):
        writer.wait_durable()


def test_a_state_over_asynchronous_max_bytes_is_saved_before_training_goes_on(tmp_path, caplog):
    writer = make_writer(tmp_path, **{"checkpoint.asynchronous_max_bytes": 16})
    url = checkpoint_url(str(tmp_path / "run"), LAST)
    with caplog.at_level(logging.WARNING):
        for step in (1, 2):
            writer.save(LAST, lambda step=step: state_of(torch.ones(8), step), position=(step, 0, step))
            assert writer.background.in_flight is None and load_checkpoint(url)["global_step"] == step
    warnings = [r.getMessage() for r in caplog.records if "saving synchronously" in r.getMessage()]
    # Sizes in units that tell them apart (a few bytes read "0.00 GB" against "0.00 GB").
    assert warnings == [
        "checkpoint: the state's host copy (32 B) is more than checkpoint.asynchronous_max_bytes=16 "
        "(16 B): saving synchronously, training waits for each write"
    ]


def test_synchronous_saves_count_their_writing_as_stall(tmp_path):
    writer = make_writer(tmp_path, **{"checkpoint.asynchronous": False})
    assert writer.background is None
    writer.save(LAST, lambda: state_of(torch.ones(8)), position=(1, 0, 1))
    seconds = writer.take_seconds()
    assert load_checkpoint(checkpoint_url(str(tmp_path / "run"), LAST))["global_step"] == 1
    assert seconds.stall >= seconds.write + seconds.copy and seconds.write > 0 and seconds.copy > 0
    assert seconds.writer_wait == 0  # no background writer to wait for


def test_the_loops_wait_is_split_into_the_host_copy_and_the_wait_for_the_previous_write(
    tmp_path, held_writes
):
    """What the saving advice reads: a copy every save costs, apart from waiting for a slow writer."""
    release, _ = held_writes
    writer = make_writer(tmp_path)

    def slow_state(step: int) -> dict:
        time.sleep(0.05)  # taking the state (under XLA: the device catching up, then the copy)
        return state_of(torch.ones(2), step)

    writer.save(LAST, lambda: slow_state(1), position=(1, 0, 1))
    threading.Timer(0.2, release.set).start()  # the first write is held: the next save waits for it
    writer.save(LAST, lambda: slow_state(2), position=(2, 0, 2))
    seconds = writer.take_seconds()
    assert seconds.copy >= 0.1 and seconds.writer_wait >= 0.1
    assert seconds.stall >= seconds.copy + seconds.writer_wait
    writer.wait_durable()


def test_a_save_of_the_position_just_saved_is_not_written_again(tmp_path, held_writes, caplog):
    release, written = held_writes
    release.set()
    writer = make_writer(tmp_path)
    taken: list[int] = []

    def state() -> dict:
        taken.append(1)
        return state_of(torch.ones(2))

    with caplog.at_level(logging.INFO):
        writer.save(LAST, state, position=(5, 0, 5))
        writer.save(LAST, state, position=(5, 0, 5))  # a stop right after a periodic save
        writer.save(LAST, state, position=(6, 0, 6))
        writer.wait_durable()
    assert len(taken) == 2 and len(written) == 2
    assert "last.pt at this position is saved already (or being written); not saving it again" in caplog.text


def test_with_local_dir_the_local_copy_is_durable_before_the_upload(tmp_path, held_writes):
    release, written = held_writes
    writer = make_writer(tmp_path, **{"checkpoint.local_dir": str(tmp_path / "ssd")})
    writer.save(LAST, lambda: state_of(torch.ones(2), 7), position=(7, 0, 7))
    local = local_checkpoint_url(str(tmp_path / "ssd"), str(tmp_path / "run"))
    deadline = time.time() + 10
    while not os.path.exists(local) and time.time() < deadline:
        time.sleep(0.01)
    assert load_checkpoint(local)["global_step"] == 7  # a kill now leaves this host a whole copy
    assert not os.path.exists(checkpoint_url(str(tmp_path / "run"), LAST))
    release.set()
    writer.wait_durable()
    assert written == [local, checkpoint_url(str(tmp_path / "run"), LAST)]


@pytest.mark.slow
def test_kill_9_or_sigterm_while_a_save_is_uploaded(faulty_gcs, digits_root, tmp_path):
    """A save in flight to GCS (its upload held by the proxy): kill -9 keeps the previous last.pt whole;
    SIGTERM lets it finish, writes the stop's last.pt, and exits 75 only after that."""
    proxy = faulty_gcs
    run = "gs://faulty/run"
    command = train_command(
        f"data.root={digits_root}",
        f"output_dir={run}",
        "epochs=2",
        "log_steps=1",
        "checkpoint.every_n_steps=4",
        "data.num_workers=0",
        "accelerator=cpu_eager",  # the save is this test's subject, not XLA
        "accelerator.in_process=true",  # the replica is train.py itself: the signals reach it
        f"hydra.run.dir={tmp_path}/h",
    )

    def start() -> tuple[subprocess.Popen, list[str]]:
        process = popen_train(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        return process, []

    def read_until(process, lines: list[str], pattern: str) -> None:
        for line in process.stdout:
            lines.append(line)
            if re.search(pattern, line):
                return
        pytest.fail(f"train.py ended before {pattern!r}:\n{''.join(lines[-30:])}")

    # The step that makes an uploaded last.pt visible (storage.gcs.write_bytes_verified): step 4's goes
    # through, step 8's waits, its save in flight.
    proxy.hold, proxy.hold_skip = b"copyTo/b/faulty/o/run%2Fcheckpoints%2Flast.pt?", 1
    process, lines = start()
    try:
        assert proxy.held.wait(120), "no second save"
        read_until(process, lines, r"Epoch=0 Step=10 ")  # training went on past the save at step 8
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    proxy.drop_held = True  # the held request dies with its client instead of going on to the server
    proxy.release.set()
    assert load_checkpoint(f"{run}/checkpoints/last.pt")["global_step"] == 4  # whole, the previous one
    # What the killed save had uploaded stays under its temporary name, never as last.pt.
    assert [name for name in storage.list_names(f"{run}/checkpoints") if ".tmp-" not in name] == ["last.pt"]

    proxy.held.clear()
    proxy.hold_skip, proxy.release, proxy.drop_held = 0, threading.Event(), False
    process, lines = start()  # resume=auto: continues from step 4
    try:
        assert proxy.held.wait(120), "no save after the resume"  # step 8's upload, in flight
        os.killpg(process.pid, signal.SIGTERM)
        time.sleep(3)
        assert process.poll() is None, "exited with a save in flight"
        proxy.release.set()
        assert process.wait(timeout=120) == PREEMPTED_EXIT_CODE
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    text = "".join(lines) + process.stdout.read()
    stopped = re.search(r"stopped at epoch 0, step (\d+)", text)
    assert stopped and "Traceback" not in text, text[-3000:]
    saved = load_checkpoint(f"{run}/checkpoints/last.pt")
    assert saved["position"] == {"epoch": 0, "step": int(stopped.group(1))} and saved["global_step"] > 8
