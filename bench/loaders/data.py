"""bench.loaders' data: one set of ImageNet-size JPEGs, as files, as tar shards and as MDS.

The images are bench.pipeline.imagenet_data's (ImageNet's spread of sizes,
median long side ~380 px, grain to reach ImageNet's ~110 KB), all RGB JPEGs
(none of its odd grayscale, CMYK or PNG ones: every loader here decodes with
its own code and none is being tested on those). Label: index % NUM_CLASSES.
Each image is written once as DATA/files/<index>.jpg, and the same bytes are
then stored twice more:

- DATA/train/train-NNNNNN.tar: `<index>.jpg` + `<index>.cls` per sample,
  samples_per_shard a shard, in index order, by tpustream's tar writer, with a
  tpustream manifest.json (what ShardLoader reads without counting; webdataset
  reads the same tars);
- DATA/mds/: streaming.MDSWriter shards with columns jpg (bytes, as stored),
  cls and index (int64), about the tar shards' bytes each; where
  mosaicml-streaming is installed and the run reads it (made the first time).

loaders-data.json, written last, records the spec and what was made: a
folder made for the same spec is reused, and one without its MDS copy gets it.
"""

from __future__ import annotations

import json
import multiprocessing
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bench.photos import source_photos
from bench.pipeline.imagenet_data import make_photo
from tpustream.data.format.manifest import MANIFEST_NAME, ShardInfo, ShardManifest, summarize_image_sizes
from tpustream.data.format.tar import write_tar
from tpustream.data.write.writer import shard_name
from tpustream.observe.advice import usable_cpus

RECORD_NAME = "loaders-data.json"
# Bumped when the images or their layout change for the same spec: an old folder is then rebuilt.
GENERATOR_VERSION = 1
NUM_CLASSES = 1000
SPLIT = "train"
MDS_COLUMNS = {"jpg": "bytes", "cls": "int64", "index": "int64"}


@dataclass(frozen=True)
class DataSpec:
    """What a data folder holds; two folders with equal specs hold the same bytes."""

    images: int
    samples_per_shard: int
    num_classes: int = NUM_CLASSES
    seed: int = 0
    version: int = GENERATOR_VERSION


