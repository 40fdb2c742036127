"""Input-pipeline throughput: stock PyTorch/WebDataset loading against tpustream's ShardStream.

Reproduce (from the repository root; about 4 minutes on 2 idle cores):

    .venv/bin/python bench/input_pipeline.py                # 20000 images -> bench/results/
    .venv/bin/python bench/input_pipeline.py --quick        # ~3000 images -> bench/results/quick/
    .venv/bin/python bench/input_pipeline.py --profile ours-local   # cProfile one config, w=0
    .venv/bin/python bench/input_pipeline.py --dataset imagenet     # ImageNet-like JPEGs, 224 crops

--dataset selects the data: cifar (the default) is this module, described
below; imagenet runs bench/imagenet_pipeline.py (3072 photo-like JPEGs of
ImageNet's sizes, random-resized and centre crops to 224, decode limit, DCT
scaling on and off -> bench/results/imagenet/; its docstring describes its
rows and options). The timing, load accounting, table and chart helpers both
use are in bench/common.py.

Every configuration sees the same images: scikit-learn's digits (train split,
32x32 RGB) repeated to --num-images copies, each copy shifted, coloured and
given mild pixel noise so its PNG compresses like a small natural image rather
than a flat synthetic one (the average PNG size is printed). Labels are the
digits. "Stock transforms" are PIL decode + convert("RGB") and
Compose([RandomCrop(32, padding=4), RandomHorizontalFlip(), ToTensor(),
Normalize(mean, std)]); tpustream applies the same crop/flip/normalise per
batch (tpustream.data.augment). Batches hold 128 samples.

Configurations (w = DataLoader num_workers, measured with 0 and 2):

    L              the stock limit: decode + stock transforms + torch.stack from PNG
                   bytes already in memory, one process, no I/O.
    L_ours         our limit: ImageDecoder + batch_samples + augment_batches + Normalizer (tpustream's
                   decode and batch-level augmentation) on in-memory sample dicts.
    A  (w)         torchvision ImageFolder over one PNG file per image + stock
                   transforms, DataLoader(batch_size=128, shuffle=True).
    B  (w)         the stock WebDataset chain on local tar shards:
                   WebDataset(urls, shardshuffle=100).shuffle(2000).decode("pil")
                   .to_tuple("png", "cls").map_tuple(stock_transform, int).batched(128)
                   in DataLoader(batch_size=None): batching inside each worker, as the
                   WebDataset examples do, since sending single samples between
                   processes is slow.
    C  (w)         B reading gs:// URLs from a local GCS emulator (fake-gcs-server).
                   webdataset opens gs:// with a `gsutil cat` subprocess and gsutil is
                   not installed, so C registers an in-process gs:// opener in
                   webdataset.gopen.gopen_schemes that returns tpustream.storage.open_read.
    ours-local (w) ShardStream(train=True, shuffle_buffer=2000, crop_padding=4, hflip)
                   via make_loader, PNG shards in a local folder.
    ours-gcs (w)   the same shards read from the emulator bucket.
    ours-raw-local / ours-raw-gcs (w)
                   the same with image_format="raw" shards (uint8 CHW pixels, no decode).
    ours-wds-png-local / ours-wds-ppm-local / ours-wds-png-gcs (w)
                   the same images written by webdataset's own ShardWriter ({"__key__",
                   "png"|"ppm": PIL image, "cls": int}, as the reference CIFAR notebook
                   does), with no manifest: the split is resolved by
                   tpustream.data.splits.load_split, which counts the shards and saves
                   tpustream-index.json. Throughput rows use the saved index.

Start-up without a manifest ("first run" / "second run"): for each ShardWriter
set, in a fresh copy of the shards, the seconds load_split takes the first time
(listing + counting every shard + writing the index) and the second time
(reading the index, checking every shard's size and version), each followed by
one full pass of ours (0 workers) from a fresh ShardStream: so the first run
is "counting included", the second "index reused". The indexing rate (shards/s
and MB/s of stored shard bytes) is that of the first run's counting, local
and gs://.

Timing: one untimed warm-up pass, then full timed passes, repeated until at
least --min-seconds have been measured. The clock of a pass starts when its
first batch arrives and only samples after that batch count, so DataLoader
worker start-up (and filling the first shuffle buffer) is not charged to any
configuration. samples/s = counted samples / measured wall seconds.
torch.set_num_threads(1) is set for the whole run so the single-process
configurations get one core like each DataLoader worker (which PyTorch already
limits to one thread); the machine this was written on has 2 cores.
ShardStream uses last_batch="drop" so every counted sample is a distinct image.
The "other load" column is the CPU (in cores) that other programs used while a
configuration ran: on a shared 2-core machine, anything above ~0.1 means that
row is slowed down by someone else and should be rerun.

Memory: for ours-local with 0 workers, a fresh process per shuffle buffer size
(2000, then 200) iterates one pass and records its peak RSS growth: the kernel's
high-water mark (VmHWM, what ru_maxrss reports) reset to the current RSS just
before the pass, minus that RSS. The difference between the two is what the
shuffle buffer costs (~2000 encoded samples); the rest is per-pass working
memory (read buffers, batch arrays, decode output) that does not depend on it.

Outputs: OUT/results.json and OUT/input_pipeline.png (samples/s bar chart).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import multiprocessing
import os
import pstats
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
import webdataset as wds
from common import (  # bench/common.py: the helpers imagenet_pipeline.py shares
    Batch,
    Epoch,
    ForeignCpu,
    batch_length,
    environment,
    format_table,
    measure,
    normalized,
    open_gs_in_process,
    plot,
    timed_pass,
)
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import transforms
from torchvision.datasets import ImageFolder

from tpustream import storage
from tpustream.data.augment import Normalizer
from tpustream.data.decode import ImageDecoder
from tpustream.data.index import INDEX_NAME, count_shards
from tpustream.data.loader import ShardStream, make_loader
from tpustream.data.manifest import load_manifest
from tpustream.data.shard_writer import encode_image, sample_order, write_split
from tpustream.data.sources import SplitSource, digits_splits
from tpustream.data.splits import SplitOptions, load_split
from tpustream.data.stages import ErrorPolicy, augment_batches, batch_samples, decode_samples
from tpustream.data.tar_stream import iter_shard_samples
from tpustream.emulator import GcsEmulator

BATCH_SIZE = 128
SHUFFLE_BUFFER = 2000
MEMORY_SHUFFLE_BUFFERS = (2000, 200)
CROP_PADDING = 4
IMAGE_SIZE = 32
NUM_CLASSES = 10
# CIFAR-10's statistics (conf/data/cifar10.yaml); any fixed values do, as long
# as every configuration uses the same ones.
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
WORKER_COUNTS = (0, 2)
MAX_SAMPLES_PER_SHARD = 1000
SEED = 0
DEFAULT_NUM_IMAGES = 20000
QUICK_NUM_IMAGES = 3000
B_BATCHING = "WebDataset.batched(128) + DataLoader(batch_size=None)"
RATIOS = (("x L", "x_L"), ("x L_ours", "x_L_ours"))
DATASETS = ("cifar", "imagenet")


# --------------------------------------------------------------------------- data


@dataclass
class BenchData:
    """The benchmark images in every form the configurations read."""

    keys: list[str]
    labels: list[int]
    png: list[bytes]  # encode_image(..., "png"), the same bytes the PNG shards hold
    image_folder: str  # root/<class>/<key>.png for ImageFolder
    shard_roots: dict[tuple[str, str], str] = field(default_factory=dict)  # (format, where) -> split

    def shard_urls(self, image_format: str, where: str) -> list[str]:
        return [s.url for s in load_manifest(self.shard_roots[image_format, where]).shards]

    def split(self, image_format: str, where: str):
        """The split of shard_roots[(image_format, where)], however its counts are recorded."""
        return load_split(self.shard_roots[image_format, where], "train", WDS_SPLIT_OPTIONS)


# ShardWriter shards carry numeric labels only: the class count comes from the config.
WDS_SPLIT_OPTIONS = SplitOptions(num_classes=NUM_CLASSES, progress=False)
WDS_FORMATS = ("png", "ppm")


def make_images(num_images: int, seed: int) -> tuple[np.ndarray, np.ndarray, int]:
    """num_images uint8 (3, 32, 32) digit images, every copy of a source image different.

    Bilinear-upsampled 8x8 grey digits compress to about 1.1 KB as PNG, much
    less than real photos of that size; a random shift, random foreground and
    background colours and Gaussian noise (sigma 6) per copy give
    realistically sized PNGs while the digit stays recognisable. Returns
    (images, labels, number of distinct source images).
    """
    train = digits_splits(seed)[0]
    grey = np.stack(train.images)[:, 0].astype(np.float32) / 255.0  # (n, 32, 32)
    rng = np.random.default_rng(seed)
    source = np.arange(num_images) % len(grey)
    images = np.empty((num_images, 3, IMAGE_SIZE, IMAGE_SIZE), np.uint8)
    for i, s in enumerate(source):
        # The digits' borders are mostly dark, so rolling instead of padding is harmless.
        shifted = np.roll(grey[s], rng.integers(-3, 4, 2), axis=(0, 1))
        background = rng.uniform(0, 110, (3, 1, 1))
        foreground = rng.uniform(140, 255, (3, 1, 1))
        pixels = background + (foreground - background) * shifted + rng.normal(0, 6, (3, 32, 32))
        images[i] = np.clip(pixels, 0, 255).round().astype(np.uint8)
    return images, train.labels[source], len(grey)


def prepare_data(num_images: int, workdir: str, bucket: str) -> tuple[BenchData, dict]:
    """Encode the images once and write them as files, local shards and bucket shards."""
    images, labels, num_sources = make_images(num_images, SEED)
    keys = [f"{i:08d}" for i in range(num_images)]
    png = [encode_image(image, "png") for image in images]
    data = BenchData(keys, [int(x) for x in labels], png, os.path.join(workdir, "imagefolder"))

    for key, label, data_bytes in zip(keys, data.labels, png, strict=True):
        folder = os.path.join(data.image_folder, str(label))
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{key}.png"), "wb") as f:
            f.write(data_bytes)

    # At least 2 shards per DataLoader worker, as a real dataset would have.
    per_shard = min(MAX_SAMPLES_PER_SHARD, num_images // (2 * max(WORKER_COUNTS)))
    split = SplitSource(
        "train", [str(c) for c in range(NUM_CLASSES)], list(images), labels, (IMAGE_SIZE, IMAGE_SIZE)
    )
    shard_bytes = {}
    for image_format in ("png", "raw"):
        local = os.path.join(workdir, image_format)
        # write_split encodes with the same encode_image, so shard members are
        # byte-identical to data.png; "train" also shuffles the write order.
        write_split(split, local, samples_per_shard=per_shard, image_format=image_format, progress=False)
        gcs = f"gs://{bucket}/{image_format}"
        folder = os.path.join(local, "train")
        for name in storage.list_names(folder):
            storage.write_bytes(
                storage.join(gcs, "train", name), storage.read_bytes(os.path.join(folder, name))
            )
        data.shard_roots[image_format, "local"] = folder
        data.shard_roots[image_format, "gcs"] = storage.join(gcs, "train")
        shard_bytes[image_format] = sum(
            os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder) if n.endswith(".tar")
        )
    # The same images, in the same write order, as webdataset's ShardWriter
    # writes them (no manifest), for the wds-* rows and the start-up timings.
    # write_split wrote source image order[p] under key p ("train" shuffles the write order).
    order = sample_order(num_images, 1, shuffle=True, seed=0).tolist()
    for image_format in WDS_FORMATS:
        local = os.path.join(workdir, f"wds-{image_format}")
        write_shardwriter_set(local, images, labels, order, per_shard, image_format)
        data.shard_roots[f"wds-{image_format}", "local"] = local
        shard_bytes[f"wds-{image_format}"] = sum(
            os.path.getsize(os.path.join(local, n)) for n in os.listdir(local)
        )
    gcs = f"gs://{bucket}/wds-png"
    for name in sorted(os.listdir(data.shard_roots["wds-png", "local"])):
        storage.write_bytes(
            storage.join(gcs, name),
            storage.read_bytes(os.path.join(data.shard_roots["wds-png", "local"], name)),
        )
    data.shard_roots["wds-png", "gcs"] = gcs
    # The shards must hold the very bytes L, L_ours and A decode.
    first = load_manifest(data.shard_roots["png", "local"]).shards[0].url
    with storage.open_read(first) as stream:
        if not {sample["png"] for sample in iter_shard_samples(stream, first)} <= set(png):
            raise RuntimeError(f"{first}: PNG members differ from the in-memory PNG bytes")
    info = {
        "num_images": num_images,
        "source": f"sklearn digits train split ({num_sources} images), copies varied per image",
        "avg_png_bytes": float(np.mean([len(b) for b in png])),
        "raw_bytes_per_image": 3 * IMAGE_SIZE * IMAGE_SIZE,
        "samples_per_shard": per_shard,
        "num_shards": len(load_manifest(data.shard_roots["png", "local"]).shards),
        "shard_bytes_total": shard_bytes,
    }
    return data, info


def write_shardwriter_set(
    folder: str, images: np.ndarray, labels: np.ndarray, order: list[int], per_shard: int, image_format: str
) -> None:
    """images[order] through webdataset.ShardWriter as PIL images under image_format, cls an int."""
    os.makedirs(folder, exist_ok=True)
    pattern = os.path.join(folder, f"bench-{image_format}-%06d.tar")
    with wds.ShardWriter(pattern, maxcount=per_shard, verbose=0) as sink:
        for position, index in enumerate(order):
            image = Image.fromarray(images[index].transpose(1, 2, 0))
            sink.write({"__key__": f"{position:08d}", image_format: image, "cls": int(labels[index])})


# ------------------------------------------------------------------ configurations


def stock_transform() -> transforms.Compose:
    return transforms.Compose(
        [
            transforms.RandomCrop(IMAGE_SIZE, padding=CROP_PADDING),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(MEAN, STD),
        ]
    )


def limit_stock(data: BenchData, workers: int) -> Epoch:
    """L: PIL decode + stock transforms + torch.stack from in-memory bytes."""
    transform = stock_transform()
    samples = [(png, str(label).encode()) for png, label in zip(data.png, data.labels, strict=True)]

    def epoch() -> Iterator[Batch]:
        images, labels = [], []
        for png, cls in samples:
            images.append(transform(Image.open(io.BytesIO(png)).convert("RGB")))
            labels.append(int(cls))
            if len(images) == BATCH_SIZE:
                yield torch.stack(images), torch.tensor(labels)
                images, labels = [], []
        if images:
            yield torch.stack(images), torch.tensor(labels)

    return epoch


def limit_ours(data: BenchData, workers: int) -> Epoch:
    """L_ours: tpustream's decode, batching and batch augmentation on in-memory sample dicts."""
    decoder = ImageDecoder(3, IMAGE_SIZE, IMAGE_SIZE, NUM_CLASSES, image_key="png")
    normalize = Normalizer(MEAN, STD)
    rng = np.random.default_rng(SEED)
    # What iter_shard_samples + read_span_samples yield, minus the tar and the I/O.
    samples = [
        {"__key__": key, "__url__": "memory", "png": png, "cls": str(label).encode(), "__padding__": False}
        for key, png, label in zip(data.keys, data.png, data.labels, strict=True)
    ]

    def epoch() -> Iterator[Batch]:
        decoded = decode_samples(samples, decoder, ErrorPolicy("raise"))
        # Full batches only, like ShardStream(last_batch="drop") below.
        batches = batch_samples(decoded, BATCH_SIZE, len(samples) // BATCH_SIZE, decoder.shape)
        return normalized(augment_batches(batches, rng, CROP_PADDING, True), normalize)

    return epoch


def image_folder(data: BenchData, workers: int) -> Epoch:
    """A: one PNG file per image, torchvision ImageFolder, DataLoader collation."""
    dataset = ImageFolder(data.image_folder, transform=stock_transform())
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True, num_workers=workers)
    return lambda: iter(loader)


