"""The ImageNet-like benchmark's photos (ImageNet's sizes and bytes) as files and local and gs:// shards.

Data: --num-images JPEGs cut from the two photographs scikit-learn bundles
(sklearn.datasets.load_sample_images: china.jpg and flower.jpg, 640x427),
every one drawn from its own generator (seed, index):

- size: the long side is log-normal (median 380 px, sigma 0.28) clipped to
  [80, 2500], except for 1.5% drawn log-uniform in [700, 2500] (ImageNet's
  tail of large photos); the short side is the long one divided by a ratio
  drawn log-uniform in [1, 4/3] (10%: [1, 2]); 20% are portrait. Mean about
  405x370, three long sides in four within 250-500 px, 1-2% over 1000.
- pixels: a random region of the image's aspect ratio, 50-100% of the largest
  one that fits, of one of the two photos (alternating), resized with PIL's
  bicubic filter; then Gaussian grain (sigma drawn in [12, 28] levels). The
  photos are smoother than ImageNet's average: without grain the JPEGs hold
  ~0.27 bytes a pixel, a third of ImageNet's (~110 KB at ~400x350); the grain
  brings the byte count, and so the entropy-decoding work, to ImageNet's.
- encoding: JPEG at a quality drawn uniform in 85..96 (PIL, 4:2:0), except, as
  in ImageNet, 0.5% grayscale JPEGs, 0.5% CMYK JPEGs and 0.2% PNG bytes under
  a .JPEG name (at least one of each).

The average bytes and sizes are printed and saved. Labels are index % 10.
The same bytes are written three ways: an ImageFolder tree
(root/n0000000<label>/<key>.JPEG) for A; tar shards written by webdataset's
ShardWriter as the reference make_imagenet_shards.py writes them
({"__key__": "%07d" % index, "jpg": bytes, "cls": int}, 256 samples a shard,
imagenet-train-%06d.tar) in a local folder; and the same shards in a bucket
of the GCS emulator (fake-gcs-server on 127.0.0.1).
"""

from __future__ import annotations

import io
import math
import multiprocessing
import os
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import webdataset as wds
from PIL import Image

from bench.photos import photo_region, source_photos
from bench.pipeline.harness import NUM_CLASSES, check_members, samples_per_shard, upload
from tpustream.data.format.manifest import ShardManifest
from tpustream.data.resolve.split import SplitOptions, load_split

IMAGE_SIZE = 224
MAX_SAMPLES_PER_SHARD = 256
SPLIT_OPTIONS = SplitOptions(num_classes=NUM_CLASSES, image_size=IMAGE_SIZE, crop=True, progress=False)

# The generated photos (see the module docstring).
LONG_SIDE_MEDIAN = 380
LONG_SIDE_SIGMA = 0.28
LONG_SIDE_RANGE = (80, 2500)
LARGE_SHARE, LARGE_RANGE = 0.015, (700, 2500)
ASPECT_MAX, WIDE_SHARE, WIDE_ASPECT_MAX = 4 / 3, 0.1, 2.0
PORTRAIT_SHARE = 0.2
GRAIN_SIGMA = (12.0, 28.0)
QUALITY_RANGE = (85, 96)  # inclusive
ODD_SHARES = {"gray": 0.005, "cmyk": 0.005, "png": 0.002}
GENERATOR_PROCESSES = 2


@dataclass
class Photo:
    """One generated image as stored."""

    data: bytes
    width: int
    height: int
    kind: str  # "rgb", "gray" or "cmyk" JPEG, or "png" (PNG bytes under a .JPEG name)
    quality: int | None  # JPEG quality


@dataclass
class BenchData:
    """The benchmark images in every form the configurations read."""

    photos: list[Photo]
    labels: list[int]
    image_folder: str  # root/n<label>/<key>.JPEG for ImageFolder
    splits: dict[str, ShardManifest] = field(default_factory=dict)  # "local" / "gcs"

    def shard_urls(self, where: str) -> list[str]:
        return [shard.url for shard in self.splits[where].shards]


def image_key(index: int) -> str:
    return f"{index:07d}"


def odd_kinds(num_images: int, seed: int) -> list[str]:
    """Each image's kind: mostly "rgb", ODD_SHARES of the others (at least one each), at random places."""
    counts = {kind: max(1, round(share * num_images)) for kind, share in ODD_SHARES.items()}
    kinds = ["rgb"] * num_images
    places = np.random.default_rng([seed, num_images]).permutation(num_images)
    start = 0
    for kind, count in counts.items():
        for place in places[start : start + count]:
            kinds[place] = kind
        start += count
    return kinds


def draw_size(rng: np.random.Generator) -> tuple[int, int]:
    """(width, height) following ImageNet's spread of photo sizes (see the module docstring)."""
    if rng.random() < LARGE_SHARE:
        long = math.exp(rng.uniform(math.log(LARGE_RANGE[0]), math.log(LARGE_RANGE[1])))
    else:
        long = float(np.clip(LONG_SIDE_MEDIAN * math.exp(rng.normal(0.0, LONG_SIDE_SIGMA)), *LONG_SIDE_RANGE))
    ratio = math.exp(rng.uniform(0.0, math.log(WIDE_ASPECT_MAX if rng.random() < WIDE_SHARE else ASPECT_MAX)))
    long_px, short_px = round(long), max(1, round(long / ratio))
    return (short_px, long_px) if rng.random() < PORTRAIT_SHARE else (long_px, short_px)


