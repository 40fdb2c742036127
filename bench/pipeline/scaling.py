"""How tpustream's ImageNet pipeline scales with DataLoader workers, and where each process's time goes.

Reproduce (from the repository root):

    .venv/bin/python -m bench.pipeline --dataset imagenet --workers 1,2,4
    .venv/bin/python -m bench.pipeline --dataset imagenet --workers 1,2 --num-images 2000 --min-seconds 4
    .venv/bin/python -m bench.pipeline --dataset imagenet --workers 1,2,4 --decode device   # on a GPU

Data: bench.feed.data's ImageNet-like JPEGs (about 465x360, quality 95,
66 KB; the images of the GPU headline, bench.feed), --num-images of them in
shards of 500, made once under --data and reused.

For each worker count W: the loader the trainer builds for one replica
(ShardStream with the canonical partition data.streams=auto chooses for W
workers, make_loader, batch 256, RandomResizedCrop 224 + flip drawn per
sample, data.shuffle_buffer 5000), its workers started, one untimed pass,
then timed passes until --min-seconds are measured (a pass's clock starts
at its first batch). The consumer does with each batch what the trainer
does: on a GPU, the asynchronous copy to the device from the page-locked
batch the loader made (and a synchronize, so copies cannot queue up);
without one, nothing more than the loader's own copy of the batch out of
the workers' shared slots, which is where the pin would be.

Printed per W: images/s, images/s per worker, the efficiency against W
times the one-worker rate (the first count given, scaled), the replica
process's CPU per batch (all its threads: receiving pieces, assembling,
the copy) and the cores it kept busy, each worker's mean busy share of a
core, the streams per worker (the most and fewest: unequal shares mean
some workers wait for others every batch), and of the consumer's waits for
batches the share their workers had not made yet (the rest: the replica's
receiving, copying, decoding on the device). Stages: per image, in one
process over the first --stage-images samples, the milliseconds to read
(tar parsing), decode (TurboJPEG at the DCT scale the crop allows), crop
and resize (the antialiased resample to 224) and batch (the copy into the
batch), from the same code the workers run, and what a worker does instead
with --decode device (data.decode=device: the header read and the crop
drawn; the loader's thread then decodes on the GPU, or without one on the
CPU, in the replica's process).

results.json in --out keeps every number with the command.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.feed.data import DataSpec, prepare_data
from tpustream.config import DataConfig
from tpustream.data.format.jpeg_window import window_decoder
from tpustream.data.format.manifest import ShardManifest
from tpustream.data.read.crops import SampleRandom, _decode_jpeg, decode_crop, random_resized_plan
from tpustream.data.read.encoded import encode_crop
from tpustream.data.read.loader import make_loader
from tpustream.data.read.partition import choose_partition
from tpustream.data.read.stages import ErrorPolicy, read_span_samples
from tpustream.data.read.stream import ShardStream
from tpustream.data.resolve.options import SplitOptions
from tpustream.data.resolve.split import load_split
from tpustream.observe.advice import usable_cpus

BATCH_SIZE = 256
IMAGE_SIZE = 224
SHUFFLE_BUFFER = 5000
SAMPLES_PER_SHARD = 500
VAL_IMAGES = 500  # bench.feed.data makes a val split; unused here
SEED = 0
DEFAULT_NUM_IMAGES = 6000
DEFAULT_STAGE_IMAGES = 400
WARMUP_IMAGES = 50
_TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int | str = "self") -> float:
    """CPU seconds (user + system, all threads) of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def load_train_split(root: Path) -> ShardManifest:
    options = SplitOptions(image_size=IMAGE_SIZE, crop=True, label_key="cls", progress=False)
    return load_split(str(root / "train"), "train", options)


def make_stream(split: ShardManifest, workers: int, decode: str = "host") -> ShardStream:
    """The trainer's training stream for one replica with `workers` DataLoader workers."""
    data = dataclasses.replace(
        DataConfig(),
        decode=decode,
        num_workers=workers,
        shuffle_buffer=SHUFFLE_BUFFER,
        last_batch="drop",
        train_crop="random_resized",
        image_size=IMAGE_SIZE,
        label_key="cls",
    )
    partition = choose_partition("auto", 1, BATCH_SIZE, workers, len(split.shards), SHUFFLE_BUFFER)
    return ShardStream(
        split, data, batch_size=BATCH_SIZE, rank=0, world_size=1, train=True, seed=SEED, partition=partition
    )