def stock_webdataset(data: BenchData, workers: int, where: str) -> Epoch:
    """B (local) / C (gcs): the stock WebDataset chain with per-sample stock transforms."""
    dataset = (
        wds.WebDataset(data.shard_urls("png", where), shardshuffle=100)
        .shuffle(SHUFFLE_BUFFER)
        .decode("pil")
        .to_tuple("png", "cls")
        .map_tuple(stock_transform(), int)
        .batched(BATCH_SIZE)
    )
    loader = DataLoader(dataset, batch_size=None, num_workers=workers)
    return lambda: iter(loader)


def ours(data: BenchData, workers: int, image_format: str, where: str) -> Epoch:
    """ours-*: ShardStream through make_loader, as the trainer builds it, normalising in the consumer."""
    stream = make_stream(data.split(image_format, where), workers, SHUFFLE_BUFFER)
    loader = make_loader(stream, workers)
    normalize = Normalizer(MEAN, STD)
    return lambda: normalized(loader, normalize)


def make_stream(split, workers: int, shuffle_buffer: int) -> ShardStream:
    return ShardStream(
        split,
        batch_size=BATCH_SIZE,
        rank=0,
        world_size=1,
        num_workers=workers,
        train=True,
        seed=SEED,
        shuffle_buffer=shuffle_buffer,
        last_batch="drop",
        crop_padding=CROP_PADDING,
        hflip=True,
    )


