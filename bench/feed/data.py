"""bench.feed's data: ImageNet-like JPEGs as tar shards with a tpustream manifest, train and val.

Each image is a region of one of the two photographs scikit-learn bundles
(china.jpg, flower.jpg, 640x427), as bench.pipeline.imagenet_data cuts them,
drawn from its own generator (seed, index): the long side log-normal around
475 px, the aspect ratio uniform in 1.3-1.45, one in ten portrait (about
465x360 on average), resized with PIL's bicubic filter and saved as a JPEG
at quality 95 (PIL, 4:2:0): ~0.39 bytes a pixel, about 66 KB, the issue's
data. No grain: bench.pipeline.imagenet_data adds some to reach ImageNet's
~0.8 bytes a pixel, which these rows do not claim. Labels are index %
num_classes.

A shard is `<key>.jpg` + `<key>.cls` per sample, written by tpustream's own
tar writer (deterministic bytes) as train-000000.tar, ... beside a
manifest.json naming the classes, so `train.py data=imagenet data.root=DIR`
reads it with no data.num_classes, and webdataset reads the same tars.
Shards are built in a Pool over every usable CPU, one task a shard.
feed-data.json, written last, records what was made: a folder with the same
record is reused.
"""

from __future__ import annotations

import io
import json
import math
import multiprocessing
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bench.photos import photo_region, source_photos
from tpustream.data.format.manifest import MANIFEST_NAME, ShardInfo, ShardManifest, summarize_image_sizes
from tpustream.data.format.tar import write_tar
from tpustream.data.resolve.options import SplitOptions
from tpustream.data.resolve.split import load_split
from tpustream.data.write.writer import shard_name
from tpustream.observe.advice import usable_cpus

RECORD_NAME = "feed-data.json"
# Bumped when the images change for the same settings: an old folder is then rebuilt.
GENERATOR_VERSION = 1
LONG_SIDE, LONG_SIDE_SIGMA, LONG_SIDE_RANGE = 475, 0.12, (320, 720)
ASPECT_RANGE = (1.3, 1.45)
PORTRAIT_SHARE = 0.1
QUALITY = 95


@dataclass(frozen=True)
class DataSpec:
    """What a data folder holds; two folders with equal specs hold the same bytes."""

    train_images: int
    val_images: int
    samples_per_shard: int
    num_classes: int
    seed: int = 0
    version: int = GENERATOR_VERSION

    def split_images(self) -> dict[str, tuple[int, int]]:
        """(first index, count) per split: val's images follow train's, so none repeats."""
        return {"train": (0, self.train_images), "val": (self.train_images, self.val_images)}


@dataclass(frozen=True)
class ShardTask:
    """One shard: images first .. first + count - 1 of the seed, written to path."""

    path: str
    first: int
    count: int
    num_classes: int
    seed: int


def draw_size(rng: np.random.Generator) -> tuple[int, int]:
    """(width, height) around 465x360 (the module docstring)."""
    long = float(np.clip(LONG_SIDE * math.exp(rng.normal(0.0, LONG_SIDE_SIGMA)), *LONG_SIDE_RANGE))
    short = long / rng.uniform(*ASPECT_RANGE)
    width, height = round(long), round(short)
    return (height, width) if rng.random() < PORTRAIT_SHARE else (width, height)


def make_jpeg(index: int, seed: int) -> tuple[bytes, tuple[int, int]]:
    """Image `index` as JPEG bytes and its (height, width)."""
    rng = np.random.default_rng([seed, index])
    width, height = draw_size(rng)
    image = photo_region(index, width, height, rng)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=QUALITY)
    return buffer.getvalue(), (height, width)


def write_shard(task: ShardTask) -> tuple[int, list[tuple[int, int]], list[int]]:
    """Build one shard and write it atomically; (samples, sizes, byte counts)."""
    members, sizes, nbytes = [], [], []
    for index in range(task.first, task.first + task.count):
        data, size = make_jpeg(index, task.seed)
        key = f"{index:08d}"
        members += [(f"{key}.jpg", data), (f"{key}.cls", str(index % task.num_classes).encode())]
        sizes.append(size)
        nbytes.append(len(data))
    temporary = f"{task.path}.partial"
    with open(temporary, "wb") as f:
        f.write(write_tar(members))
    os.replace(temporary, task.path)
    return task.count, sizes, nbytes