def consumer() -> Callable[[dict], None]:
    """What the trainer does with a batch beyond the loader: the copy to a GPU, where there is one."""
    if not torch.cuda.is_available():
        return lambda batch: None
    device = torch.device("cuda")

    def to_device(batch: dict) -> None:
        # pin_memory() of a page-locked tensor is the tensor itself; data.decode=device
        # made the images on the GPU already (the loader's thread waited for them).
        if batch["image"].device.type != "cuda":
            batch["image"].pin_memory().to(device, non_blocking=True)
        torch.cuda.current_stream().synchronize()

    return to_device


def measure_workers(split: ShardManifest, workers: int, min_seconds: float, decode: str) -> dict[str, Any]:
    """One worker count: rate, and the CPU of the replica's process and of each worker."""
    stream = make_stream(split, workers, decode)
    gpu = torch.device("cuda") if torch.cuda.is_available() else None
    loader = make_loader(stream, workers, pin_device=gpu, decode_device=gpu)
    consume = consumer()
    loader.start_workers()
    try:
        samples = batches = passes = 0
        seconds = replica_cpu = waited = making = 0.0
        worker_cpu = np.zeros(workers)
        epoch = 0
        while seconds < min_seconds or passes == 0:
            loader.set_epoch(epoch)
            iterator = iter(loader)
            consume(next(iterator))  # workers started and shuffle buffers filled before this
            pids = [worker.pid for worker in loader.loader._iterator._workers]
            start, cpu0, workers0 = time.perf_counter(), process_cpu(), [process_cpu(p) for p in pids]
            for batch in iterator:
                consume(batch)
                if epoch > 0:
                    samples, batches = samples + len(batch["label"]), batches + 1
            if epoch > 0:  # epoch 0: the warm-up (page cache, imports in the workers)
                seconds += time.perf_counter() - start
                replica_cpu += process_cpu() - cpu0
                worker_cpu += np.array([process_cpu(p) for p in pids]) - workers0
                waited, making = waited + loader.waits.seconds, making + loader.waits.making_seconds
                passes += 1
            epoch += 1
    finally:
        loader.close()
    assert stream.partition is not None
    shares = [len(stream.partition.streams_of(0, 1, w, workers)) for w in range(workers)]
    return {
        "workers": workers,
        "streams": stream.partition.streams,
        "streams_per_worker": [min(shares), max(shares)],
        "images_per_s": samples / seconds,
        "seconds": seconds,
        "passes": passes,
        "replica_ms_per_batch": 1000 * replica_cpu / batches,
        "replica_cores": replica_cpu / seconds,
        "worker_cores": (worker_cpu / seconds).tolist(),
        # Of the consumer's waits, the share for batches not yet made (observe.timing.BatchWaits).
        "making_share": making / waited if waited > 0 else None,
    }