@dataclass(frozen=True)
class Config:
    name: str
    build: Callable[[BenchData, int], Epoch]
    workers: tuple[int, ...] = WORKER_COUNTS  # () marks a single-process limit


CONFIGS = [
    Config("L", limit_stock, ()),
    Config("L_ours", limit_ours, ()),
    Config("A", image_folder),
    Config("B", partial(stock_webdataset, where="local")),
    Config("C", partial(stock_webdataset, where="gcs")),
    Config("ours-local", partial(ours, image_format="png", where="local")),
    Config("ours-gcs", partial(ours, image_format="png", where="gcs")),
    Config("ours-raw-local", partial(ours, image_format="raw", where="local")),
    Config("ours-raw-gcs", partial(ours, image_format="raw", where="gcs")),
    Config("ours-wds-png-local", partial(ours, image_format="wds-png", where="local")),
    Config("ours-wds-ppm-local", partial(ours, image_format="wds-ppm", where="local")),
    Config("ours-wds-png-gcs", partial(ours, image_format="wds-png", where="gcs")),
]


# ----------------------------------------------------------------------- memory


def _read_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def memory_probe(split_root: str, shuffle_buffer: int) -> dict:
    """Run in a fresh process: peak RSS growth while ours (0 workers) makes one pass.

    The kernel's high-water mark (VmHWM, what ru_maxrss reports) is reset to
    the current RSS first, so import-time peaks do not hide the pass's peak.
    """
    torch.set_num_threads(1)
    loader = make_loader(make_stream(load_manifest(split_root), 0, shuffle_buffer), 0)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to VmRSS (Linux >= 4.0)
    before = _read_status_kib("VmRSS")
    samples = sum(batch_length(batch) for batch in loader)
    return {
        "shuffle_buffer": shuffle_buffer,
        "samples": samples,
        "rss_before_bytes": before * 1024,
        "peak_rss_growth_bytes": (_read_status_kib("VmHWM") - before) * 1024,
    }


