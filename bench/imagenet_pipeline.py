"""Input-pipeline throughput on ImageNet-like JPEGs: stock PyTorch/WebDataset against tpustream's crops.

Reproduce (from the repository root; about 6 minutes on 2 idle cores):

    .venv/bin/python bench/input_pipeline.py --dataset imagenet          # 3072 images -> results/imagenet/
    .venv/bin/python bench/input_pipeline.py --dataset imagenet --quick  # 512 -> results/imagenet/quick/

(`.venv/bin/python bench/imagenet_pipeline.py` takes the same options.)

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

Transforms ("stock", as the issue defines L): training PIL decode +
convert("RGB") + Compose([RandomResizedCrop(224), RandomHorizontalFlip(),
ToTensor()]); evaluation the same with Resize(256) + CenterCrop(224) instead
of the first two. tpustream draws the same crops
(tpustream.data.crops: RandomResizedCrop's parameters draw for draw, flips;
evaluation resizes the shorter side to 224 / 0.875 = 256 and takes the centre)
but decodes at libjpeg-turbo's DCT-domain 1/2, 1/4 or 1/8 scale where the
crop is shrunk at least that much anyway, and resamples in uint8 (see that
module for how); its batches are uint8 (B, 3, 224, 224), what the trainer
receives: it normalises them on the device, inside the compiled step, so
the host never converts them to float (what converting them on the host
would cost is printed). Batches hold 128 samples.

Configurations, each in training (train) and evaluation (eval) form unless
said otherwise (w = DataLoader num_workers, measured with 0 and 2):

    L_decode       the decode limit: decoding the in-memory bytes and nothing
                   else, one process, in batches of 128 (a list, no stacking).
                   Measured three times, with PIL (Image.open(BytesIO(b)).load()),
                   torchvision.io.decode_jpeg (decode_image for the PNGs) and
                   simplejpeg.decode_jpeg (TurboJPEG's API, which
                   tpustream.data.crops decodes with; PIL for what it refuses),
                   all libjpeg-turbo; the fastest is the limit (printed; all in
                   results.json). One row, no mode.
    L              the stock limit: PIL decode + stock transforms + torch.stack
                   from the bytes in memory, one process, no I/O.
    L_ours         our limit: tpustream.data.crops (CroppingDecoder(ImageDecoder(3,
                   224, 224, 10, image_key="jpg"), ...).for_epoch(0) on sample dicts
                   {"jpg": bytes, "cls": b"<label>", "__id__": index}) through the
                   decode_samples and batch_samples stages (uint8 batches);
                   one process, no tar, no I/O.
    A  (w)         torchvision ImageFolder over the files + stock transforms,
                   DataLoader(batch_size=128, shuffle=train).
    B  (w)         the reference ImageNet WebDataset chain on the local shards:
                   WebDataset(urls, shardshuffle=100).shuffle(1000).decode("pil")
                   .to_tuple("jpg", "cls").map_tuple(stock_transform, int).batched(128)
                   in DataLoader(batch_size=None); eval: shardshuffle=False and no
                   .shuffle.
    C  (w)         B reading the gs:// shards from the emulator. webdataset opens
                   gs:// with a `gsutil cat` subprocess and gsutil is not installed,
                   so an in-process opener in webdataset.gopen.gopen_schemes returns
                   tpustream.storage.open_read.
    ours-local (w) tpustream's ShardStream(train_crop="random_resized",
                   eval_crop_ratio=0.875, hflip, shuffle_buffer=1000 (train),
                   last_batch="drop") through make_loader, as the trainer builds it,
                   on the local shards. The split comes from
                   tpustream.data.splits.load_split(folder, "train",
                   SplitOptions(num_classes=10, image_size=224, crop=True)), which
                   counts the shards and saves tpustream-index.json, once, before
                   any timing.
    ours-gcs (w)   the same on the gs:// shards (its index saved in the bucket).
    ours-nodct-local (w=0 only)
                   ours-local with DCT-domain downscaling off (the stream's
                   CroppingDecoder replaced by one with use_dct=False): what
                   that trick buys.

Timing: one untimed warm-up of the first 4 batches of a pass (a whole pass
here takes seconds to a minute), then full timed passes, repeated until at
least --min-seconds have been measured. The clock of a pass starts when its
first batch arrives and only samples after that batch count, so DataLoader
worker start-up (and filling the first shuffle buffer) is not charged to any
configuration. samples/s = counted samples / measured wall seconds.
torch.set_num_threads(1) is set for the whole run so the single-process
configurations get one core like each DataLoader worker. A 0-worker row uses
one core; a 2-worker row both cores of this machine (two workers and the
consuming process). "x L" is relative to L of the same mode (L_decode's to L
train), "x L_decode" to L_decode. The "other load" column is the CPU (in
cores) other programs used meanwhile: above ~0.1 the row was slowed by
someone else and should be rerun. The default --num-images is a multiple of
128 x 2 workers, so no configuration drops or pads a batch.

DCT share: for every image, whether the crop L_ours draws for it (training,
epoch 0; and the evaluation crop) is shrunk enough for a 1/2, 1/4 or 1/8 DCT
scale (CropPlan.dct_factor in tpustream.data.crops); PNGs never are.

What each choice buys ("tricks"): on the first 1,024 colour and grey JPEG
photos in memory, with their training crops (epoch 0), one core, each
variant against its alternative: TurboJPEG (simplejpeg) against PIL decoding
to a numpy array; torch's uint8 antialiasing resample of the crop against
PIL's bilinear resize of the same box; tpustream.data.crops.decode_crop with
DCT-domain scaling on and off, over all crops and over only those it
applies to. The variants run interleaved, 5 rounds (quick: 3), and report
their median: rows measured one after the other drift by as much as these
differences on a shared machine.

Normalisation: what tpustream's Normalizer would cost an image on the host
(best of 6 on a random uint8 batch) is printed with what ours-local train
w=0 would reach if it paid that too.

Outputs: OUT/results.json and OUT/imagenet_pipeline.png (samples/s bars, training
and evaluation panels).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import io
import json
import math
import multiprocessing
import os
import sys
import tempfile
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import simplejpeg
import torch
import webdataset as wds
from common import (  # bench/common.py: the helpers input_pipeline.py shares
    Batch,
    Epoch,
    ForeignCpu,
    environment,
    format_table,
    measure,
    open_gs_in_process,
    plot_bars,
)
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import transforms
from torchvision.datasets import ImageFolder
from torchvision.io import decode_image, decode_jpeg

from tpustream import storage
from tpustream.data.augment import Normalizer
from tpustream.data.crops import CroppingDecoder, SampleRandom, center_plan, decode_crop, random_resized_plan
from tpustream.data.decode import ImageDecoder
from tpustream.data.loader import ShardStream, make_loader
from tpustream.data.manifest import ShardManifest
from tpustream.data.splits import SplitOptions, load_split
from tpustream.data.stages import ErrorPolicy, augment_batches, batch_samples, decode_samples
from tpustream.data.tar_stream import iter_shard_samples
from tpustream.emulator import GcsEmulator

BATCH_SIZE = 128
IMAGE_SIZE = 224
EVAL_CROP_RATIO = 0.875  # Resize(256) + CenterCrop(224)
NUM_CLASSES = 10
MEAN = (0.485, 0.456, 0.406)  # ImageNet's (conf/data/imagenet.yaml uses the same)
STD = (0.229, 0.224, 0.225)
WORKER_COUNTS = (0, 2)
SHUFFLE_BUFFER = 1000
SHARD_SHUFFLE = 100
MAX_SAMPLES_PER_SHARD = 256
WARMUP_BATCHES = 4
TRICK_IMAGES = 1024  # JPEG photos the trick comparison runs over
TRICK_ROUNDS = 5  # quick: 3
SEED = 0
DEFAULT_NUM_IMAGES = 3072
QUICK_NUM_IMAGES = 512
MODES = ("train", "eval")
RATIOS = (("x L", "x_L"), ("x L_decode", "x_L_decode"))
B_BATCHING = "WebDataset.batched(128) + DataLoader(batch_size=None)"
SPLIT_OPTIONS = SplitOptions(num_classes=NUM_CLASSES, image_size=IMAGE_SIZE, crop=True, progress=False)

# The generated photos (see the module docstring).
LONG_SIDE_MEDIAN = 380
LONG_SIDE_SIGMA = 0.28
LONG_SIDE_RANGE = (80, 2500)
LARGE_SHARE, LARGE_RANGE = 0.015, (700, 2500)
ASPECT_MAX, WIDE_SHARE, WIDE_ASPECT_MAX = 4 / 3, 0.1, 2.0
PORTRAIT_SHARE = 0.2
REGION_SCALE = (0.5, 1.0)
GRAIN_SIGMA = (12.0, 28.0)
QUALITY_RANGE = (85, 96)  # inclusive
ODD_SHARES = {"gray": 0.005, "cmyk": 0.005, "png": 0.002}
GENERATOR_PROCESSES = 2


# --------------------------------------------------------------------------- data


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


@functools.cache
def source_photos() -> tuple[Image.Image, ...]:
    from sklearn.datasets import load_sample_images

    return tuple(Image.fromarray(pixels) for pixels in load_sample_images().images)


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
    source = source_photos()[index % 2]
    scale = min(source.width / width, source.height / height) * rng.uniform(*REGION_SCALE)
    region_w, region_h = width * scale, height * scale
    left = rng.uniform(0.0, source.width - region_w)
    top = rng.uniform(0.0, source.height - region_h)
    image = source.resize((width, height), Image.BICUBIC, box=(left, top, left + region_w, top + region_h))
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

    # At least 2 shards per DataLoader worker, as a real dataset would have.
    per_shard = min(MAX_SAMPLES_PER_SHARD, len(photos) // (2 * max(WORKER_COUNTS)))
    local = os.path.join(workdir, "imagenet-train")
    os.makedirs(local)
    with wds.ShardWriter(
        os.path.join(local, "imagenet-train-%06d.tar"), maxcount=per_shard, verbose=0
    ) as sink:
        for index, (photo, label) in enumerate(zip(photos, labels, strict=True)):
            sink.write({"__key__": image_key(index), "jpg": photo.data, "cls": label})
    names = sorted(os.listdir(local))
    gcs = f"gs://{bucket}/imagenet-train"
    for name in names:
        storage.write_bytes(storage.join(gcs, name), storage.read_bytes(os.path.join(local, name)))

    index_seconds = {}
    for where, spec in (("local", local), ("gcs", gcs)):
        started = time.perf_counter()
        data.splits[where] = load_split(spec, "train", SPLIT_OPTIONS)  # counts, saves the index
        index_seconds[where] = time.perf_counter() - started
    # The shards must hold the very bytes L_decode, L, L_ours and A decode.
    first = data.shard_urls("local")[0]
    with storage.open_read(first) as stream:
        if not {sample["jpg"] for sample in iter_shard_samples(stream, first)} <= {p.data for p in photos}:
            raise RuntimeError(f"{first}: jpg members differ from the in-memory image bytes")
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


# ------------------------------------------------------------------ configurations


def stock_transform(train: bool) -> transforms.Compose:
    crop = (
        [transforms.RandomResizedCrop(IMAGE_SIZE), transforms.RandomHorizontalFlip()]
        if train
        else [transforms.Resize(round(IMAGE_SIZE / EVAL_CROP_RATIO)), transforms.CenterCrop(IMAGE_SIZE)]
    )
    # The stock configuration: crop, flip, ToTensor (float 0..1), no Normalize.
    return transforms.Compose([*crop, transforms.ToTensor()])


def in_batches(items: list, labels: list[int]) -> Iterator[tuple[list, list[int]]]:
    for start in range(0, len(items), BATCH_SIZE):
        yield items[start : start + BATCH_SIZE], labels[start : start + BATCH_SIZE]


def limit_decode_pil(data: BenchData, workers: int, train: bool) -> Epoch:
    """L_decode (PIL): Image.open + load on in-memory bytes."""
    encoded = [photo.data for photo in data.photos]

    def epoch() -> Iterator[Batch]:
        for batch, labels in in_batches(encoded, data.labels):
            images = []
            for jpg in batch:
                image = Image.open(io.BytesIO(jpg))
                image.load()
                images.append(image)
            yield images, labels

    return epoch


def limit_decode_torchvision(data: BenchData, workers: int, train: bool) -> Epoch:
    """L_decode (torchvision): decode_jpeg on in-memory bytes (decode_image for the PNGs)."""
    # bytearray: torch.frombuffer warns about read-only buffers; the copy is made here, untimed.
    encoded = [
        (torch.frombuffer(bytearray(p.data), dtype=torch.uint8), p.data[:2] == b"\xff\xd8")
        for p in data.photos
    ]

    def epoch() -> Iterator[Batch]:
        for batch, labels in in_batches(encoded, data.labels):
            yield [decode_jpeg(t) if is_jpeg else decode_image(t) for t, is_jpeg in batch], labels

    return epoch


def limit_decode_simplejpeg(data: BenchData, workers: int, train: bool) -> Epoch:
    """L_decode (simplejpeg): TurboJPEG's own API, which ours uses.

    PIL decodes what TurboJPEG refuses (the PNGs and CMYK JPEGs), as ours does.
    """
    encoded = [photo.data for photo in data.photos]

    def decode(data: bytes):
        try:
            return simplejpeg.decode_jpeg(data)
        except ValueError:
            image = Image.open(io.BytesIO(data))
            image.load()
            return image

    def epoch() -> Iterator[Batch]:
        for batch, labels in in_batches(encoded, data.labels):
            yield [decode(jpg) for jpg in batch], labels

    return epoch


def limit_stock(data: BenchData, workers: int, train: bool) -> Epoch:
    """L: PIL decode + stock transforms + torch.stack from in-memory bytes."""
    transform = stock_transform(train)
    encoded = [photo.data for photo in data.photos]

    def epoch() -> Iterator[Batch]:
        for batch, labels in in_batches(encoded, data.labels):
            images = [transform(Image.open(io.BytesIO(jpg)).convert("RGB")) for jpg in batch]
            yield torch.stack(images), torch.tensor(labels)

    return epoch


def limit_ours(data: BenchData, workers: int, train: bool) -> Epoch:
    """L_ours: tpustream's crops and batching on in-memory sample dicts (uint8 batches, as the trainer's)."""
    decoder = ImageDecoder(3, IMAGE_SIZE, IMAGE_SIZE, NUM_CLASSES, image_key="jpg")
    crops = CroppingDecoder(decoder, train, SEED, EVAL_CROP_RATIO).for_epoch(0)
    # What read_span_samples yields, minus the tar and the I/O.
    samples = [
        {
            "__key__": image_key(index),
            "__url__": "memory",
            "jpg": photo.data,
            "cls": str(label).encode(),
            "__padding__": False,
            "__id__": index,
        }
        for index, (photo, label) in enumerate(zip(data.photos, data.labels, strict=True))
    ]

    def epoch() -> Iterator[Batch]:
        decoded = decode_samples(samples, crops, ErrorPolicy("raise"))
        # Full batches only, like ShardStream(last_batch="drop").
        batches = batch_samples(decoded, BATCH_SIZE, len(samples) // BATCH_SIZE, decoder.shape)
        return augment_batches(batches, None, 0, False)

    return epoch


def image_folder(data: BenchData, workers: int, train: bool) -> Epoch:
    """A: one file per image, torchvision ImageFolder, DataLoader collation."""
    dataset = ImageFolder(data.image_folder, transform=stock_transform(train))
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=train, num_workers=workers)
    return lambda: iter(loader)


def stock_webdataset(data: BenchData, workers: int, train: bool, where: str) -> Epoch:
    """B (local) / C (gcs): the reference ImageNet WebDataset chain with per-sample stock transforms."""
    dataset = wds.WebDataset(data.shard_urls(where), shardshuffle=SHARD_SHUFFLE if train else False)
    if train:
        dataset = dataset.shuffle(SHUFFLE_BUFFER)
    dataset = (
        dataset.decode("pil")
        .to_tuple("jpg", "cls")
        .map_tuple(stock_transform(train), int)
        .batched(BATCH_SIZE)
    )
    loader = DataLoader(dataset, batch_size=None, num_workers=workers)
    return lambda: iter(loader)


def ours(data: BenchData, workers: int, train: bool, where: str, use_dct: bool = True) -> Epoch:
    """ours-*: ShardStream through make_loader, as the trainer builds it (uint8, normalised on the device)."""
    stream = ShardStream(
        data.splits[where],
        batch_size=BATCH_SIZE,
        rank=0,
        world_size=1,
        num_workers=workers,
        train=train,
        seed=SEED,
        shuffle_buffer=SHUFFLE_BUFFER,
        last_batch="drop",
        train_crop="random_resized",
        eval_crop_ratio=EVAL_CROP_RATIO,
        hflip=True,
    )
    if not use_dct:
        stream.crops = dataclasses.replace(stream.crops, use_dct=False)
    loader = make_loader(stream, workers)
    return lambda: iter(loader)


@dataclass(frozen=True)
class Config:
    name: str
    build: Callable[[BenchData, int, bool], Epoch]
    workers: tuple[int, ...] = WORKER_COUNTS  # () marks a single-process limit


# The decode limit is the fastest of these, the decoder tpustream.data.crops uses among them.
DECODE_LIMITS = {
    "PIL": limit_decode_pil,
    "torchvision": limit_decode_torchvision,
    "simplejpeg": limit_decode_simplejpeg,
}
CONFIGS = [
    Config("L", limit_stock, ()),
    Config("L_ours", limit_ours, ()),
    Config("A", image_folder),
    Config("B", functools.partial(stock_webdataset, where="local")),
    Config("C", functools.partial(stock_webdataset, where="gcs")),
    Config("ours-local", functools.partial(ours, where="local")),
    Config("ours-gcs", functools.partial(ours, where="gcs")),
    Config("ours-nodct-local", functools.partial(ours, where="local", use_dct=False), (0,)),
]


# ---------------------------------------------------------------------- running


def measure_row(label: str, build: Callable[[], Epoch], min_seconds: float) -> dict:
    print(f"  {label:<24}", end="", flush=True)
    with ForeignCpu() as foreign:
        result = measure(build(), min_seconds, WARMUP_BATCHES)
        gc.collect()  # shut down (and reap) persistent DataLoader workers
    print(f"{result['samples_per_s']:>8.0f} samples/s  (other load {foreign.cores:.2f} cores)", flush=True)
    return {**result, "foreign_cores": foreign.cores}


def run_configs(data: BenchData, min_seconds: float) -> tuple[list[dict], dict]:
    """Every row, L_decode first (the fastest decoder), then each mode's configurations."""
    candidates = {
        decoder: measure_row(f"L_decode ({decoder})", lambda build=build: build(data, 0, True), min_seconds)
        for decoder, build in DECODE_LIMITS.items()
    }
    fastest = max(DECODE_LIMITS, key=lambda decoder: candidates[decoder]["samples_per_s"])
    rows = [{"name": "L_decode", "mode": None, "workers": None, "decoder": fastest, **candidates[fastest]}]
    for mode in MODES:
        for config in CONFIGS:
            for workers in config.workers or (None,):
                label = f"{config.name} {mode}" + ("" if workers is None else f" w={workers}")
                build = functools.partial(config.build, data, workers or 0, mode == "train")
                rows.append(
                    {
                        "name": config.name,
                        "mode": mode,
                        "workers": workers,
                        **measure_row(label, build, min_seconds),
                    }
                )
    return rows, candidates


