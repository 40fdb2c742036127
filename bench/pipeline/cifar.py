"""CIFAR-like digits (32x32 PNGs): stock PyTorch/WebDataset loading against tpustream's ShardStream.

Reproduce (from the repository root; about 4 minutes on 2 idle cores):

    .venv/bin/python -m bench.pipeline                # 20000 images -> bench/results/
    .venv/bin/python -m bench.pipeline --quick        # ~3000 images -> bench/results/quick/
    .venv/bin/python -m bench.pipeline --profile ours-local   # cProfile one config, w=0

Every configuration sees the same images: scikit-learn's digits (train split,
32x32 RGB) repeated to --num-images copies, each copy shifted, coloured and
given mild pixel noise so its PNG compresses like a small natural image rather
than a flat synthetic one (the average PNG size is printed). Labels are the
digits. "Stock transforms" are PIL decode + convert("RGB") and
Compose([RandomCrop(32, padding=4), RandomHorizontalFlip(), ToTensor(),
Normalize(mean, std)]); tpustream applies the same crop/flip/normalise per
batch (tpustream.data.read.crop_flip). Batches hold 128 samples.

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
                   tpustream.data.resolve.split.load_split, which counts the shards and saves
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
import gc
import multiprocessing
import os
import time
import uuid
from collections.abc import Iterable, Iterator
from functools import partial

import numpy as np
import torch
from torchvision import transforms

from bench.pipeline import harness
from bench.pipeline.cifar_data import IMAGE_SIZE, WDS_SPLIT_OPTIONS, BenchData, prepare_data
from bench.pipeline.harness import (
    BATCH_SIZE,
    NUM_CLASSES,
    SEED,
    WORKER_COUNTS,
    Batch,
    Config,
    Epoch,
    batch_length,
    make_stream,
)
from bench.pipeline.report import format_table, plot
from tpustream import storage
from tpustream.data.format.decode import ImageDecoder
from tpustream.data.read.loader import make_loader
from tpustream.data.read.stream import ShardStream
from tpustream.data.resolve.counting import INDEX_NAME, count_shards
from tpustream.data.resolve.split import load_manifest, load_split
from tpustream.training.normalize import Normalizer

DEFAULT_NUM_IMAGES = 20000
QUICK_NUM_IMAGES = 3000
RESULTS = "results"  # under bench/ (quick: results/quick)
SHUFFLE_BUFFER = 2000
MEMORY_SHUFFLE_BUFFERS = (2000, 200)
CROP_PADDING = 4
# CIFAR-10's statistics (conf/data/cifar10.yaml); any fixed values do, as long
# as every configuration uses the same ones.
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
RATIOS = (("x L", "x_L"), ("x L_ours", "x_L_ours"))


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


def normalized(batches: Iterable[dict[str, torch.Tensor]], normalize: Normalizer) -> Iterator[Batch]:
    """uint8 batches to normalised float32, in the consuming process.

    ShardStream ships uint8 (a quarter of the bytes between processes and to
    the device) and the trainer normalises on the device inside the compiled
    step. Here the consumer does it on the host, so every configuration
    still pays for the same transforms.
    """
    for batch in batches:
        yield normalize(batch["image"]), batch["label"]


def cifar_stream(split, workers: int, shuffle_buffer: int) -> ShardStream:
    return make_stream(split, workers, shuffle_buffer, crop_padding=CROP_PADDING)


def limit_stock(data: BenchData, workers: int) -> Epoch:
    """L: PIL decode + stock transforms + torch.stack from in-memory bytes."""
    return harness.stock_limit(data.png, data.labels, stock_transform())


def limit_ours(data: BenchData, workers: int) -> Epoch:
    """L_ours: tpustream's decode, batching and batch augmentation on in-memory sample dicts."""
    decoder = ImageDecoder(3, IMAGE_SIZE, IMAGE_SIZE, NUM_CLASSES, image_key="png")
    normalize = Normalizer(MEAN, STD)
    rng = np.random.default_rng(SEED)
    samples = harness.memory_samples("png", data.keys, data.png, data.labels)
    return lambda: normalized(
        harness.ours_in_memory(samples, decoder, decoder.shape, rng, CROP_PADDING), normalize
    )


