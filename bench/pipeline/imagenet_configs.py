"""The ImageNet-like benchmark's configurations: how each row of bench.pipeline.imagenet reads its images.

Every builder takes (data, workers, train) and returns an epoch; train False
is the evaluation form (centre crops, no shuffling).
"""

from __future__ import annotations

import dataclasses
import functools
import io
from collections.abc import Iterator

import simplejpeg
import torch
from PIL import Image
from torchvision import transforms
from torchvision.io import decode_image, decode_jpeg

from bench.pipeline import harness
from bench.pipeline.harness import NUM_CLASSES, SEED, Batch, Config, Epoch, in_batches
from bench.pipeline.imagenet_data import IMAGE_SIZE, BenchData, image_key
from tpustream.config import AugmentConfig
from tpustream.data.format.decode import ImageDecoder
from tpustream.data.read.crops import CroppingDecoder
from tpustream.data.read.loader import make_loader

EVAL_CROP_RATIO = 0.875  # Resize(256) + CenterCrop(224)
MEAN = (0.485, 0.456, 0.406)  # ImageNet's (conf/data/imagenet.yaml uses the same)
STD = (0.229, 0.224, 0.225)
SHUFFLE_BUFFER = 1000
MODES = ("train", "eval")  # every configuration but L_decode runs in both forms


def stock_transform(train: bool) -> transforms.Compose:
    crop = (
        [transforms.RandomResizedCrop(IMAGE_SIZE), transforms.RandomHorizontalFlip()]
        if train
        else [transforms.Resize(round(IMAGE_SIZE / EVAL_CROP_RATIO)), transforms.CenterCrop(IMAGE_SIZE)]
    )
    # The stock configuration: crop, flip, ToTensor (float 0..1), no Normalize.
    return transforms.Compose([*crop, transforms.ToTensor()])


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
    return harness.stock_limit([photo.data for photo in data.photos], data.labels, stock_transform(train))


def limit_ours(data: BenchData, workers: int, train: bool) -> Epoch:
    """L_ours: tpustream's crops and batching on in-memory sample dicts (uint8 batches, as the trainer's)."""
    decoder = ImageDecoder(3, IMAGE_SIZE, IMAGE_SIZE, NUM_CLASSES, image_key="jpg")
    crops = CroppingDecoder(decoder, train, SEED, EVAL_CROP_RATIO).for_epoch(0)
    keys = [image_key(index) for index in range(len(data.photos))]
    samples = harness.memory_samples("jpg", keys, [photo.data for photo in data.photos], data.labels)
    return lambda: harness.ours_in_memory(samples, crops, decoder.shape, None, 0)


def image_folder(data: BenchData, workers: int, train: bool) -> Epoch:
    """A: one file per image, torchvision ImageFolder, DataLoader collation."""
    return harness.image_folder(data.image_folder, stock_transform(train), train, workers)


def stock_webdataset(data: BenchData, workers: int, train: bool, where: str) -> Epoch:
    """B (local) / C (gcs): the reference ImageNet WebDataset chain with per-sample stock transforms."""
    shuffle_buffer = SHUFFLE_BUFFER if train else None
    return harness.stock_webdataset(
        data.shard_urls(where), "jpg", stock_transform(train), workers, shuffle_buffer
    )


def ours(
    data: BenchData,
    workers: int,
    train: bool,
    where: str,
    use_dct: bool = True,
    augment: AugmentConfig | None = None,
) -> Epoch:
    """ours-*: ShardStream through make_loader, as the trainer builds it (uint8, normalised on the device).

    augment: each training batch also carries the device augmentation's draws (bench.augment).
    """
    stream = harness.make_stream(
        data.splits[where],
        workers,
        SHUFFLE_BUFFER,
        train,
        augment,
        train_crop="random_resized",
        eval_crop_ratio=EVAL_CROP_RATIO,
    )
    if not use_dct:
        stream.crops = dataclasses.replace(stream.crops, use_dct=False)
    loader = make_loader(stream, workers)
    return lambda: iter(loader)


# The decode limit is the fastest of these, the decoder tpustream.data.read.crops uses among them.
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