def measure_memory(split_root: str) -> list[dict]:
    # One spawned process per buffer size: memory freed by an earlier pass and
    # kept by the allocator would otherwise hide the growth of the next one.
    context = multiprocessing.get_context("spawn")
    results = []
    for buffer in MEMORY_SHUFFLE_BUFFERS:
        with context.Pool(1) as pool:
            results.append(pool.apply(memory_probe, (split_root, buffer)))
    return results


def profile(data: BenchData, name: str, top: int = 25) -> None:
    """cProfile one pass of a configuration in this process (0 workers), after a warm-up."""
    config = next((c for c in CONFIGS if c.name == name), None)
    if config is None:
        raise SystemExit(f"--profile: unknown configuration {name!r}; one of {[c.name for c in CONFIGS]}")
    epoch = config.build(data, 0)
    timed_pass(epoch)
    profiler = cProfile.Profile()
    profiler.enable()
    samples, seconds = timed_pass(epoch)
    profiler.disable()
    print(f"\n=== {name} (0 workers): {samples} samples in {seconds:.2f} s under cProfile")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def copy_shards(source: str, target: str) -> None:
    """The shards of a folder or gs:// prefix (not its index) into another one."""
    for name in storage.list_names(source):
        if name != INDEX_NAME:
            storage.write_bytes(storage.join(target, name), storage.read_bytes(storage.join(source, name)))


