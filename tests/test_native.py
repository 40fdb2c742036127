"""accelerator=cpu_eager: the native PyTorch runtime (the GPU path) on CPU processes over gloo.

Each run is `python train.py` with 2 replica processes x 1 DataLoader worker,
and torch_xla made unimportable: the native path must run on a machine
without it (a GPU machine). Checkpoints cross to and from the XLA CPU device.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import assert_same_run, run_train
from tpustream.checkpoint import checkpoint_url, load_checkpoint, read_metrics
from tpustream.data.read.stages import SHARD_ID_SHIFT
from tpustream.data.resolve.split import load_manifest
from tpustream.errors import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.slow
STEPS_PER_EPOCH = 12  # ceil(1438 / (64 x 2))


@pytest.fixture(scope="module")
def no_torch_xla(tmp_path_factory) -> dict[str, str]:
    """An environment in which importing torch_xla fails, in train.py and every process it starts."""
    folder = tmp_path_factory.mktemp("no_torch_xla")
    (folder / "torch_xla").mkdir()
    (folder / "torch_xla" / "__init__.py").write_text(
        'raise ImportError("torch_xla imported on the native path")\n'
    )
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}


def native(root: str, out: str, hydra_dir: str, *more: str) -> list[str]:
    return [
        "accelerator=cpu_eager",
        "accelerator.num_devices=2",
        f"data.root={root}",
        f"output_dir={out}",
        # In the replicas' own processes: a worker process (and its fork server) per replica
        # would add 4 processes importing torch to each run; the loader's workers are the same
        # code under every runtime, tested with XLA and the simulated pod.
        "data.num_workers=0",
        "epochs=3",
        f"hydra.run.dir={hydra_dir}",
        *more,
    ]


@pytest.fixture(scope="module")
def straight(digits_root, tmp_path_factory, no_torch_xla) -> Path:
    """3 epochs uninterrupted on 2 native replicas, every sample logged, replicas compared every step.

    Global steps 3-5 and epoch 1's evaluation are traced (torch.profiler), which changes no number.
    """
    out = tmp_path_factory.mktemp("native_straight")
    result = run_train(
        *native(digits_root, str(out / "run"), str(out / "h")),
        f"debug.sample_log_dir={out / 'samples'}",
        "debug.check_sync_every=1",
        "debug.profile_steps=[2,5]",
        "debug.profile_eval_epoch=1",
        env=no_torch_xla,
    )
    (out / "log.txt").write_text(result.stderr)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "launching CPU without XLA, 2 replica process(es) (gloo)" in result.stdout + result.stderr
    assert re.search(r"\[replica 1/2\] INFO tpustream.launch.replica: replica 1 of 2 on cpu", result.stderr)
    return out


def test_two_native_replicas_see_every_sample_once_in_equal_steps_and_learn(digits_root, straight):
    manifest = load_manifest(f"{digits_root}/train")
    expected = {
        (i << SHARD_ID_SHIFT) | j for i, shard in enumerate(manifest.shards) for j in range(shard.samples)
    }
    for epoch in range(3):
        logs = straight / "samples"
        per_replica = [np.load(logs / f"train-epoch{epoch:03d}-replica{r:03d}.npy") for r in (0, 1)]
        seen = Counter(int(i) for ids in per_replica for i in ids)
        assert set(seen) == expected and set(seen.values()) == {1}
    history = read_metrics(str(straight / "run"))
    assert [m["replica_steps"] for m in history] == [STEPS_PER_EPOCH] * 3
    assert all(m["train_samples"] == 1438 and m["val_samples"] == 359 for m in history)
    assert all(m["compilations"] == 0 for m in history)  # eager: nothing to compile
    # It learns (57% here after 36 steps of 128 samples; chance is 10%).
    assert max(m["val_accuracy"] for m in history) >= 0.35, history


def trace_events(folder: Path) -> list[dict]:
    """The events of the one torch.profiler trace in folder (a gzipped Chrome trace)."""
    (trace,) = folder.glob("*.pt.trace.json.gz")
    with gzip.open(trace, "rt") as handle:
        return json.load(handle)["traceEvents"]


def test_debug_profile_steps_traces_those_steps_and_their_input_waits_with_torch_profiler(straight):
    tensorboard = straight / "run" / "tensorboard"
    events = trace_events(tensorboard / "profile-steps-2-5")
    names = Counter(event.get("name") for event in events)
    assert {name for name in names if name.startswith("train step")} == {f"train step {s}" for s in (3, 4, 5)}
    assert names["input wait"] == 3  # the training thread's wait for each step's batch, marked
    assert names["aten::convolution"] >= 3  # forward, on the training thread
    assert names["autograd::engine::evaluate_function: ConvolutionBackward0"] >= 3  # autograd's thread
    steps = [e for e in events if e.get("name", "").startswith("train step")]
    waits = [e for e in events if e.get("name") == "input wait"]
    # Each wait lies inside its step's mark: the mark runs from one step's end to the next one's.
    for s in steps:
        assert sum(s["ts"] <= w["ts"] and w["ts"] + w["dur"] <= s["ts"] + s["dur"] for w in waits) == 1
    evaluation = Counter(event.get("name") for event in trace_events(tensorboard / "profile-eval-epoch-1"))
    assert evaluation["aten::convolution"] >= 1
    assert not any(str(name).startswith("train step") for name in evaluation)
    log = (straight / "log.txt").read_text()
    assert f"torch trace of global steps 3 to 5 in {tensorboard / 'profile-steps-2-5'} (Perfetto" in log


def test_fsdp2_stops_with_last_pt_exits_75_and_resumes_bitwise_on_the_ddp_trajectory(
    digits_root, straight, tmp_path, no_torch_xla
):
    """strategy=fsdp natively (PyTorch's FSDP2), stopped in epoch 1 and resumed.

    Its gradients are reduce-scattered instead of all-reduced, its weights and
    optimizer state are shards; with 2 replicas the average is the same sum,
    so the run must end bit for bit where the straight ddp run did, and its
    checkpoints hold the plain layout ddp writes and reads.
    """
    run = str(tmp_path / "run")
    fsdp = ("strategy=fsdp", "fsdp_wrap_min_params=2000")
    stop_at = STEPS_PER_EPOCH + 5
    stop = f"debug.stop_at_step={stop_at}"
    stopped = run_train(*native(digits_root, run, str(tmp_path / "h1"), *fsdp, stop), env=no_torch_xla)
    assert stopped.returncode == PREEMPTED_EXIT_CODE, stopped.stderr[-4000:]
    # small_cnn's 2 convolutions of 2000+ parameters, and the model's unit for the rest.
    assert "strategy=fsdp (FSDP2): FSDP units: 3 (submodules of 2000+ parameters" in stopped.stderr
    saved = load_checkpoint(checkpoint_url(run, "last.pt"))
    # The replicas agree on a stop at their next vote (checkpoint.stop_check_every steps).
    epoch, step = saved["position"]["epoch"], saved["position"]["step"]
    assert epoch == 1 and 0 < step < STEPS_PER_EPOCH and saved["global_step"] == STEPS_PER_EPOCH + step
    assert saved["global_step"] >= stop_at
    # Whole tensors in ddp's layout: the model's own keys and shapes, optimizer state per parameter.
    reference = load_checkpoint(checkpoint_url(str(straight / "run"), "last.pt"))
    assert {k: v.shape for k, v in saved["model"].items()} == {
        k: v.shape for k, v in reference["model"].items()
    }
    shapes = [s["momentum_buffer"].shape for s in saved["optimizer"]["state"].values()]
    assert shapes == [s["momentum_buffer"].shape for s in reference["optimizer"]["state"].values()]

    resumed = run_train(*native(digits_root, run, str(tmp_path / "h2"), *fsdp), env=no_torch_xla)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"at epoch 1, step {step}" in resumed.stderr and "starts fresh" not in resumed.stderr
    assert_same_run(run, str(straight / "run"), steps=3 * STEPS_PER_EPOCH)


def test_checkpoints_cross_between_native_and_xla(digits_root, straight, tmp_path, no_torch_xla):
    # Native -> XLA: the XLA CPU device evaluates the native run's best.pt to the same accuracy.
    best = load_checkpoint(checkpoint_url(str(straight / "run"), "best.pt"))
    record = next(m for m in read_metrics(str(straight / "run")) if m["epoch"] == best["epoch"])
    evaluated = run_train(
        f"data.root={digits_root}",
        f"output_dir={tmp_path / 'eval'}",
        f"resume={checkpoint_url(str(straight / 'run'), 'best.pt')}",
        "eval_only=true",
        "data.num_workers=0",
        "accelerator.in_process=true",
        f"hydra.run.dir={tmp_path / 'h1'}",
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    match = re.search(
        r"evaluation of the checkpoint from epoch \d+: accuracy=[\d.]+% \((\d+)/359\)",
        evaluated.stderr,
    )
    # Eager and XLA kernels may round differently: a sample on the decision boundary may flip.
    assert match and abs(int(match.group(1)) - record["val_correct"]) <= 2

    # XLA -> native: a native run continues a run folder the XLA device started.
    run = str(tmp_path / "run")
    first = run_train(
        f"data.root={digits_root}",
        f"output_dir={run}",
        "epochs=1",
        "data.num_workers=0",
        "accelerator.in_process=true",
        f"hydra.run.dir={tmp_path / 'h2'}",
    )
    assert first.returncode == 0, first.stderr[-3000:]
    continued = run_train(
        "accelerator=cpu_eager",
        f"data.root={digits_root}",
        f"output_dir={run}",
        "epochs=2",
        "optim.on_epochs_change=stretch",  # the cosine redrawn over both epochs
        "data.num_workers=auto",  # at an epoch's end the count is free: measured and chosen anew
        f"hydra.run.dir={tmp_path / 'h3'}",
        env=no_torch_xla,
    )
    assert continued.returncode == 0, continued.stderr[-3000:]
    assert re.search(r"data.num_workers=auto: \d+ \(one worker delivers \d+ samples/s", continued.stdout)
    assert "at epoch 1, step 0" in continued.stderr
    history = read_metrics(run)
    assert [m["epoch"] for m in history] == [0, 1]
    assert history[1]["train_loss"] < history[0]["train_loss"]


def test_channels_last_lays_out_the_model_and_every_batch_and_compile_keeps_the_state_dict():
    import torch

    from tpustream.models import create_model
    from tpustream.runtime.native import NativeRuntime

    runtime = NativeRuntime(0, 1, 0, torch.device("cpu"), channels_last=True, compile=True)
    model = create_model("small_cnn", num_classes=10, image_size=32, channels=3)
    keys = list(model.state_dict())
    prepared = runtime.prepare_model(model)
    conv = next(p for p in prepared.parameters() if p.dim() == 4)
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    # Compiled in place: the same keys, so checkpoints move between compiled and plain runs.
    assert prepared is model and list(prepared.state_dict()) == keys
    assert prepared._compiled_call_impl is not None
    batch = {"image": torch.zeros(2, 3, 32, 32, dtype=torch.uint8), "label": torch.zeros(2)}
    (moved,) = runtime.device_loader([batch])
    assert moved["image"].is_contiguous(memory_format=torch.channels_last)


def test_native_layout_and_compile_are_refused_under_xla():
    from tpustream.config import AcceleratorConfig
    from tpustream.errors import ConfigError

    with pytest.raises(ConfigError, match="accelerator.compile is the native runtime's"):
        AcceleratorConfig(compile=True).check()


def test_a_batch_is_copied_on_its_own_stream_and_the_step_waits_for_that_copy(monkeypatch):
    """runtime.native._CopyStream's order, with stand-in streams and events (no GPU here)."""
    import contextlib

    import torch

    from tpustream.runtime import native

    log: list[tuple[str, str, int]] = []

    class Stream:
        def __init__(self, name: str):
            self.name = name

        def wait_event(self, event) -> None:
            log.append(("wait", self.name, event.number))

    compute = Stream("compute")
    current = [compute]

    class Event:
        made = 0

        def __init__(self):
            Event.made += 1
            self.number = Event.made

        def record(self) -> None:
            log.append(("record", current[-1].name, self.number))

    @contextlib.contextmanager
    def on(stream):
        current.append(stream)
        yield
        current.pop()

    monkeypatch.setattr(torch.cuda, "Stream", lambda device: Stream("copy"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    copies = native._CopyStream(torch.device("cuda", 0))
    queued_on = []

    def place(batch):
        queued_on.append(current[-1].name)
        return batch

    first = copies.place(place, {"image": torch.zeros(1)})
    second = copies.place(place, {"image": torch.ones(1)})
    assert queued_on == ["copy", "copy"] and current == [compute]
    assert copies.ready(*first)["image"].item() == 0
    assert copies.ready(*second)["image"].item() == 1
    # Each copy's event is recorded on the copy stream; the compute stream waits for it
    # just before the batch is handed over, and not for a later batch's copy.
    assert log == [
        ("record", "copy", 1),
        ("record", "copy", 2),
        ("wait", "compute", 1),
        ("wait", "compute", 2),
    ]


def test_the_native_runtime_reaches_a_device_through_its_device_module(monkeypatch):
    """No CUDA by name: another backend whose module has CUDA's calls (torch.xpu, ...) runs as it is."""
    import types

    import torch

    from tpustream.runtime import native as runtime_module

    calls = []
    state = torch.tensor(list(range(16)), dtype=torch.uint8)
    fake = types.SimpleNamespace(
        set_device=lambda index: calls.append(("set_device", index)),
        get_device_name=lambda device: "Fake Accelerator",
        get_rng_state=lambda device: state.clone(),
        set_rng_state=lambda value, device: calls.append(("set_rng_state", bytes(value.tolist()))),
        manual_seed=lambda seed: calls.append(("manual_seed", seed)),
    )
    monkeypatch.setattr(torch, "get_device_module", lambda device=None: fake)
    device = runtime_module.native_device("XPU", 1)
    assert device == torch.device("xpu", 1) and calls == [("set_device", 1)]
    assert runtime_module.native_device("CPU", 1) == torch.device("cpu")
    runtime = runtime_module.NativeRuntime(0, 1, 1, device)
    assert runtime.accelerator_type() == "Fake Accelerator"
    saved = runtime.rng_state()
    assert saved == int.from_bytes(bytes(range(16)), "little")
    runtime.set_rng_state(saved)
    runtime.set_rng_state(7)  # a seed: an XLA run's checkpoint
    assert calls[1:] == [("set_rng_state", bytes(range(16))), ("manual_seed", 7)]
