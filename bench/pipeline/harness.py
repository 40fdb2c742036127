"""What the input-pipeline benchmark's datasets share: pass timing, foreign load, the rows, the stock loaders.

A dataset module (bench.pipeline.cifar, bench.pipeline.imagenet) supplies its
data and its configurations and composes its run from these parts; tables and
charts are in bench.pipeline.report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import io
import itertools
import json
import os
import platform
import resource
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
import torchvision
import webdataset as wds
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder

from tpustream import storage
from tpustream.config import AugmentConfig, DataConfig
from tpustream.data.format.tar import iter_shard_samples
from tpustream.data.read.stages import ErrorPolicy, augment_batches, batch_samples, decode_samples
from tpustream.data.read.stream import ShardStream
from tpustream.testing.emulator import GcsEmulator

Batch = tuple | list | dict
Epoch = Callable[[], Iterator[Batch]]  # each call starts one pass over the data

BENCH = Path(__file__).resolve().parent.parent  # bench/: results/ lives here
BATCH_SIZE = 128
NUM_CLASSES = 10
SEED = 0
WORKER_COUNTS = (0, 2)
SHARD_SHUFFLE = 100  # WebDataset(shardshuffle=...) of the stock chains (B, C)
B_BATCHING = "WebDataset.batched(128) + DataLoader(batch_size=None)"


# ----------------------------------------------------------------------- timing


def batch_length(batch: Batch) -> int:
    return len(batch["label"]) if isinstance(batch, dict) else len(batch[1])


def timed_pass(epoch: Epoch) -> tuple[int, float]:
    """(samples after the first batch, seconds from the first batch to the last)."""
    batches = epoch()
    next(batches)  # start-up (workers, first shuffle buffer) ends here
    start = time.perf_counter()
    samples = sum(batch_length(batch) for batch in batches)
    return samples, time.perf_counter() - start


def measure(epoch: Epoch, min_seconds: float, warmup_batches: int | None = None) -> dict:
    """Timed passes until min_seconds are measured, after an untimed warm-up.

    The warm-up (page cache, lazy imports, emulator connections) is a whole
    pass, or its first warmup_batches batches where a pass is long: an
    abandoned pass shuts its DataLoader workers down, or, when they are
    persistent, the next pass resets them.
    """
    if warmup_batches is None:
        timed_pass(epoch)
    else:
        for _ in itertools.islice(epoch(), warmup_batches):
            pass
    samples, seconds, passes = 0, 0.0, 0
    while seconds < min_seconds:
        s, t = timed_pass(epoch)
        samples, seconds, passes = samples + s, seconds + t, passes + 1
    return {"samples": samples, "seconds": seconds, "passes": passes, "samples_per_s": samples / seconds}


class ForeignCpu:
    """Cores used by programs other than this benchmark while a configuration runs.

    The machine may be shared (other test runs), and with 2 cores any foreign
    load shows up in samples/s, so every row records it: system-wide busy CPU
    seconds minus those of this process, its reaped children (DataLoader
    workers, once shut down) and the GCS emulator, per wall second.
    """

    def __init__(self):
        self.emulators = [p for p in psutil.Process().children() if "fake-gcs" in p.name()]

    def _busy(self) -> float:
        t = psutil.cpu_times()
        return sum(t) - t.idle - t.iowait - t.guest - t.guest_nice  # guest time is also in user

    def _ours(self) -> float:
        own = resource.getrusage(resource.RUSAGE_SELF)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        total = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
        return total + sum(sum(p.cpu_times()[:2]) for p in self.emulators)

    def _now(self) -> tuple[float, float, float]:
        return time.perf_counter(), self._busy(), self._ours()

    def __enter__(self) -> ForeignCpu:
        self.start = self._now()
        return self

    def __exit__(self, *exc_info) -> None:
        wall, busy, ours = (now - then for now, then in zip(self._now(), self.start, strict=True))
        self.cores = max(0.0, busy - ours) / wall


# ------------------------------------------------------------------------- rows


@dataclass(frozen=True)
class Config:
    """One configuration: build(data, workers, ...) returns its epoch."""

    name: str
    build: Callable[..., Epoch]
    workers: tuple[int, ...] = WORKER_COUNTS  # () marks a single-process limit


def measure_row(
    label: str, build: Callable[[], Epoch], min_seconds: float, warmup_batches: int | None
) -> dict:
    """One configuration's measurement (see measure) and the foreign load meanwhile, printed as it ends."""
    print(f"  {label:<24}", end="", flush=True)
    with ForeignCpu() as foreign:
        result = measure(build(), min_seconds, warmup_batches)
        gc.collect()  # shut down (and reap) persistent DataLoader workers
    print(f"{result['samples_per_s']:>8.0f} samples/s  (other load {foreign.cores:.2f} cores)", flush=True)
    return {**result, "foreign_cores": foreign.cores}