def find_row(rows: list[dict], name: str, mode: str | None = None, workers: int | None = None) -> dict:
    return next(r for r in rows if r["name"] == name and r["mode"] == mode and r["workers"] == workers)


def add_ratios(rows: list[dict]) -> None:
    decode = find_row(rows, "L_decode")["samples_per_s"]
    for r in rows:
        r["x_L"] = r["samples_per_s"] / find_row(rows, "L", r["mode"] or "train")["samples_per_s"]
        r["x_L_decode"] = r["samples_per_s"] / decode


def goal_ratios(rows: list[dict]) -> list[dict]:
    """The ratios issue 11 sets goals for (training, 0 workers = one core), and their eval / 2-worker kin."""

    def ratio(text: str, top: dict, bottom: dict, goal: float | None) -> dict:
        value = top["samples_per_s"] / bottom["samples_per_s"]
        return {"ratio": text, "value": value, "goal": goal, "met": None if goal is None else value >= goal}

    out = []
    for mode in MODES:
        goal = (lambda g: g) if mode == "train" else (lambda g: None)  # the goals are for training crops
        local0 = find_row(rows, "ours-local", mode, 0)
        out += [
            ratio(f"ours-local {mode} w=0 / L {mode}", local0, find_row(rows, "L", mode), goal(2.0)),
            ratio(f"ours-local {mode} w=0 / L_decode", local0, find_row(rows, "L_decode"), goal(0.8)),
            ratio(f"ours-local {mode} w=0 / L_ours {mode}", local0, find_row(rows, "L_ours", mode), None),
        ]
        for workers in WORKER_COUNTS:
            out.append(
                ratio(
                    f"ours-gcs {mode} w={workers} / ours-local {mode} w={workers}",
                    find_row(rows, "ours-gcs", mode, workers),
                    find_row(rows, "ours-local", mode, workers),
                    goal(0.9),
                )
            )
        out.append(
            ratio(
                f"ours-local {mode} w=0 / ours-nodct-local {mode} w=0 (what DCT scaling buys)",
                local0,
                find_row(rows, "ours-nodct-local", mode, 0),
                None,
            )
        )
        out.append(
            ratio(
                f"ours-local {mode} w=2 / B {mode} w=2",
                find_row(rows, "ours-local", mode, 2),
                find_row(rows, "B", mode, 2),
                None,
            )
        )
    return out


