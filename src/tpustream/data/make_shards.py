"""Write WebDataset tar shards and a manifest per split, to a folder or gs:// prefix.

    tpustream-make-shards digits data/digits
    tpustream-make-shards cifar10 gs://BUCKET/cifar10 --source cifar-10-python.tar.gz --upsample 25
    tpustream-make-shards imagefolder gs://BUCKET/imagenet --source /data/imagenet --image-size 128

Layout: OUTPUT/<split>/<split>-NNNNNN.tar with members <key>.<png|jpg|raw> and
<key>.cls, and OUTPUT/<split>/manifest.json, written last: a split is usable
exactly when its manifest exists. Shard bytes are deterministic, every write
is atomic and identical shards already in place are skipped, so a rerun after
an interruption finishes the job without rewriting what is done.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import re
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
from PIL import Image
from tqdm import tqdm

from tpustream import storage
from tpustream.data.manifest import IMAGE_FORMATS, MANIFEST_NAME, ShardInfo, ShardManifest
from tpustream.data.sources import (
    ImageRef,
    SplitSource,
    cifar_splits,
    digits_splits,
    imagefolder_splits,
    load_image_file,
)
from tpustream.data.tar_stream import write_tar
from tpustream.errors import ConfigError, TpustreamError

log = logging.getLogger(__name__)

SOURCES = ("digits", "cifar10", "cifar100", "imagefolder")
# Per-source defaults: digits is tiny, and a few shards let two DataLoader
# workers read in parallel; CIFAR follows the seed setup (1.28M images in 640
# shards); ImageNet-sized JPEGs make ~100 MB shards at 1000 per shard.
DEFAULT_SAMPLES_PER_SHARD = {"digits": 256, "cifar10": 2000, "cifar100": 2000, "imagefolder": 1000}
JPEG_QUALITY = 95


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:06d}.tar"


def encode_image(image: np.ndarray, image_format: str, quality: int = JPEG_QUALITY) -> bytes:
    """A uint8 CHW image as png, jpg or raw (the CHW bytes themselves)."""
    if image_format == "raw":
        return np.ascontiguousarray(image, np.uint8).tobytes()
    hwc = image.transpose(1, 2, 0)
    pil = Image.fromarray(hwc[..., 0] if hwc.shape[2] == 1 else hwc)
    out = io.BytesIO()
    if image_format == "png":
        pil.save(out, format="PNG")
    else:
        pil.save(out, format="JPEG", quality=quality)
    return out.getvalue()


@dataclass
class ShardTask:
    """One shard to build and write; pickled to a worker process."""

    url: str
    keys: list[str]
    images: list[ImageRef]
    labels: list[int]
    image_format: str
    image_size: int

    def run(self) -> tuple[str, int, bool]:
        """Build the tar and write it unless identical bytes are already there."""
        members = []
        for key, image, label in zip(self.keys, self.images, self.labels, strict=True):
            if isinstance(image, str):
                image = load_image_file(image, self.image_size)
            members.append((f"{key}.{self.image_format}", encode_image(image, self.image_format)))
            members.append((f"{key}.cls", str(label).encode()))
        data = write_tar(members)
        if storage.has_same_content(self.url, data):
            return self.url, len(self.keys), False
        storage.write_bytes(self.url, data)
        return self.url, len(self.keys), True


def _run_task(task: ShardTask) -> tuple[str, int, bool]:
    return task.run()


def sample_order(num_samples: int, upsample: int, shuffle: bool, seed: int) -> np.ndarray:
    """Source indices in write order: each sample `upsample` times, mixed when shuffling.

    Shuffling at write time matters: image folders are sorted by class, and
    shards of one class defeat any shuffle buffer of reasonable size.
    """
    order = np.tile(np.arange(num_samples), upsample)
    if shuffle:
        np.random.default_rng([seed, 0x5EED]).shuffle(order)
    return order


def write_split(
    split: SplitSource,
    output: str,
    *,
    samples_per_shard: int,
    image_format: str,
    upsample: int = 1,
    seed: int = 0,
    workers: int = 1,
    progress: bool = True,
) -> tuple[ShardManifest, int]:
    """Write one split's shards and then its manifest; returns (manifest, shards written)."""
    folder = storage.join(output, split.name)
    is_train = split.name == "train"
    order = sample_order(len(split), upsample if is_train else 1, shuffle=is_train, seed=seed)
    tasks = []
    for index, start in enumerate(range(0, len(order), samples_per_shard)):
        chunk = order[start : start + samples_per_shard]
        tasks.append(
            ShardTask(
                url=storage.join(folder, shard_name(split.name, index)),
                keys=[f"{position:08d}" for position in range(start, start + len(chunk))],
                images=[split.images[i] for i in chunk],
                labels=[int(split.labels[i]) for i in chunk],
                image_format=image_format,
                image_size=split.image_size[0],
            )
        )
    manifest = ShardManifest(
        split=split.name,
        classes=split.classes,
        image_size=split.image_size,
        channels=split.channels,
        image_format=image_format,
        shards=[ShardInfo(t.url, len(t.keys)) for t in tasks],
    )
    manifest_url = storage.join(folder, MANIFEST_NAME)
    manifest_text = manifest.to_json(folder).encode()
    # A manifest describing other shards (another seed, size or format) must
    # not stay visible while its shards are overwritten: a reader would trust
    # its counts. Without a manifest the split is plainly unusable until done.
    if not storage.has_same_content(manifest_url, manifest_text) and storage.delete(manifest_url):
        log.info("%s: removed the previous manifest; it describes different shards", manifest_url)
    written = 0
    bar = tqdm(total=len(order), desc=f"{split.name} shards", unit="img", disable=not progress)
    if workers > 1 and len(tasks) > 1:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            for _, count, did_write in pool.map(_run_task, tasks):
                written += did_write
                bar.update(count)
    else:
        for task in tasks:
            _, count, did_write = task.run()
            written += did_write
            bar.update(count)
    bar.close()
    _warn_stale_shards(folder, split.name, len(tasks))
    storage.write_bytes(manifest_url, manifest_text)
    return manifest, written