def measure_configs(
    configs: Sequence[Config],
    build: Callable[[Config, int], Epoch],
    min_seconds: float,
    warmup_batches: int | None = None,
    mode: str | None = None,
) -> list[dict]:
    """A row per configuration and worker count (None for a limit); rows carry "mode" when one is given."""
    rows = []
    for config in configs:
        for workers in config.workers or (None,):
            words = [config.name, *([mode] if mode else []), *([] if workers is None else [f"w={workers}"])]
            label = " ".join(words)
            keys = {"name": config.name, **({"mode": mode} if mode else {}), "workers": workers}
            epoch = functools.partial(build, config, workers or 0)
            rows.append({**keys, **measure_row(label, epoch, min_seconds, warmup_batches)})
    return rows


def find_config(configs: Sequence[Config], name: str) -> Config:
    config = next((c for c in configs if c.name == name), None)
    if config is None:
        raise ValueError(f"unknown configuration {name!r}; one of {[c.name for c in configs]}")
    return config


def profile(name: str, epoch: Epoch, top: int = 25) -> None:
    """cProfile one pass of a configuration's epoch in this process, after a warm-up pass."""
    import cProfile
    import pstats

    timed_pass(epoch)
    profiler = cProfile.Profile()
    profiler.enable()
    samples, seconds = timed_pass(epoch)
    profiler.disable()
    print(f"\n=== {name} (0 workers): {samples} samples in {seconds:.2f} s under cProfile")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


# ----------------------------------------------------------------- the loaders


def in_batches(items: list, labels: list[int]) -> Iterator[tuple[list, list[int]]]:
    for start in range(0, len(items), BATCH_SIZE):
        yield items[start : start + BATCH_SIZE], labels[start : start + BATCH_SIZE]


def stock_limit(encoded: list[bytes], labels: list[int], transform: Callable) -> Epoch:
    """L: PIL decode + convert("RGB") + stock transforms + torch.stack from in-memory bytes."""

    def epoch() -> Iterator[Batch]:
        for batch, batch_labels in in_batches(encoded, labels):
            images = [transform(Image.open(io.BytesIO(data)).convert("RGB")) for data in batch]
            yield torch.stack(images), torch.tensor(batch_labels)

    return epoch


def memory_samples(image_key: str, keys: list[str], encoded: list[bytes], labels: list[int]) -> list[dict]:
    """Sample dicts as read_span_samples yields them, minus the tar and the I/O."""
    return [
        {
            "__key__": key,
            "__url__": "memory",
            image_key: data,
            "cls": str(label).encode(),
            "__padding__": False,
            "__id__": index,
        }
        for index, (key, data, label) in enumerate(zip(keys, encoded, labels, strict=True))
    ]


def ours_in_memory(
    samples: list[dict], decoder, shape: Sequence[int], rng: np.random.Generator | None, crop_padding: int
) -> Iterator[dict[str, torch.Tensor]]:
    """tpustream's decode, batching and batch augmentation stages (uint8 batches) on in-memory samples.

    Full batches only, like ShardStream(last_batch="drop"); rng None: no augmentation.
    """
    policy = ErrorPolicy("raise")
    decoded = decode_samples(samples, decoder, policy)
    batches = batch_samples(decoded, BATCH_SIZE, len(samples) // BATCH_SIZE, shape, policy)
    return augment_batches(batches, rng, crop_padding, rng is not None)


def image_folder(root: str, transform: Callable, shuffle: bool, workers: int) -> Epoch:
    """A: torchvision ImageFolder over one file per image, DataLoader collation."""
    dataset = ImageFolder(root, transform=transform)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=shuffle, num_workers=workers)
    return lambda: iter(loader)


def stock_webdataset(
    urls: list[str], image_key: str, transform: Callable, workers: int, shuffle_buffer: int | None
) -> Epoch:
    """B / C: the stock WebDataset chain, batching in each worker; no shuffle_buffer: no shuffling at all.

    WebDataset(urls, shardshuffle=100).shuffle(shuffle_buffer).decode("pil")
    .to_tuple(image_key, "cls").map_tuple(transform, int).batched(128) in
    DataLoader(batch_size=None), as the WebDataset examples do: sending
    single samples between processes is slow.
    """
    dataset = wds.WebDataset(urls, shardshuffle=SHARD_SHUFFLE if shuffle_buffer else False)
    if shuffle_buffer:
        dataset = dataset.shuffle(shuffle_buffer)
    dataset = dataset.decode("pil").to_tuple(image_key, "cls").map_tuple(transform, int).batched(BATCH_SIZE)
    loader = DataLoader(dataset, batch_size=None, num_workers=workers)
    return lambda: iter(loader)