def normalize_seconds_per_image() -> float:
    """Seconds an image tpustream's Normalizer takes on the host: best of 6 on a uint8 batch."""
    normalize = Normalizer(MEAN, STD)
    batch = torch.randint(0, 256, (BATCH_SIZE, 3, IMAGE_SIZE, IMAGE_SIZE), dtype=torch.uint8)
    best = math.inf
    for _ in range(6):
        started = time.perf_counter()
        normalize(batch)
        best = min(best, time.perf_counter() - started)
    return best / BATCH_SIZE


def dct_shares(data: BenchData) -> dict:
    """Per mode, how many images' crops (as L_ours draws them) each DCT scale factor decodes at."""
    shares = {}
    for mode in MODES:
        factors: Counter = Counter()
        for index, photo in enumerate(data.photos):
            if photo.kind == "png":
                factors["not JPEG"] += 1
                continue
            if mode == "train":
                rnd = SampleRandom(SEED, 0, index)
                plan = random_resized_plan(photo.height, photo.width, IMAGE_SIZE, rnd, True)
            else:
                plan = center_plan(photo.height, photo.width, IMAGE_SIZE, EVAL_CROP_RATIO)
            factors[f"1/{plan.dct_factor()}"] += 1
        scaled = sum(n for factor, n in factors.items() if factor in ("1/2", "1/4", "1/8"))
        order = ["1/1", "1/2", "1/4", "1/8", "not JPEG"]
        images_per_factor = {factor: factors[factor] for factor in order if factor in factors}
        shares[mode] = {"share_scaled": scaled / len(data.photos), "images_per_factor": images_per_factor}
    return shares


