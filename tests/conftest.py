"""Shared fixtures: GCS emulator, digits shards, hand-made tar shards, Hydra composition, fake replicas."""

from __future__ import annotations

import copy
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tests import zygote
from tests.fault_proxy import FaultProxy
from tpustream import storage
from tpustream.data.format.manifest import MANIFEST_FORMAT, MANIFEST_NAME
from tpustream.data.format.tar import write_tar
from tpustream.data.write.command import main as make_shards_main
from tpustream.launch.spawn import xla_cpu_flags
from tpustream.runtime.gloo import free_port  # noqa: F401  (the tests' one free-port helper)
from tpustream.testing.emulator import GcsEmulator

REPO = Path(__file__).resolve().parent.parent


def pytest_configure(config):
    share_cores_among_workers()


def share_cores_among_workers() -> None:
    """An xdist worker, and every process its tests start, take the worker's share of the cores for OpenMP.

    The workers run side by side, each on about one core of this project's 2,
    and every eager step of theirs (in process, in train.py, in its replicas)
    otherwise spread its ops over both cores, whose OpenMP threads spin while
    they wait for each other. Measured (2026-11-29): the suite in 13:40 and
    12:50 with one thread for each worker's processes (20.5 and 19.3
    CPU-minutes of user time), 14:42 in the run before with neither this nor
    the replicas' share (22.8); the same code varies by a minute here.
    The replicas' own share (launch.spawn.share_host_threads) steps aside for
    the OMP_NUM_THREADS set here; one set by the caller wins over both.
    """
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1 or os.environ.get("OMP_NUM_THREADS"):
        return
    import torch

    from tpustream.observe.advice import usable_cpus

    threads = max(1, usable_cpus() // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Group the tests for pytest-xdist (README: pytest -n auto --dist loadgroup).

    Tests that share a module-scoped fixture (a reference training run) go to
    one worker together, so the run is made once. This hook must run before
    xdist's own (tryfirst), which reads the marks into the node ids it
    schedules by, and pytest must be older than 9.2, whose node ids ignore
    that (pytest-dev/pytest-xdist#1386; pyproject pins it). Without either,
    every test was its own group, measured: a module's fixture runs were made
    again on the other worker, and again after another module's test ran
    between two of its tests (pytest tears module fixtures down there).

    The order stays the files': putting the slow files first (to even out the
    workers' ends) measured 2.5 minutes slower on 2 cores, as two XLA training
    processes then always shared them (measured before the groups worked).
    A worker more than the cores (to fill the waits on processes) measured
    slower too: 18:00 (with two bench runs fewer) vs 17:08, 29.2 vs 26.9
    CPU-minutes of user time; on 2026-11-29, 15:28 and then 16:35, against
    16:15-16:52 with a worker a core: no gain to count on.
    """
    for item in items:
        definitions = getattr(item, "_fixtureinfo", None)
        if definitions is None:
            continue
        if any(defs[-1].scope == "module" for defs in definitions.name2fixturedefs.values()):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


@pytest.fixture(scope="session")
def gcs_emulator():
    """fake-gcs-server on 127.0.0.1 for the whole session; STORAGE_EMULATOR_HOST is set."""
    with GcsEmulator() as emulator:
        yield emulator


@pytest.fixture
def faulty_gcs():
    """A fresh emulator behind a fault-injecting proxy, with bucket gs://faulty; yields the proxy."""
    emulator = GcsEmulator()
    proxy = FaultProxy(emulator.port, fault_rate=0.0, seed=1).start()
    emulator.public_url = proxy.url
    with emulator:
        storage.make_container("gs://faulty")
        yield proxy
    proxy.stop()


@pytest.fixture
def bucket(gcs_emulator) -> str:
    """A fresh, empty bucket; returns 'gs://<name>'."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    storage.make_container(f"gs://{name}")
    return f"gs://{name}"


@pytest.fixture
def digits_bucket(bucket) -> str:
    """A fresh bucket holding the digits shards under digits/."""
    assert make_shards_main(["digits", f"{bucket}/digits", "--no-progress", "--workers", "1"]) == 0
    return bucket


@pytest.fixture(scope="session")
def digits_root(tmp_path_factory) -> str:
    """Local digits shards (train 1438, test 359 samples, 256 per shard)."""
    root = str(tmp_path_factory.mktemp("digits") / "digits")
    assert make_shards_main(["digits", root, "--no-progress", "--workers", "1"]) == 0
    return root


def png_bytes(image_chw: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(image_chw.transpose(1, 2, 0)).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="session")
def photo() -> Image.Image:
    """A real photograph (scikit-learn's china.jpg, 640x427): JPEG statistics, not synthetic ones."""
    from sklearn.datasets import load_sample_images

    return Image.fromarray(load_sample_images().images[0])


def encode_image(image: Image.Image, fmt: str = "JPEG", **options) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue()


def solid_image(value: int, size: int = 8) -> np.ndarray:
    """A uint8 (3, size, size) image filled with value: its pixels identify the sample."""
    return np.full((3, size, size), value, np.uint8)


ShardWriter = Callable[..., str]


@pytest.fixture
def write_split(tmp_path) -> ShardWriter:
    """Write a split by hand: shards of (key, {ext: bytes}) samples plus a manifest.

    write_split("train", [[("k0", {"png": b, "cls": b"1"}), ...], ...], image_size=8)
    returns the split folder. counts= overrides the manifest's per-shard counts
    (to describe shards that lost samples).
    """

    def write(
        split: str,
        shards: list[list[tuple[str, dict[str, bytes]]]],
        *,
        image_size: int = 8,
        image_format: str = "png",
        num_classes: int = 10,
        counts: list[int] | None = None,
        root: str | None = None,
        raw_tars: dict[int, bytes] | None = None,
    ) -> str:
        folder = storage.join(root or str(tmp_path / "shards"), split)
        entries = []
        for index, samples in enumerate(shards):
            name = f"{split}-{index:06d}.tar"
            members: Iterable[tuple[str, bytes]] = (
                (f"{key}.{ext}", data) for key, fields in samples for ext, data in fields.items()
            )
            data = write_tar(members)
            if raw_tars and index in raw_tars:
                data = raw_tars[index]
            storage.write_bytes(storage.join(folder, name), data)
            entries.append({"name": name, "samples": counts[index] if counts else len(samples)})
        manifest = {
            "format": MANIFEST_FORMAT,
            "split": split,
            "num_samples": sum(e["samples"] for e in entries),
            "classes": [str(c) for c in range(num_classes)],
            "image_size": [image_size, image_size],
            "channels": 3,
            "image_format": image_format,
            "shards": entries,
        }
        storage.write_bytes(storage.join(folder, MANIFEST_NAME), json.dumps(manifest).encode())
        return folder

    return write


def numbered_samples(start: int, count: int, size: int = 8) -> list[tuple[str, dict[str, bytes]]]:
    """Samples whose image value and label encode their index (value = index % 256)."""
    return [
        (f"{i:06d}", {"png": png_bytes(solid_image(i % 256, size)), "cls": str(i % 10).encode()})
        for i in range(start, start + count)
    ]


def train_command(*overrides: str) -> list[str]:
    return [sys.executable, str(REPO / "train.py"), *overrides]


def xla_cpu_env(devices: int = 1) -> dict[str, str]:
    """The environment of a script run on XLA CPU devices in its own process, as the launcher sets it."""
    flags = xla_cpu_flags(os.environ.get("XLA_FLAGS"))
    return {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices), "XLA_FLAGS": flags}


def run_train(
    *overrides: str, env: dict[str, str] | None = None, timeout: int = 600
) -> subprocess.CompletedProcess:
    """Run train.py in a process of its own (XLA tests must not share a process with eager backward).

    Like subprocess.run(capture_output=True, text=True); the process is a
    fork of a zygote that has imported torch and torch_xla (tests/zygote.py).
    """
    return zygote.run(train_command(*overrides), cwd=REPO, env={**os.environ, **(env or {})}, timeout=timeout)


def popen_train(command: list[str], **popen: Any) -> subprocess.Popen | zygote.ZygoteChild:
    """subprocess.Popen(command, cwd=REPO, text=True, **popen) for a train.py command, forked from a zygote.

    popen: env, stdout, stderr (None, PIPE or, for stderr, STDOUT), start_new_session.
    """
    return zygote.start(command, cwd=REPO, **popen)


def assert_same_run(run: str, reference: str, steps: int) -> None:
    """Two run folders hold the same training: last.pt bit for bit after `steps` steps, the same records."""
    import torch

    from tpustream.checkpoint import checkpoint_url, load_checkpoint, read_metrics

    got, want = (
        load_checkpoint(checkpoint_url(run, "last.pt")),
        load_checkpoint(checkpoint_url(reference, "last.pt")),
    )
    assert got["global_step"] == want["global_step"] == steps
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), f"{name} differs"  # bitwise
    assert (got.get("ema") is None) == (want.get("ema") is None)
    for name, tensor in (want.get("ema") or {}).items():
        assert torch.equal(got["ema"][name], tensor), f"the average's {name} differs"
    for a, b in zip(got["optimizer"]["state"].values(), want["optimizer"]["state"].values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in b)
    for mine, theirs in zip(read_metrics(run), read_metrics(reference), strict=True):
        for key in ("val_correct", "val_samples", "train_samples", "replica_steps", "epoch"):
            assert mine[key] == theirs[key], key
        assert mine.get("ema_val_correct") == theirs.get("ema_val_correct")
        # Reduction order differs once an epoch is split across two runs.
        assert mine["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-6)


def sigterm_at_step(command: list[str], target: int, steps_per_epoch: int) -> tuple[int, str]:
    """Run train.py in a session of its own; SIGTERM its whole group once it logs global step `target`.

    As on a preempted VM, every process gets the signal. Returns the exit
    code and stderr. The signal goes at the first logged step at or past the
    target, so the command should log every step (log_steps=1) for an exact one.
    """
    process = popen_train(command, stderr=subprocess.PIPE, start_new_session=True)
    lines = []
    deadline = time.time() + 300
    for line in process.stderr:
        lines.append(line)
        match = re.search(r"Epoch=(\d+) Step=(\d+) Loss", line)
        if match and int(match.group(1)) * steps_per_epoch + int(match.group(2)) >= target:
            os.killpg(process.pid, signal.SIGTERM)
            break
        assert time.time() < deadline, "the run did not reach the target step"
    lines.extend(process.stderr)
    return process.wait(timeout=300), "".join(lines)


@pytest.fixture
def compose_config():
    """Compose conf/config.yaml with overrides through Hydra, as train.py would."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from tpustream.config import register_configs

    register_configs()

    def compose_with(*overrides: str):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            return compose(
                config_name="config",
                overrides=["output_dir=/tmp/unused", "log_dir=null", *overrides],
            )

    yield compose_with
    GlobalHydra.instance().clear()


def write_wds_shards(
    folder: str,
    pattern: str,
    count: int,
    *,
    maxcount: int,
    image_field: str = "ppm",
    size: int = 8,
    start: int = 0,
) -> list[str]:
    """Shards written by webdataset's own ShardWriter, without a manifest: as users' shards are.

    Samples as the reference CIFAR notebook writes them: key "%07d" % i, a PIL
    image under image_field, cls an int; pixel value i % 256 and label i % 10.
    """
    import webdataset as wds

    os.makedirs(folder, exist_ok=True)
    with wds.ShardWriter(os.path.join(folder, pattern), maxcount=maxcount, verbose=0) as sink:
        for i in range(start, start + count):
            image = Image.fromarray(solid_image(i % 256, size).transpose(1, 2, 0))
            sink.write({"__key__": f"{i:07d}", image_field: image, "cls": i % 10})
    return sorted(os.listdir(folder))


@dataclass
class FakeJob:
    """What a simulated job left: per replica, fit()'s result or the exception it raised, and its trainer."""

    results: list[Any]
    trainers: list[Any]
    world: Any

    @property
    def master(self):
        return self.trainers[0]


@pytest.fixture
def fake_job(monkeypatch):
    """Run the trainer on world_size replica threads on the CPU (tests/fake_runtime.py).

    fake_job(cfg, world_size=2, resume_from=(state, url), stop_at=(rank, split, epoch, batch),
    trainer_class=Trainer) -> FakeJob. Eager only: never in a process that runs XLA backward.
    """
    from tests.fake_runtime import FakeWorld, MemorySource, run_replicas, tiny_model, tiny_split
    from tpustream import preemption
    from tpustream.training import make_trainer

    train_data, val_data = tiny_split(96, seed=1), tiny_split(18, seed=2)

    def run(
        cfg, world_size: int = 1, resume_from=None, stop_at=None, trainer_class=None, **extras
    ) -> FakeJob:
        """extras: accelerator_type (a pretend TPU), input_delay (seconds per training batch), model_flops,
        model (a function building each replica's model; tiny_model)."""
        world = FakeWorld(world_size, accelerator_type=extras.pop("accelerator_type", None))
        input_delay = extras.pop("input_delay", 0.0)
        build_model = extras.pop("model", tiny_model)
        monkeypatch.setattr(preemption, "stop_requested", world.stop_requested)
        monkeypatch.setattr(preemption, "request_stop", world.request_stop)
        # Built here, not on the replica threads, which would share torch's seeded generator.
        models = [build_model() for _ in range(world_size)]
        trainers: list[Any] = [None] * world_size

        def replica(runtime):
            def source(split: str, data, shuffle: bool) -> MemorySource:
                stop = stop_at[2:] if stop_at and stop_at[:2] == (runtime.rank, split) else None
                draws = None
                if shuffle and cfg.augment.active():
                    from tpustream.augment.draws import BatchDraws

                    draws = BatchDraws(cfg.augment, (8, 8), 3, group=cfg.batch_size, seed=cfg.seed)
                return MemorySource(
                    *data,
                    batch_size=cfg.batch_size,
                    rank=runtime.rank,
                    world_size=world_size,
                    shuffle=shuffle,
                    seed=cfg.seed,
                    stop_at_batch=stop,
                    draws=draws,
                    delay=input_delay if shuffle else 0.0,
                )

            build = trainer_class or make_trainer
            args = (cfg, {"seed": cfg.seed, "batch_size": cfg.batch_size}, runtime, models[runtime.rank])
            trainer = build(
                *args,
                source("train", train_data, True),
                source("validation", val_data, False),
                # Each replica reads its own copy, as in a run: optimizer.load_state_dict
                # keeps CPU tensors as they are, so replicas would share momentum buffers.
                resume_from=copy.deepcopy(resume_from),
                **extras,
            )
            trainers[runtime.rank] = trainer
            return trainer.fit()

        return FakeJob(run_replicas(world, replica), trainers, world)

    return run


# ShardStream's own arguments; every other keyword of make_stream is a data.* field.
STREAM_ARGUMENTS = ("batch_size", "rank", "world_size", "train", "seed")


def make_stream(manifest, **options):
    """ShardStream from keyword options, the data.* ones as a DataConfig (shuffle_buffer 0 unless given)."""
    import dataclasses

    from tpustream.config import DataConfig
    from tpustream.data.read.stream import ShardStream

    arguments = {name: options.pop(name) for name in STREAM_ARGUMENTS}
    # The training order's CanonicalPartition, and the device augmentation's config and group.
    extras = {
        name: options.pop(name) for name in ("partition", "augment", "augment_group") if name in options
    }
    data = dataclasses.replace(DataConfig(), **{"shuffle_buffer": 0, **options})
    return ShardStream(manifest, data, **extras, **arguments)


def crop_stream(split, workers: int, train: bool, **options):
    """One replica's ShardStream of random-resized crops: batch 8, seed 3, shuffle buffer 16."""
    return make_stream(
        split,
        batch_size=8,
        rank=0,
        world_size=1,
        num_workers=workers,
        train=train,
        seed=3,
        shuffle_buffer=16,
        train_crop="random_resized",
        **options,
    )
