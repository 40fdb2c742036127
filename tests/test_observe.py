"""TensorBoard events in a local or gs:// run folder, XLA metrics, recompile warnings, the profiler server."""

from __future__ import annotations

import inspect
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import REPO, free_port, xla_cpu_env
from tpustream import storage
from tpustream.observe import (
    NullTensorBoardLog,
    RecompileWatch,
    TensorBoardLog,
    XlaMetrics,
    format_bytes,
)


def read_scalars(folder: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard would show for folder: {tag: [(step, value), ...]}."""
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep all
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def values_at(step: int) -> dict[str, float]:
    # Binary fractions: event files store float32, and these survive it exactly.
    return {"train/loss": 2.0 - step / 8, "lr": 0.125 * (step + 1), "rate/replica_003": 100.0 + step}


def expected_scalars(steps: range) -> dict[str, list[tuple[int, float]]]:
    return {name: [(step, values_at(step)[name]) for step in steps] for name in values_at(0)}


# -- TensorBoard --------------------------------------------------------------


def test_local_run_folder_holds_the_exact_scalars_and_steps(tmp_path):
    run = tmp_path / "run"
    with TensorBoardLog(str(run), local_dir=str(tmp_path / "staging")) as tensorboard:
        for step in range(4):
            tensorboard.scalars(step, values_at(step))
        assert tensorboard.sync()
    assert read_scalars(run / "tensorboard") == expected_scalars(range(4))
    assert not (tmp_path / "staging").exists()  # local runs are written in place


def test_resumed_run_replaces_the_steps_the_interrupted_run_wrote_past_its_checkpoint(tmp_path):
    run = str(tmp_path / "run")
    with TensorBoardLog(run) as interrupted:
        for step in range(5):
            interrupted.scalars(step, {"train/loss": float(step)})
    with TensorBoardLog(run, purge_step=3) as resumed:
        for step in range(3, 6):
            resumed.scalars(step, {"train/loss": 10.0 + step})
    assert read_scalars(f"{run}/tensorboard") == {
        "train/loss": [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0)]
    }


def test_gcs_run_folder_gets_every_scalar_and_only_grown_files_are_uploaded(bucket, tmp_path, monkeypatch):
    run = f"{bucket}/runs/r1"
    staging = tmp_path / "staging"
    staging.mkdir()
    # An earlier run's file in the staging folder is not this run's to upload.
    (staging / "events.out.tfevents.1.other-run").write_bytes(b"not ours")
    uploads = []
    write_bytes = storage.write_bytes
    monkeypatch.setattr(
        storage, "write_bytes", lambda url, data: (uploads.append(url), write_bytes(url, data))
    )

    tensorboard = TensorBoardLog(run, local_dir=str(staging))
    for step in range(2):
        tensorboard.scalars(step, values_at(step))
    assert tensorboard.sync()
    assert len(uploads) == 1
    assert tensorboard.sync()
    assert len(uploads) == 1, "nothing was written since the last sync"
    for step in range(2, 5):
        tensorboard.scalars(step, values_at(step))
    assert tensorboard.close()
    assert tensorboard.close()  # a second close is harmless

    names = storage.list_names(f"{run}/tensorboard")
    assert len(names) == 1 and ".tfevents." in names[0] and names[0] != "events.out.tfevents.1.other-run"
    assert uploads == [f"{run}/tensorboard/{names[0]}"] * 2
    downloaded = tmp_path / "downloaded"
    downloaded.mkdir()
    (downloaded / names[0]).write_bytes(storage.read_bytes(f"{run}/tensorboard/{names[0]}"))
    assert read_scalars(downloaded) == expected_scalars(range(5))
    assert tensorboard.sync_failures == 0


def test_sync_to_unreachable_gcs_warns_keeps_the_events_and_never_raises(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{free_port()}")  # nobody listens
    monkeypatch.setenv("TPUSTREAM_GCS_RETRY_SECONDS", "1")
    staging = tmp_path / "staging"
    tensorboard = TensorBoardLog("gs://tpustream-unreachable/run", local_dir=str(staging))
    tensorboard.scalars(0, values_at(0))
    with caplog.at_level(logging.WARNING, logger="tpustream.observe"):
        assert tensorboard.sync() is False
        tensorboard.scalars(1, values_at(1))
        assert tensorboard.close() is False
    assert tensorboard.sync_failures == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert all(
        "could not upload TensorBoard events to gs://tpustream-unreachable/run/tensorboard" in w
        for w in warnings
    )
    assert read_scalars(staging) == expected_scalars(range(2))


def test_null_log_has_the_same_methods_as_the_real_one():
    def public(cls):
        return {
            name: inspect.signature(member)
            for name, member in inspect.getmembers(cls, inspect.isfunction)
            if not name.startswith("_") or name in ("__enter__", "__exit__")
        }

    real, null = public(TensorBoardLog), public(NullTensorBoardLog)
    assert set(real) == set(null)
    for name, signature in real.items():
        assert list(signature.parameters) == list(null[name].parameters), name
    with NullTensorBoardLog() as tensorboard:
        tensorboard.scalars(0, {"train/loss": 1.0})
        assert tensorboard.sync()


# -- XLA metrics and recompilation warnings, without XLA -------------------------


class FakeCompiler:
    def __init__(self):
        self.total = 0

    def __call__(self) -> int:
        return self.total


def unexpected_compile_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "XLA compiled" in r.getMessage()]


def test_recompile_watch_warns_only_for_compilations_nobody_expected(caplog):
    compiler = FakeCompiler()
    compiler.total = 7  # model set-up, before the watch
    watch = RecompileWatch(warmup_checks=1, count_compilations=compiler)
    caplog.set_level(logging.WARNING, logger="tpustream.observe")

    compiler.total += 2  # the first training step
    assert watch.check(0) == 2
    assert watch.check(1) == 0
    watch.expect_compile()
    compiler.total += 1  # the first evaluation batch
    assert watch.check(0, "eval") == 1
    assert unexpected_compile_warnings(caplog) == []

    compiler.total += 3
    assert watch.check(2) == 3
    assert watch.check(3) == 0
    assert watch.unexpected == 3
    (warning,) = unexpected_compile_warnings(caplog)
    assert warning.startswith("train step 2: XLA compiled 3 new graph(s) (since eval step 0), 13 in total")
    assert "PT_XLA_DEBUG_LEVEL=1" in warning


def test_metrics_summary_separates_item_reads_from_cpu_fallbacks():
    metrics = XlaMetrics(
        compilations=3,
        compile_seconds=1.25,
        executions=40,
        execute_seconds=0.5,
        to_device_transfers=12,
        to_device_bytes=3 * 1024 * 1024,
        from_device_transfers=5,
        from_device_bytes=20,
        item_calls=4,
        cpu_fallbacks={"aten::linalg_eig": 2, "aten::nonzero": 1},
    )
    assert metrics.summary() == (
        "XLA: 3 compilations (1.25 s), 40 executions (0.50 s), host->device 12 transfers (3.0 MiB), "
        "device->host 5 transfers (20 B), 4 .item() reads, "
        "CPU fallbacks: aten::linalg_eig x2, aten::nonzero x1"
    )
    assert XlaMetrics().summary().endswith("CPU fallbacks: none")
    assert metrics.scalars()["xla/cpu_fallbacks"] == 3
    assert [format_bytes(n) for n in (0, 1023, 1024, 1536 * 1024**3)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "1.5 TiB",
    ]


# -- on the XLA CPU device, in a fresh process ---------------------------------


def xla_scenario() -> None:
    """What test_observe checks on the real XLA CPU device; prints one JSON report.

    Runs in its own process (see xla_report): torch_xla's metrics are process-wide,
    and an eager backward followed by an XLA one in the same process crashes the
    autograd engine. Forward ops only.
    """
    import dataclasses
    import tempfile
    import threading

    from tpustream import observe

    report: dict = {"torch_xla_imported_by_observe": "torch_xla" in sys.modules}

    import torch
    import torch_xla
    import torch_xla.debug.profiler as xp

    class Records(logging.Handler):
        def __init__(self):
            super().__init__()
            self.messages: list[str] = []

        def emit(self, record):
            self.messages.append(f"{record.levelname} {record.getMessage()}")

    records = Records()
    logging.getLogger("tpustream.observe").addHandler(records)
    logging.getLogger("tpustream.observe").setLevel(logging.INFO)
    device = torch_xla.device()

    # Not lowered to XLA: runs on the CPU and shows up as an aten:: counter.
    torch.linalg.eigvals(torch.randn(4, 4).to(device)).cpu()
    torch.zeros(1_000_000, dtype=torch.uint8).to(device)

    def forward(length: int) -> float:
        x = torch.arange(length, dtype=torch.float32).to(device)
        return float((x * 2 + 1).sum())  # .item(): cuts and runs the graph

    watch = observe.RecompileWatch(warmup_checks=1)
    new = []
    for step, length in enumerate((8, 8, 9)):  # the same shape twice, then a new one
        forward(length)
        new.append(watch.check(step))
    watch.expect_compile()
    forward(10)
    new.append(watch.check(0, "eval"))
    report["new"] = new
    report["unexpected"] = watch.unexpected
    report["metrics"] = dataclasses.asdict(observe.read_xla_metrics())
    report["summary"] = observe.xla_metrics_summary()

    report["disabled"] = [observe.start_profiler(0, 0) is None, observe.start_profiler(None, 1) is None]
    port = free_port()
    server = observe.start_profiler(port - 1, local_ordinal=1)
    report["profiler_port"] = port
    report["started"] = server is not None
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        report["connected"] = True
    report["second_start_refused"] = observe.start_profiler(port, local_ordinal=0) is None
    # A real capture from the server, as TensorBoard's profile plugin would request it.
    logdir = tempfile.mkdtemp()
    capture = threading.Thread(
        target=xp.trace, args=(f"localhost:{port}", logdir), kwargs={"duration_ms": 500}
    )
    capture.start()
    while capture.is_alive():
        forward(8)
    report["profiles"] = [
        name for _, _, names in os.walk(logdir) for name in names if name.endswith(".xplane.pb")
    ]
    report["log"] = records.messages

    # (runtime.device, here to share this process's torch_xla import.) Every xp.Trace entered
    # popped SKIP_MEGASCALE_PJRT_CLIENT from os.environ again, racing with threads that iterate
    # it (KeyError in a replica reading gs:// on the loader's thread); after the device loader,
    # a Trace leaves the key in place.
    from tpustream.runtime.device import MEGASCALE_SKIP, timed_parallel_loader

    os.environ.pop(MEGASCALE_SKIP, None)
    with xp.Trace("before"):
        pass
    report["megascale_before"] = os.environ.get(MEGASCALE_SKIP)
    report["loaded"] = len(list(timed_parallel_loader([torch.zeros(2)] * 3, device, None)))
    with xp.Trace("after"):
        pass
    report["megascale_after"] = os.environ.get(MEGASCALE_SKIP)
    del server
    print(json.dumps(report))


@pytest.fixture(scope="module")
def xla_report() -> dict:
    result = subprocess.run(
        [sys.executable, "-c", "from tests.test_observe import xla_scenario; xla_scenario()"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=str(REPO),
        env=xla_cpu_env(),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_importing_observe_does_not_import_torch_xla(xla_report):
    assert xla_report["torch_xla_imported_by_observe"] is False


def test_recompile_watch_on_xla_warns_exactly_for_the_new_shape(xla_report):
    # step 0 compiles (warm-up), step 1 reuses the graph, step 2 has a new shape,
    # the first eval batch compiles as announced.
    assert xla_report["new"] == [1, 0, 1, 1]
    assert xla_report["unexpected"] == 1
    warnings = [m for m in xla_report["log"] if m.startswith("WARNING") and "XLA compiled" in m]
    assert len(warnings) == 1
    assert warnings[0].startswith("WARNING train step 2: XLA compiled 1 new graph(s) (since train step 1)")


def test_metrics_summary_on_xla_counts_compilations_transfers_and_fallbacks(xla_report):
    metrics = xla_report["metrics"]
    assert metrics["compilations"] == 3  # lengths 8, 9, 10; the CPU fallback compiles nothing
    assert metrics["compile_seconds"] > 0
    assert metrics["executions"] >= 4
    assert metrics["to_device_bytes"] >= 1_000_000
    assert metrics["from_device_transfers"] >= 4
    assert metrics["item_calls"] >= 4
    assert metrics["cpu_fallbacks"].get("aten::linalg_eig") == 1
    assert "aten::_local_scalar_dense" not in metrics["cpu_fallbacks"]
    summary = xla_report["summary"]
    assert summary.startswith(f"XLA: {metrics['compilations']} compilations (")
    assert "CPU fallbacks: aten::linalg_eig x1" in summary
    assert "\n" not in summary


def test_the_device_loader_keeps_the_environments_keys_under_torch_xla_traces(xla_report):
    assert xla_report["megascale_before"] is None  # torch_xla's Trace pops what it set
    assert xla_report["loaded"] == 3
    assert xla_report["megascale_after"] == "true"  # restored, never popped: no key vanishes


def test_profiler_listens_on_port_plus_local_ordinal_and_serves_a_capture(xla_report):
    assert xla_report["disabled"] == [True, True]
    assert xla_report["started"] and xla_report["connected"]
    port = xla_report["profiler_port"]
    assert f"INFO XLA profiler listening on port {port};" in " ".join(xla_report["log"])
    assert xla_report["second_start_refused"]
    assert f"WARNING XLA profiler not started: port {port} is in use" in " ".join(xla_report["log"])
    assert len(xla_report["profiles"]) == 1