def measure_startup(data: BenchData, workdir: str, bucket: str) -> list[dict]:
    """First run (counting included) and second run (index reused) on fresh copies of the wds sets."""
    rows = []
    for key, where in (("wds-png", "local"), ("wds-ppm", "local"), ("wds-png", "gcs")):
        target = (
            os.path.join(workdir, f"startup-{key}")
            if where == "local"
            else f"gs://{bucket}/startup-{key}-{uuid.uuid4().hex[:6]}"
        )
        copy_shards(data.shard_roots[key, where], target)
        urls = [storage.join(target, n) for n in storage.list_names(target)]
        _, rate = count_shards(urls, progress=False)  # the indexing rate alone, nothing saved
        row = {"name": f"{key}-{where}", "shards": rate.shards, "shard_bytes": rate.bytes}
        row["index_shards_per_s"] = rate.shards / rate.seconds
        row["index_mb_per_s"] = rate.bytes / 1e6 / rate.seconds
        for run in ("first", "second"):
            started = time.perf_counter()
            split = load_split(target, "train", WDS_SPLIT_OPTIONS)
            resolved = time.perf_counter() - started
            samples = sum(batch_length(b) for b in make_loader(make_stream(split, 0, SHUFFLE_BUFFER), 0))
            row[f"{run}_resolve_seconds"] = resolved
            row[f"{run}_total_seconds"] = time.perf_counter() - started
            row[f"{run}_counts_from"] = split.counts_from
        row["samples_per_pass"] = samples
        rows.append(row)
        print(
            f"  {row['name']:<14} index {row['index_shards_per_s']:.0f} shards/s "
            f"{row['index_mb_per_s']:.0f} MB/s; first run {row['first_resolve_seconds']:.2f} s to resolve "
            f"+ pass = {row['first_total_seconds']:.2f} s; second {row['second_resolve_seconds']:.2f} s "
            f"+ pass = {row['second_total_seconds']:.2f} s",
            flush=True,
        )
    return rows