def plan_shards(spec: DataSpec, root: Path) -> dict[str, list[ShardTask]]:
    """Every split's shard tasks, samples_per_shard each (the last one takes the rest)."""
    planned = {}
    for split, (first, count) in spec.split_images().items():
        starts = range(first, first + count, spec.samples_per_shard)
        planned[split] = [
            ShardTask(
                str(root / split / shard_name(split, n)),
                start,
                min(spec.samples_per_shard, first + count - start),
                spec.num_classes,
                spec.seed,
            )
            for n, start in enumerate(starts)
        ]
    return planned


def read_record(root: Path) -> dict | None:
    try:
        return json.loads((root / RECORD_NAME).read_text())
    except (OSError, ValueError):
        return None


def prepare_data(spec: DataSpec, root: Path) -> dict:
    """The folder's record: the one there if it was made for `spec`, else the data made anew."""
    record = read_record(root)
    if record is not None and record.get("spec") == asdict(spec):
        return {**record, "reused": True}
    (root / RECORD_NAME).unlink(missing_ok=True)  # a folder without its record is not reused
    planned = plan_shards(spec, root)
    for split in planned:
        (root / split).mkdir(parents=True, exist_ok=True)
        for old in (root / split).glob("*.tar"):  # another spec's shards would stay beside the new ones
            old.unlink()
        (root / split / MANIFEST_NAME).unlink(missing_ok=True)
    started = time.perf_counter()
    source_photos()  # loaded once here, inherited by the forked processes
    processes = usable_cpus()
    tasks = [task for split in planned for task in planned[split]]
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        # The largest first would not help: shards are all about the same work.
        done = dict(zip(tasks, pool.map(write_shard, tasks, chunksize=1), strict=True))
    stats = {}
    for split, tasks_of_split in planned.items():
        write_manifest(root / split, split, spec.num_classes, tasks_of_split, done)
        sizes = [size for task in tasks_of_split for size in done[task][1]]
        nbytes = [n for task in tasks_of_split for n in done[task][2]]
        stats[split] = describe_images(sizes, nbytes, len(tasks_of_split))
    record = {
        "spec": asdict(spec),
        "processes": processes,
        "seconds": time.perf_counter() - started,
        "quality": QUALITY,
        "splits": stats,
    }
    (root / RECORD_NAME).write_text(json.dumps(record, indent=1) + "\n")
    return {**record, "reused": False}


def write_manifest(folder: Path, split: str, num_classes: int, tasks: list[ShardTask], done: dict) -> None:
    """manifest.json: the shards, their counts, the classes (the images keep their own sizes)."""
    sizes = [size for task in tasks for size in done[task][1]]
    manifest = ShardManifest(
        split=split,
        classes=[f"n{label:08d}" for label in range(num_classes)],
        image_size=None,
        channels=3,
        image_format="jpg",
        shards=[ShardInfo(task.path, done[task][0]) for task in tasks],
        size_stats=summarize_image_sizes(sizes),
    )
    (folder / MANIFEST_NAME).write_text(manifest.to_json(str(folder)))


def describe_images(sizes: list[tuple[int, int]], nbytes: list[int], shards: int) -> dict:
    heights, widths = np.array(sizes).T
    return {
        "images": len(sizes),
        "shards": shards,
        "avg_bytes": float(np.mean(nbytes)),
        "avg_width": float(widths.mean()),
        "avg_height": float(heights.mean()),
        "bytes_per_pixel": float(np.sum(nbytes) / np.sum(heights * widths)),
    }


def train_shards(root: Path, image_size: int) -> list[str]:
    """The training split as tpustream resolves it (manifest checked, first samples read): its shard paths."""
    options = SplitOptions(image_size=image_size, crop=True, label_key="cls", progress=False)
    return [shard.url for shard in load_split(str(root / "train"), "train", options).shards]


def describe_data(record: dict) -> str:
    train = record["splits"]["train"]
    how = (
        "reused"
        if record["reused"]
        else f"made in {record['seconds']:.1f} s by {record['processes']} processes"
    )
    return (
        f"data: {train['images']} training images in {train['shards']} shards, "
        f"{record['splits']['val']['images']} val; {train['avg_bytes'] / 1000:.1f} KB, "
        f"{train['avg_width']:.0f}x{train['avg_height']:.0f} average, quality {record['quality']} ({how})"
    )