@dataclass(frozen=True)
class LoaderData:
    """The folder every loader reads, in its three forms."""

    root: Path
    spec: DataSpec

    @property
    def files(self) -> Path:
        return self.root / "files"

    @property
    def shards(self) -> Path:
        return self.root / SPLIT

    @property
    def mds(self) -> Path:
        return self.root / "mds"

    def jpeg_path(self, index: int) -> Path:
        return self.files / f"{index:07d}.jpg"

    def label(self, index: int) -> int:
        return index % self.spec.num_classes

    def shard_urls(self) -> list[str]:
        """The tar shards in index order (sample `index` is in shard index // samples_per_shard)."""
        count = -(-self.spec.images // self.spec.samples_per_shard)
        return [str(self.shards / shard_name(SPLIT, n)) for n in range(count)]


def write_image(task: tuple[str, int, int]) -> tuple[int, int, int]:
    """Make image `index` and write its JPEG file; (height, width, bytes)."""
    folder, index, seed = task
    photo = make_photo(index, "rgb", seed)
    Path(folder, f"{index:07d}.jpg").write_bytes(photo.data)
    return photo.height, photo.width, len(photo.data)


def write_files(data: LoaderData) -> list[tuple[int, int, int]]:
    """Every image as a file, made in a Pool over the usable CPUs (each image has its own seed)."""
    data.files.mkdir(parents=True, exist_ok=True)
    source_photos()  # loaded once here, inherited by the forked processes
    tasks = [(str(data.files), index, data.spec.seed) for index in range(data.spec.images)]
    with multiprocessing.get_context("fork").Pool(usable_cpus()) as pool:
        return pool.map(write_image, tasks, chunksize=16)


def write_shards(data: LoaderData, sizes: list[tuple[int, int]]) -> None:
    """The tar shards, then their manifest (a split is usable once its manifest exists)."""
    data.shards.mkdir(parents=True, exist_ok=True)
    (data.shards / MANIFEST_NAME).unlink(missing_ok=True)
    per_shard, infos = data.spec.samples_per_shard, []
    for number, url in enumerate(data.shard_urls()):
        indices = range(number * per_shard, min((number + 1) * per_shard, data.spec.images))
        members = []
        for index in indices:
            key = f"{index:07d}"
            members += [
                (f"{key}.jpg", data.jpeg_path(index).read_bytes()),
                (f"{key}.cls", b"%d" % data.label(index)),
            ]
        Path(url).write_bytes(write_tar(members))
        infos.append(ShardInfo(url, len(indices)))
    manifest = ShardManifest(
        split=SPLIT,
        classes=[f"n{label:08d}" for label in range(data.spec.num_classes)],
        image_size=None,
        channels=3,
        image_format="jpg",
        shards=infos,
        size_stats=summarize_image_sizes(sizes),
    )
    (data.shards / MANIFEST_NAME).write_text(manifest.to_json(str(data.shards)))


def write_mds(data: LoaderData, shard_bytes: int) -> None:
    """The MDS copy: the same bytes, MDS shards of about shard_bytes."""
    from streaming import MDSWriter

    shutil.rmtree(data.mds, ignore_errors=True)
    with MDSWriter(out=str(data.mds), columns=MDS_COLUMNS, size_limit=shard_bytes) as writer:
        for index in range(data.spec.images):
            jpeg = data.jpeg_path(index).read_bytes()
            writer.write({"jpg": jpeg, "cls": data.label(index), "index": index})


def mds_available() -> bool:
    try:
        import streaming  # noqa: F401
    except ImportError:
        return False
    return True


def read_record(root: Path) -> dict | None:
    try:
        return json.loads((root / RECORD_NAME).read_text())
    except (OSError, ValueError):
        return None


def prepare_data(spec: DataSpec, root: Path, with_mds: bool = True) -> tuple[LoaderData, dict]:
    """The folder for `spec`, made or reused, and its record (what was made, the images' sizes).

    with_mds: add the MDS copy where it is missing and mosaicml-streaming imports.
    """
    data = LoaderData(root, spec)
    record = read_record(root)
    started = time.perf_counter()
    if record is None or record.get("spec") != asdict(spec):
        (root / RECORD_NAME).unlink(missing_ok=True)  # a folder without its record is not reused
        made = write_files(data)
        heights, widths, nbytes = (np.array(column) for column in zip(*made, strict=True))
        write_shards(data, list(zip(heights.tolist(), widths.tolist(), strict=True)))
        record = {
            "spec": asdict(spec),
            "mds": False,
            "images": spec.images,
            "avg_bytes": float(nbytes.mean()),
            "avg_width": float(widths.mean()),
            "avg_height": float(heights.mean()),
            "bytes_per_pixel": float(nbytes.sum() / (heights * widths).sum()),
            "tar_shards": len(data.shard_urls()),
            "samples_per_shard": spec.samples_per_shard,
        }
    if with_mds and not record["mds"] and mds_available():
        write_mds(data, shard_bytes=int(record["avg_bytes"] * spec.samples_per_shard))
        record["mds"] = True
        record["mds_shards"] = len(list(data.mds.glob("*.mds")))
    record["seconds"] = time.perf_counter() - started
    (root / RECORD_NAME).write_text(json.dumps(record, indent=1) + "\n")
    return data, record


def describe_data(record: dict) -> str:
    mds = f", MDS {record['mds_shards']} shards" if record["mds"] else ", no MDS"
    return (
        f"data: {record['images']} JPEGs, {record['avg_bytes'] / 1000:.1f} KB and "
        f"{record['avg_width']:.0f}x{record['avg_height']:.0f} px on average "
        f"({record['bytes_per_pixel']:.2f} B/pixel); {record['tar_shards']} tar shards of "
        f"{record['samples_per_shard']}{mds} ({record['seconds']:.1f} s)"
    )
