"""The CIFAR-like benchmark's images (varied digits, 32x32) as files, local and gs:// shards of four kinds.

See bench.pipeline.cifar for what the configurations read and why.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import webdataset as wds
from PIL import Image

from bench.pipeline.harness import NUM_CLASSES, SEED, check_members, samples_per_shard, upload
from tpustream.data.format.manifest import ShardManifest
from tpustream.data.resolve.split import SplitOptions, load_manifest, load_split
from tpustream.data.write.image_sources import SplitSource, digits_splits
from tpustream.data.write.writer import encode_image, sample_order, write_split

IMAGE_SIZE = 32
MAX_SAMPLES_PER_SHARD = 1000
# ShardWriter shards carry numeric labels only: the class count comes from the config.
WDS_SPLIT_OPTIONS = SplitOptions(num_classes=NUM_CLASSES, progress=False)
WDS_FORMATS = ("png", "ppm")


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

    def split(self, image_format: str, where: str) -> ShardManifest:
        """The split of shard_roots[(image_format, where)], however its counts are recorded."""
        return load_split(self.shard_roots[image_format, where], "train", WDS_SPLIT_OPTIONS)


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

    per_shard = samples_per_shard(num_images, MAX_SAMPLES_PER_SHARD)
    split = SplitSource(
        "train", [str(c) for c in range(NUM_CLASSES)], list(images), labels, (IMAGE_SIZE, IMAGE_SIZE)
    )
    shard_bytes = {}
    for image_format in ("png", "raw"):
        local = os.path.join(workdir, image_format)
        # write_split encodes with the same encode_image, so shard members are
        # byte-identical to data.png; "train" also shuffles the write order.
        write_split(split, local, samples_per_shard=per_shard, image_format=image_format, progress=False)
        folder = os.path.join(local, "train")
        gcs = f"gs://{bucket}/{image_format}/train"
        upload(folder, gcs)
        data.shard_roots[image_format, "local"] = folder
        data.shard_roots[image_format, "gcs"] = gcs
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
    local = data.shard_roots["wds-png", "local"]
    upload(local, f"gs://{bucket}/wds-png")
    data.shard_roots["wds-png", "gcs"] = f"gs://{bucket}/wds-png"
    check_members(load_manifest(data.shard_roots["png", "local"]).shards[0].url, "png", png)
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