# ---------------------------------------------------------------------- report


def add_ratios(rows: list[dict]) -> None:
    limits = {r["name"]: r["samples_per_s"] for r in rows if r["workers"] is None}
    for r in rows:
        r["x_L"] = r["samples_per_s"] / limits["L"]
        r["x_L_ours"] = r["samples_per_s"] / limits["L_ours"]


# ------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    here = Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dataset",
        choices=DATASETS,
        default="cifar",
        help="cifar: this benchmark; imagenet: bench/imagenet_pipeline.py (its own options: --help)",
    )
    parser.add_argument("--num-images", type=int, default=None, help=f"default {DEFAULT_NUM_IMAGES}")
    parser.add_argument("--out", type=Path, default=None, help="default bench/results (quick: .../quick)")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK_NUM_IMAGES} images")
    parser.add_argument(
        "--min-seconds", type=float, default=None, help="timed seconds per config (3; quick 1)"
    )
    parser.add_argument(
        "--profile",
        metavar="CONFIG",
        action="append",
        help="instead of benchmarking, cProfile one pass of CONFIG with 0 workers (repeatable)",
    )
    args = parser.parse_args(argv)
    if args.num_images is None:
        args.num_images = QUICK_NUM_IMAGES if args.quick else DEFAULT_NUM_IMAGES
    if args.out is None:
        args.out = here / "results" / "quick" if args.quick else here / "results"
    if args.min_seconds is None:
        args.min_seconds = 1.0 if args.quick else 3.0
    if args.num_images < 4 * BATCH_SIZE:
        parser.error(f"--num-images must be at least {4 * BATCH_SIZE}")
    return args