def image_folder(data: BenchData, workers: int) -> Epoch:
    """A: one PNG file per image, torchvision ImageFolder, DataLoader collation."""
    return harness.image_folder(data.image_folder, stock_transform(), True, workers)


def stock_webdataset(data: BenchData, workers: int, where: str) -> Epoch:
    """B (local) / C (gcs): the stock WebDataset chain with per-sample stock transforms."""
    urls = data.shard_urls("png", where)
    return harness.stock_webdataset(urls, "png", stock_transform(), workers, SHUFFLE_BUFFER)


def ours(data: BenchData, workers: int, image_format: str, where: str) -> Epoch:
    """ours-*: ShardStream through make_loader, as the trainer builds it, normalising in the consumer."""
    loader = make_loader(cifar_stream(data.split(image_format, where), workers, SHUFFLE_BUFFER), workers)
    normalize = Normalizer(MEAN, STD)
    return lambda: normalized(loader, normalize)


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


def add_ratios(rows: list[dict]) -> None:
    limits = {r["name"]: r["samples_per_s"] for r in rows if r["workers"] is None}
    for r in rows:
        r["x_L"] = r["samples_per_s"] / limits["L"]
        r["x_L_ours"] = r["samples_per_s"] / limits["L_ours"]


# ----------------------------------------------------------- start-up, memory


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
            samples = sum(batch_length(b) for b in make_loader(cifar_stream(split, 0, SHUFFLE_BUFFER), 0))
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
    loader = make_loader(cifar_stream(load_manifest(split_root), 0, shuffle_buffer), 0)
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


# ------------------------------------------------------------------------- run


def run(args: argparse.Namespace, command: str) -> int:
    """Every configuration, the start-up without a manifest and the memory; results.json and the chart."""
    harness.start_run()
    started = time.time()
    with harness.run_storage("tpustream-bench-") as (workdir, bucket, emulator_url):
        print(f"preparing {args.num_images} images (files, local shards, gs://{bucket} on {emulator_url})")
        data, info = prepare_data(args.num_images, workdir, bucket)
        print(
            f"average PNG size {info['avg_png_bytes']:.0f} bytes; {info['num_shards']} shards of "
            f"{info['samples_per_shard']} samples; torch threads {torch.get_num_threads()}, "
            f"{os.cpu_count()} CPUs"
        )
        harness.print_method("warm-up pass")
        if args.profile:
            for name in args.profile:
                harness.profile(name, harness.find_config(CONFIGS, name).build(data, 0))
            return 0
        rows = harness.measure_configs(
            CONFIGS, lambda config, workers: config.build(data, workers), args.min_seconds
        )
        add_ratios(rows)
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
    settings = harness.settings(
        {"shuffle_buffer": SHUFFLE_BUFFER, "crop_padding": CROP_PADDING},
        "one warm-up pass, then passes timed from their first batch (samples after it)",
        args.min_seconds,
        MEAN,
        STD,
        {"memory": "peak RSS growth (VmHWM after reset) in a fresh process, ours-local, 0 workers"},
    )
    results = {
        "command": command,
        "seconds_total": time.time() - started,
        "data": info,
        "settings": settings,
        "environment": harness.environment(),
        "configs": rows,
        "startup_without_manifest": startup,
        "memory": memory,
    }
    path = harness.write_results(args.out, results)
    chart = args.out / "input_pipeline.png"
    title = (
        f"{args.num_images} digit PNGs ({info['avg_png_bytes']:.0f} B avg), batch {BATCH_SIZE}, "
        f"1 torch thread, {os.cpu_count()} CPUs"
    )
    plot(rows, chart, title, RATIOS, rows[:2], WORKER_COUNTS)
    print(f"\nwrote {path} and {chart}")
    return 0