def make_stream(
    split,
    workers: int,
    shuffle_buffer: int,
    train: bool = True,
    augment: AugmentConfig | None = None,
    **crops: Any,
) -> ShardStream:
    """ShardStream as the trainer builds it for one replica (last_batch="drop": every sample distinct).

    augment: the device augmentation whose draws each training batch carries (bench.augment).
    """
    data = dataclasses.replace(
        DataConfig(),
        num_workers=workers,
        shuffle_buffer=shuffle_buffer,
        last_batch="drop",
        hflip=True,
        **crops,
    )
    return ShardStream(
        split, data, batch_size=BATCH_SIZE, rank=0, world_size=1, train=train, seed=SEED, augment=augment
    )


# ---------------------------------------------------------------------- storage


def gopen_via_tpustream(url: str, mode: str = "rb", bufsize: int = 8192, **kw):
    """A webdataset gopen handler (gopen_schemes entry) that streams gs:// in-process."""
    if mode != "rb":
        raise ValueError(f"{url}: only reading is supported, not mode {mode!r}")
    return storage.open_read(url)


def start_run() -> None:
    """One torch thread, and webdataset opening gs:// with tpustream.storage instead of `gsutil cat`.

    The single-process configurations get one core, like each DataLoader
    worker. webdataset maps gs:// to a `gsutil cat` subprocess, and gsutil is
    not installed here; DataLoader workers are forked, so they inherit the
    gopen_schemes entry.
    """
    torch.set_num_threads(1)
    sys.modules["webdataset.gopen"].gopen_schemes["gs"] = gopen_via_tpustream
    warnings.filterwarnings("ignore", message=".*shardshuffle.*")


@contextlib.contextmanager
def run_storage(prefix: str) -> Iterator[tuple[str, str, str]]:
    """(a temporary folder, a fresh bucket, the emulator's URL) while the benchmark runs."""
    with tempfile.TemporaryDirectory(prefix=prefix) as workdir, GcsEmulator() as emulator:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        storage.make_container(f"gs://{bucket}")
        yield workdir, bucket, emulator.url


def samples_per_shard(num_images: int, most: int) -> int:
    """At least 2 shards per DataLoader worker, as a real dataset would have."""
    return min(most, num_images // (2 * max(WORKER_COUNTS)))


def upload(folder: str, target: str) -> list[str]:
    """Copy the files of a local folder to a gs:// prefix; their names."""
    names = storage.list_names(folder)
    for name in names:
        storage.write_bytes(storage.join(target, name), storage.read_bytes(os.path.join(folder, name)))
    return names


def check_members(url: str, image_key: str, encoded: Iterable[bytes]) -> None:
    """The shard must hold the very bytes the in-memory configurations decode."""
    with storage.open_read(url) as stream:
        if not {sample[image_key] for sample in iter_shard_samples(stream, url)} <= set(encoded):
            raise RuntimeError(f"{url}: {image_key} members differ from the in-memory image bytes")


# ---------------------------------------------------------------------- results


def environment() -> dict:
    import PIL

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "webdataset": wds.__version__,
        "pillow": PIL.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }


def print_method(timing: str) -> None:
    print(
        f"B/C batching: {B_BATCHING}\n"
        "C reads gs:// through an in-process webdataset gopen handler (tpustream.storage.open_read) "
        "because gsutil is unavailable\n"
        f"timing: {timing}, then passes timed from their first batch (DataLoader worker start-up "
        "excluded); 'other load' = cores busy with other programs meanwhile",
        flush=True,
    )


def settings(head: dict, timing: str, min_seconds: float, mean, std, tail: dict) -> dict:
    """results.json's "settings": the dataset's own (head, tail) around those every dataset has."""
    return {
        "batch_size": BATCH_SIZE,
        **head,
        "mean": mean,
        "std": std,
        "torch_threads": 1,
        "min_seconds": min_seconds,
        "timing": timing,
        "foreign_cores": "CPU cores used by other programs during the configuration (shared machine)",
        "B_C_batching": B_BATCHING,
        "C_opener": "in-process gs:// gopen handler -> tpustream.storage.open_read (no gsutil)",
        "ours_last_batch": "drop",
        **tail,
    }


def write_results(out: Path, results: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    return path