def stage_times(split: ShardManifest, count: int) -> dict[str, float]:
    """Milliseconds per image of each stage a worker runs, in this process, over the first `count` samples."""
    spans = ShardStream.worker_spans(make_stream(split, 0), 0, 1)
    shard_index = {shard.url: i for i, shard in enumerate(split.shards)}
    counts = [shard.samples for shard in split.shards]
    on_error = ErrorPolicy("raise")
    start = time.perf_counter()
    samples = []
    for sample in read_span_samples(spans, on_error, shard_index, counts):
        samples.append(sample)
        if len(samples) == count:
            break
    read = time.perf_counter() - start
    images = [sample["jpg"] for sample in samples]

    def plan(index: int) -> Callable:
        rnd = SampleRandom(SEED, 0, index)
        return lambda h, w: random_resized_plan(h, w, IMAGE_SIZE, rnd, True)

    for index, data in enumerate(images[:WARMUP_IMAGES]):  # first calls: lazy set-up, cold caches
        decode_crop(data, plan(index), IMAGE_SIZE, 3)
    start = time.perf_counter()
    for index, data in enumerate(images):
        _decode_jpeg(data, 3, plan(index), True, window=True)
    decode = time.perf_counter() - start
    start = time.perf_counter()  # the whole image, as without jpeg_window's cropped decoding
    for index, data in enumerate(images):
        _decode_jpeg(data, 3, plan(index), True, window=False)
    decode_whole = time.perf_counter() - start
    start = time.perf_counter()
    for index, data in enumerate(images):
        # Not kept: 400 crops kept would charge their memory's first touch (~0.25 ms an image
        # here) to the crop, which a worker writes into a slot it reuses.
        decode_crop(data, plan(index), IMAGE_SIZE, 3)
    whole = time.perf_counter() - start
    crops = [decode_crop(data, plan(index), IMAGE_SIZE, 3) for index, data in enumerate(images)]
    # Written before, as a slot of the workers' ring is after its first pass:
    # a new array's first writes would time the kernel's page faults.
    batch = np.empty((len(crops), 3, IMAGE_SIZE, IMAGE_SIZE), np.uint8)
    batch.fill(0)
    start = time.perf_counter()
    for row, crop in enumerate(crops):
        batch[row] = crop
    copy = time.perf_counter() - start
    start = time.perf_counter()  # what a worker does instead for data.decode=device
    for index, data in enumerate(images):
        encode_crop(data, plan(index), IMAGE_SIZE, 3)
    header = time.perf_counter() - start
    per_image = 1000 / len(images)
    return {
        "images": len(images),
        "read_ms": read * per_image,
        "decode_ms": decode * per_image,
        "decode_whole_image_ms": decode_whole * per_image,
        "window_decoding": window_decoder() is not None,
        "crop_resize_ms": (whole - decode) * per_image,
        "batch_ms": copy * per_image,
        "device_decode_worker_ms": header * per_image,
        "one_core_images_per_s": len(images) / (read + whole + copy),
    }


def describe(rows: list[dict[str, Any]], stages: dict[str, float]) -> str:
    base = rows[0]["images_per_s"] / rows[0]["workers"]
    lines = [
        "| workers | streams/worker | images/s | per worker | efficiency | replica ms/batch | replica cores "
        "| worker cores (mean) | waits for making |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        rate, workers = row["images_per_s"], row["workers"]
        low, high = row["streams_per_worker"]
        making = "-" if row.get("making_share") is None else f"{100 * row['making_share']:.0f}%"
        lines.append(
            f"| {workers} | {low if low == high else f'{low}-{high}'} | {rate:,.0f} | {rate / workers:,.0f} "
            f"| {rate / (workers * base):.2f} | {row['replica_ms_per_batch']:.1f} "
            f"| {row['replica_cores']:.2f} | {float(np.mean(row['worker_cores'])):.2f} "
            f"| {making} |"
        )
    window = "the crop's window alone;" if stages["window_decoding"] else "no window decoder built;"
    lines.append(
        f"stages, ms per image in one process ({stages['images']} images): read {stages['read_ms']:.3f}, "
        f"decode {stages['decode_ms']:.3f} ({window} the whole image: "
        f"{stages['decode_whole_image_ms']:.3f}), crop+resize {stages['crop_resize_ms']:.3f}, "
        f"batch {stages['batch_ms']:.3f} = {stages['one_core_images_per_s']:.0f} images/s on one core; "
        f"for data.decode=device, header and crop draw {stages['device_decode_worker_ms']:.3f}"
    )
    return "\n".join(lines)


def run(args, command: str) -> int:
    """--dataset imagenet --workers N,M,...: the scaling table (the module docstring)."""
    spec = DataSpec(args.num_images, VAL_IMAGES, SAMPLES_PER_SHARD, 1000)
    data_root = Path(args.data) / f"{args.num_images}-images"
    prepare_data(spec, data_root)
    split = load_train_split(data_root)
    stages = stage_times(split, args.stage_images)
    rows = []
    for workers in args.workers:
        rows.append(measure_workers(split, workers, args.min_seconds, args.decode))
        print(describe(rows, stages), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": command,
        "cpus": usable_cpus(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "batch_size": BATCH_SIZE,
        "decode": args.decode,
        "stages": stages,
        "rows": rows,
    }
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"{usable_cpus()} usable CPUs; results in {out / 'results.json'}")
    return 0