def _warn_stale_shards(folder: str, split: str, count: int) -> None:
    """Shards of an earlier, larger run stay (we never delete user data); say so."""
    try:
        names = storage.list_names(folder)
    except TpustreamError:
        return
    pattern = re.compile(rf"{re.escape(split)}-(\d{{6}})\.tar$")
    stale = [n for n in names if (m := pattern.match(n)) and int(m.group(1)) >= count]
    if stale:
        log.warning(
            "%s: %d shard file(s) from an earlier run are not in the new manifest (first: %s); "
            "they are left in place and ignored",
            folder,
            len(stale),
            stale[0],
        )


def load_source(args: argparse.Namespace) -> list[SplitSource]:
    if args.source_kind == "digits":
        return digits_splits(args.seed)
    if not args.source:
        raise ConfigError(f"{args.source_kind} needs --source PATH (the downloaded tarball or folder)")
    if args.source_kind in ("cifar10", "cifar100"):
        return cifar_splits(args.source, args.source_kind)
    return imagefolder_splits(args.source, args.image_size)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tpustream-make-shards",
        description="Write WebDataset tar shards plus a manifest per split.",
    )
    parser.add_argument("source_kind", choices=SOURCES, help="what to convert")
    parser.add_argument("output", help="output folder or gs://bucket/prefix")
    parser.add_argument("--source", help="CIFAR tarball/folder, or image folder (not for digits)")
    parser.add_argument("--upsample", type=int, default=1, help="repeat the training split K times")
    parser.add_argument(
        "--samples-per-shard",
        type=int,
        default=None,
        help="samples per tar (default: digits 256, cifar 2000, imagefolder 1000)",
    )
    parser.add_argument(
        "--image-format",
        choices=IMAGE_FORMATS,
        default="png",
        help="png, jpg, or raw (uint8 CHW pixels: no decode at training time)",
    )
    parser.add_argument(
        "--image-size", type=int, default=None, help="imagefolder: resize shorter side and center-crop to SxS"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the training-split write order (and of the digits train/test split)",
    )
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="encoding processes")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.upsample < 1:
        parser.error("--upsample must be at least 1")
    if args.samples_per_shard is not None and args.samples_per_shard < 1:
        parser.error("--samples-per-shard must be at least 1")
    if args.image_size is not None and args.image_size < 1:
        parser.error("--image-size must be at least 1")
    return args


def make_shards(args: argparse.Namespace) -> list[ShardManifest]:
    output = storage.absolute(args.output)
    if storage.is_gcs(output):
        bucket, _ = storage.split_gcs_url(output)
        if not storage.bucket_exists(bucket):
            raise ConfigError(f"{output}: bucket gs://{bucket} does not exist; create it first")
    splits = load_source(args)
    per_shard = args.samples_per_shard or DEFAULT_SAMPLES_PER_SHARD[args.source_kind]
    manifests = []
    for split in splits:
        manifest, written = write_split(
            split,
            output,
            samples_per_shard=per_shard,
            image_format=args.image_format,
            upsample=args.upsample,
            seed=args.seed,
            workers=args.workers,
            progress=not args.no_progress,
        )
        manifests.append(manifest)
        print(
            f"{split.name}: {manifest.num_samples} samples, {len(manifest.classes)} classes, "
            f"{len(manifest.shards)} shard(s) ({written} written, {len(manifest.shards) - written} "
            f"already in place) -> {storage.join(output, split.name, MANIFEST_NAME)}",
            flush=True,
        )
    return manifests


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    args = parse_args(argv)
    try:
        make_shards(args)
    except TpustreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