# ------------------------------------------------------------------------ tricks


def measure_tricks(data: BenchData, rounds: int) -> list[dict]:
    """What each of ours' choices buys, one against its alternative on the same images, one core.

    The JPEG photos' training crops (epoch 0), in memory; every variant runs
    over all of them once per round, the variants interleaved, and each
    reports the median of its rounds: on a shared machine, a row measured
    alone can be off by 15% from one minute to the next, which is as much as
    the differences measured here.
    """
    photos = [p for p in data.photos if p.kind in ("rgb", "gray")][:TRICK_IMAGES]
    plans = [
        random_resized_plan(p.height, p.width, IMAGE_SIZE, SampleRandom(SEED, 0, i), True)
        for i, p in enumerate(photos)
    ]
    scaled = [(p, plan) for p, plan in zip(photos, plans, strict=True) if plan.dct_factor() > 1]
    pixels = [simplejpeg.decode_jpeg(p.data) for p in photos]  # untimed inputs of the resample variants
    pil_images = [Image.fromarray(px) for px in pixels]
    size = (IMAGE_SIZE, IMAGE_SIZE)

    def torch_resample() -> None:
        for px, plan in zip(pixels, plans, strict=True):
            left, top, right, bottom = plan.region
            region = torch.from_numpy(px[top:bottom, left:right]).permute(2, 0, 1)[None]
            torch.nn.functional.interpolate(region, size=size, mode="bilinear", antialias=True)

    def crops(items: list, use_dct: bool) -> Callable[[], None]:
        def run() -> None:
            for photo, plan in items:
                decode_crop(photo.data, lambda h, w, plan=plan: plan, IMAGE_SIZE, 3, use_dct)

        return run

    pairs = list(zip(photos, plans, strict=True))
    variants = {
        "decode: TurboJPEG (simplejpeg)": (
            len(photos),
            lambda: [simplejpeg.decode_jpeg(p.data) for p in photos],
        ),
        "decode: PIL + numpy": (
            len(photos),
            lambda: [np.asarray(Image.open(io.BytesIO(p.data)).convert("RGB")) for p in photos],
        ),
        "resample crop: torch uint8 antialias": (len(photos), torch_resample),
        "resample crop: PIL bilinear (box)": (
            len(photos),
            lambda: [
                im.resize(size, Image.BILINEAR, box=plan.region)
                for im, plan in zip(pil_images, plans, strict=True)
            ],
        ),
        "ours' crop, DCT scaling on": (len(pairs), crops(pairs, True)),
        "ours' crop, DCT scaling off": (len(pairs), crops(pairs, False)),
        "ours' crop, DCT on, scaled images only": (len(scaled), crops(scaled, True)),
        "ours' crop, DCT off, scaled images only": (len(scaled), crops(scaled, False)),
    }
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (_, run) in variants.items():
            if variants[name][0] == 0:
                continue
            started = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - started)
    rows = []
    for name, (count, _) in variants.items():
        if count:
            rates = sorted(count / t for t in seconds[name])
            rows.append({"variant": name, "images": count, "median": rates[len(rates) // 2], "rates": rates})
    return rows


def trick_ratios(rows: list[dict]) -> list[tuple[str, float]]:
    median = {r["variant"]: r["median"] for r in rows}
    pairs = [
        ("TurboJPEG / PIL decode", "decode: TurboJPEG (simplejpeg)", "decode: PIL + numpy"),
        ("torch / PIL resample", "resample crop: torch uint8 antialias", "resample crop: PIL bilinear (box)"),
        ("DCT scaling on / off, all crops", "ours' crop, DCT scaling on", "ours' crop, DCT scaling off"),
        (
            "DCT scaling on / off, the crops it applies to",
            "ours' crop, DCT on, scaled images only",
            "ours' crop, DCT off, scaled images only",
        ),
    ]
    return [
        (text, median[top] / median[bottom])
        for text, top, bottom in pairs
        if top in median and bottom in median
    ]


def format_tricks(rows: list[dict]) -> str:
    width = max(len(r["variant"]) for r in rows)
    lines = [f"  {'variant':<{width}}  images  median/s  (min-max over rounds)"]
    for r in rows:
        spread = f"({r['rates'][0]:.0f}-{r['rates'][-1]:.0f})"
        lines.append(f"  {r['variant']:<{width}}  {r['images']:>6}  {r['median']:>8.0f}  {spread}")
    lines += [f"  {text}: {value:.2f}x" for text, value in trick_ratios(rows)]
    return "\n".join(lines)


# ---------------------------------------------------------------------- report


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


def format_ratios(ratios: list[dict]) -> str:
    width = max(len(r["ratio"]) for r in ratios)
    lines = []
    for r in ratios:
        line = f"  {r['ratio']:<{width}}  {r['value']:5.2f}"
        if r["goal"] is not None:
            line += f"   goal >= {r['goal']:.1f}: {'met' if r['met'] else 'NOT met'}"
        lines.append(line)
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Training and evaluation panels of samples/s, with lines at L_decode and the mode's L."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [[r for r in rows if r["mode"] == mode] for mode in MODES]
    fig, axes = plt.subplots(
        2, 1, figsize=(9.5, 0.36 * sum(map(len, panels)) + 2.4), height_ratios=[len(p) for p in panels]
    )
    decode = find_row(rows, "L_decode")
    for ax, mode, panel in zip(axes, MODES, panels, strict=True):
        handles = plot_bars(ax, panel, RATIOS, [decode, find_row(rows, "L", mode)], WORKER_COUNTS)
        ax.set_xlim(0, 1.45 * max(r["samples_per_s"] for r in [*panel, decode]))
        ax.set_title(f"{mode} transforms", fontsize=9)
        ax.legend(handles=handles, loc="upper right", fontsize=7)
    axes[-1].set_xlabel("samples/s (higher is better)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    here = Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-images", type=int, default=None, help=f"default {DEFAULT_NUM_IMAGES}")
    parser.add_argument(
        "--out", type=Path, default=None, help="default bench/results/imagenet (quick: .../quick)"
    )
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK_NUM_IMAGES} images")
    parser.add_argument(
        "--min-seconds", type=float, default=None, help="timed seconds per config (3; quick 1)"
    )
    args = parser.parse_args(argv)
    if args.num_images is None:
        args.num_images = QUICK_NUM_IMAGES if args.quick else DEFAULT_NUM_IMAGES
    if args.out is None:
        args.out = here / "results" / "imagenet"
        if args.quick:
            args.out /= "quick"
    if args.min_seconds is None:
        args.min_seconds = 1.0 if args.quick else 3.0
    if args.num_images < 4 * BATCH_SIZE:
        parser.error(f"--num-images must be at least {4 * BATCH_SIZE}")
    return args


def main(argv: list[str] | None = None, command: str | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the single-process configs get one core, like each DataLoader worker
    open_gs_in_process()
    warnings.filterwarnings("ignore", message=".*shardshuffle.*")
    if command is None:
        command = " ".join(["python", os.path.relpath(__file__), *(sys.argv[1:] if argv is None else argv)])
    started = time.time()

    print(f"generating {args.num_images} ImageNet-like images ...", flush=True)
    photos = make_photos(args.num_images, SEED)  # forked before the emulator and its client start
    generated = time.time() - started
    with (
        tempfile.TemporaryDirectory(prefix="tpustream-bench-imagenet-") as workdir,
        GcsEmulator() as emulator,
    ):
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        storage.gcs_client().create_bucket(bucket)
        print(f"writing files, local shards and gs://{bucket} on {emulator.url}; indexing both", flush=True)
        data, info = prepare_data(photos, workdir, bucket)
        info["generate_seconds"] = generated
        dct = dct_shares(data)
        print(f"{describe_data(info)}\ntorch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs")
        print(
            f"B/C batching: {B_BATCHING}\n"
            "C reads gs:// through an in-process webdataset gopen handler (tpustream.storage.open_read) "
            "because gsutil is unavailable\n"
            f"timing: warm-up of {WARMUP_BATCHES} batches, then passes timed from their first batch "
            "(DataLoader worker start-up excluded); 'other load' = cores busy with other programs meanwhile",
            flush=True,
        )
        rows, candidates = run_configs(data, args.min_seconds)
        print(f"  tricks: {TRICK_ROUNDS if not args.quick else 3} interleaved rounds ...", flush=True)
        tricks = measure_tricks(data, 3 if args.quick else TRICK_ROUNDS)

    add_ratios(rows)
    ratios = goal_ratios(rows)
    normalize_cost = normalize_seconds_per_image()
    local0 = find_row(rows, "ours-local", "train", 0)["samples_per_s"]
    with_normalize = 1.0 / (1.0 / local0 + normalize_cost)
    decoder = rows[0]["decoder"]
    print(f"\n{format_table(rows, RATIOS)}\n")
    print(
        "L_decode: "
        + ", ".join(f"{name} {c['samples_per_s']:.0f} samples/s" for name, c in candidates.items())
        + f" -> {decoder} is the decode limit"
    )
    for mode, share in dct.items():
        print(
            f"DCT-domain scaling applies to {100 * share['share_scaled']:.1f}% of the {mode} crops "
            f"(images per scale: {share['images_per_factor']})"
        )
    print(
        f"ours delivers uint8 batches (the trainer normalises on the device); normalising them on the host "
        f"would cost {1000 * normalize_cost:.2f} ms an image: ours-local train w=0 would then be "
        f"~{with_normalize:.0f} samples/s "
        f"({with_normalize / find_row(rows, 'L', 'train')['samples_per_s']:.2f}x L)"
    )
    print(
        "\nratios (a 0-worker row is one core; a 2-worker row uses both cores: two workers, consumer)\n"
        + format_ratios(ratios)
    )
    print("\nwhat each choice buys (one core, training crops, in memory; medians of interleaved rounds)")
    print(format_tricks(tricks))
    results = {
        "command": command,
        "seconds_total": time.time() - started,
        "data": info,
        "settings": {
            "batch_size": BATCH_SIZE,
            "image_size": IMAGE_SIZE,
            "eval_crop_ratio": EVAL_CROP_RATIO,
            "shuffle_buffer": SHUFFLE_BUFFER,
            "shardshuffle": SHARD_SHUFFLE,
            "mean": MEAN,
            "std": STD,
            "torch_threads": 1,
            "min_seconds": args.min_seconds,
            "timing": f"warm-up of {WARMUP_BATCHES} batches, then passes timed from their first batch",
            "foreign_cores": "CPU cores used by other programs during the configuration (shared machine)",
            "B_C_batching": B_BATCHING,
            "C_opener": "in-process gs:// gopen handler -> tpustream.storage.open_read (no gsutil)",
            "ours_last_batch": "drop",
            "L_decode": f"fastest of {list(DECODE_LIMITS)}: {decoder}",
        },
        "environment": environment(),
        "decode_candidates": candidates,
        "configs": rows,
        "ratios": ratios,
        "dct_scaling": dct,
        "tricks": tricks,
        "trick_ratios": dict(trick_ratios(tricks)),
        "normalize_ms_per_image": 1000 * normalize_cost,
        "ours_local_train_w0_if_normalised_on_host": with_normalize,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    chart = args.out / "imagenet_pipeline.png"
    title = (
        f"{args.num_images} ImageNet-like JPEGs ({info['avg_bytes'] / 1000:.0f} KB, "
        f"{info['avg_width']:.0f}x{info['avg_height']:.0f} avg) to 224x224, batch {BATCH_SIZE}, "
        f"1 torch thread, {os.cpu_count()} CPUs"
    )
    plot(rows, chart, title)
    print(f"\nwrote {args.out / 'results.json'} and {chart} ({time.time() - started:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