def run_configs(data: BenchData, min_seconds: float) -> list[dict]:
    rows = []
    for config in CONFIGS:
        for workers in config.workers or (None,):
            label = config.name if workers is None else f"{config.name} w={workers}"
            print(f"  {label:<20}", end="", flush=True)
            with ForeignCpu() as foreign:
                result = measure(config.build(data, workers or 0), min_seconds)
                gc.collect()  # shut down (and reap) persistent DataLoader workers
            print(
                f"{result['samples_per_s']:>8.0f} samples/s  (other load {foreign.cores:.2f} cores)",
                flush=True,
            )
            rows.append({"name": config.name, "workers": workers, **result, "foreign_cores": foreign.cores})
    add_ratios(rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = " ".join(["python", os.path.relpath(__file__), *argv])
    selector = argparse.ArgumentParser(add_help=False)
    selector.add_argument("--dataset", choices=DATASETS, default="cifar")
    dataset, rest = selector.parse_known_args(argv)
    if dataset.dataset == "imagenet":
        import imagenet_pipeline  # a sibling in bench/, imported only when asked for

        return imagenet_pipeline.main(rest, command)
    args = parse_args(argv)
    torch.set_num_threads(1)  # the single-process configs get one core, like each DataLoader worker
    open_gs_in_process()
    warnings.filterwarnings("ignore", message=".*shardshuffle.*")
    started = time.time()

    with tempfile.TemporaryDirectory(prefix="tpustream-bench-") as workdir, GcsEmulator() as emulator:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        storage.gcs_client().create_bucket(bucket)
        print(f"preparing {args.num_images} images (files, local shards, gs://{bucket} on {emulator.url})")
        data, info = prepare_data(args.num_images, workdir, bucket)
        print(
            f"average PNG size {info['avg_png_bytes']:.0f} bytes; {info['num_shards']} shards of "
            f"{info['samples_per_shard']} samples; torch threads {torch.get_num_threads()}, "
            f"{os.cpu_count()} CPUs\n"
            f"B/C batching: {B_BATCHING}\n"
            "C reads gs:// through an in-process webdataset gopen handler (tpustream.storage.open_read) "
            "because gsutil is unavailable\n"
            "timing: warm-up pass, then passes timed from their first batch (DataLoader worker start-up "
            "excluded); 'other load' = cores busy with other programs meanwhile",
            flush=True,
        )
        if args.profile:
            for name in args.profile:
                profile(data, name)
            return 0
        rows = run_configs(data, args.min_seconds)
        print("  start-up without a manifest (ShardWriter shards: first run counts, second reuses)")
        startup = measure_startup(data, workdir, bucket)
        print("  memory (ours-local, w=0, fresh process per shuffle buffer) ...", flush=True)
        memory = measure_memory(data.shard_roots["png", "local"])

    print(f"\n{format_table(rows, RATIOS)}\n")
    for m in memory:
        print(
            f"ours-local w=0 shuffle_buffer={m['shuffle_buffer']}: peak RSS growth "
            f"{m['peak_rss_growth_bytes'] / 2**20:.1f} MiB over one pass of {m['samples']} samples"
        )
    results = {
        "command": command,
        "seconds_total": time.time() - started,
        "data": info,
        "settings": {
            "batch_size": BATCH_SIZE,
            "shuffle_buffer": SHUFFLE_BUFFER,
            "crop_padding": CROP_PADDING,
            "mean": MEAN,
            "std": STD,
            "torch_threads": 1,
            "min_seconds": args.min_seconds,
            "timing": "one warm-up pass, then passes timed from their first batch (samples after it)",
            "foreign_cores": "CPU cores used by other programs during the configuration (shared machine)",
            "B_C_batching": B_BATCHING,
            "C_opener": "in-process gs:// gopen handler -> tpustream.storage.open_read (no gsutil)",
            "ours_last_batch": "drop",
            "memory": "peak RSS growth (VmHWM after reset) in a fresh process, ours-local, 0 workers",
        },
        "environment": environment(),
        "configs": rows,
        "startup_without_manifest": startup,
        "memory": memory,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    chart = args.out / "input_pipeline.png"
    title = (
        f"{args.num_images} digit PNGs ({info['avg_png_bytes']:.0f} B avg), batch {BATCH_SIZE}, "
        f"1 torch thread, {os.cpu_count()} CPUs"
    )
    plot(rows, chart, title, RATIOS, rows[:2], WORKER_COUNTS)
    print(f"\nwrote {args.out / 'results.json'} and {chart}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