def make_photo(index: int, kind: str, seed: int) -> Photo:
    """Image `index`: a region of a sample photo, resized, grained and encoded (the module docstring)."""
    rng = np.random.default_rng([seed, index])
    width, height = draw_size(rng)
    image = photo_region(index, width, height, rng)
    grain = rng.standard_normal((height, width, 3), dtype=np.float32) * rng.uniform(*GRAIN_SIGMA)
    image = Image.fromarray(np.clip(np.asarray(image, np.float32) + grain, 0, 255).astype(np.uint8))
    quality = int(rng.integers(QUALITY_RANGE[0], QUALITY_RANGE[1] + 1))
    buffer = io.BytesIO()
    if kind == "png":
        image.save(buffer, "PNG")
        return Photo(buffer.getvalue(), width, height, kind, None)
    if kind == "gray":
        image = image.convert("L")
    elif kind == "cmyk":
        image = image.convert("CMYK")
    image.save(buffer, "JPEG", quality=quality)
    return Photo(buffer.getvalue(), width, height, kind, quality)


def make_photos(num_images: int, seed: int) -> list[Photo]:
    """Every image, generated in GENERATOR_PROCESSES forked processes (each image has its own seed)."""
    source_photos()  # loaded once here, inherited by the forked generators
    kinds = odd_kinds(num_images, seed)
    with multiprocessing.get_context("fork").Pool(GENERATOR_PROCESSES) as pool:
        return pool.starmap(make_photo, [(i, kinds[i], seed) for i in range(num_images)], chunksize=32)


def describe_photos(photos: list[Photo]) -> dict:
    sizes = np.array([(p.width, p.height) for p in photos])
    long = sizes.max(axis=1)
    nbytes = np.array([len(p.data) for p in photos])
    return {
        "avg_bytes": float(nbytes.mean()),
        "median_bytes": float(np.median(nbytes)),
        "max_bytes": int(nbytes.max()),
        "avg_width": float(sizes[:, 0].mean()),
        "avg_height": float(sizes[:, 1].mean()),
        "median_long_side": float(np.median(long)),
        "share_long_side_250_to_500": float(np.mean((long >= 250) & (long <= 500))),
        "share_long_side_over_1000": float(np.mean(long > 1000)),
        "max_long_side": int(long.max()),
        "bytes_per_pixel": float(nbytes.sum() / sizes.prod(axis=1).sum()),
        "kinds": dict(Counter(p.kind for p in photos)),
    }


def prepare_data(photos: list[Photo], workdir: str, bucket: str) -> tuple[BenchData, dict]:
    """Write the photos as an ImageFolder tree, ShardWriter shards in a folder and in the bucket."""
    labels = [index % NUM_CLASSES for index in range(len(photos))]
    data = BenchData(photos, labels, os.path.join(workdir, "imagefolder"))
    for index, (photo, label) in enumerate(zip(photos, labels, strict=True)):
        folder = os.path.join(data.image_folder, f"n{label:08d}")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{image_key(index)}.JPEG"), "wb") as f:
            f.write(photo.data)

    per_shard = samples_per_shard(len(photos), MAX_SAMPLES_PER_SHARD)
    local = os.path.join(workdir, "imagenet-train")
    os.makedirs(local)
    with wds.ShardWriter(
        os.path.join(local, "imagenet-train-%06d.tar"), maxcount=per_shard, verbose=0
    ) as sink:
        for index, (photo, label) in enumerate(zip(photos, labels, strict=True)):
            sink.write({"__key__": image_key(index), "jpg": photo.data, "cls": label})
    gcs = f"gs://{bucket}/imagenet-train"
    names = upload(local, gcs)

    index_seconds = {}
    for where, spec in (("local", local), ("gcs", gcs)):
        started = time.perf_counter()
        data.splits[where] = load_split(spec, "train", SPLIT_OPTIONS)  # counts, saves the index
        index_seconds[where] = time.perf_counter() - started
    check_members(data.shard_urls("local")[0], "jpg", (p.data for p in photos))
    info = {
        "num_images": len(photos),
        "source": "sklearn.datasets.load_sample_images (china.jpg, flower.jpg): resized regions + grain",
        **describe_photos(photos),
        "quality_range": QUALITY_RANGE,
        "samples_per_shard": per_shard,
        "num_shards": len(names),
        "shard_bytes_total": sum(os.path.getsize(os.path.join(local, n)) for n in names),
        "index_seconds": index_seconds,
    }
    return data, info


def describe_data(info: dict) -> str:
    kb = 1000
    return (
        f"images: {info['avg_bytes'] / kb:.1f} KB average (median {info['median_bytes'] / kb:.1f} KB, "
        f"{info['bytes_per_pixel']:.2f} B/pixel), "
        f"average {info['avg_width']:.0f}x{info['avg_height']:.0f} px, "
        f"long side median {info['median_long_side']:.0f} px, "
        f"{100 * info['share_long_side_250_to_500']:.0f}% in 250-500, "
        f"{100 * info['share_long_side_over_1000']:.1f}% over 1000, max {info['max_long_side']}; "
        f"kinds {info['kinds']}\n"
        f"{info['num_shards']} shards of {info['samples_per_shard']} samples "
        f"({info['shard_bytes_total'] / 1e6:.0f} MB); indexing took {info['index_seconds']['local']:.1f} s "
        f"local, {info['index_seconds']['gcs']:.1f} s gs://"
    )
