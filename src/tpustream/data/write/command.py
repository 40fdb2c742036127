"""Write WebDataset tar shards and a manifest per split, to a folder or gs:// prefix.

    tpustream-make-shards digits data/digits
    tpustream-make-shards cifar10 gs://BUCKET/cifar10 --source cifar-10-python.tar.gz --upsample 25
    tpustream-make-shards imagefolder gs://BUCKET/imagenet --source /data/imagenet
    tpustream-make-shards imagefolder gs://BUCKET/imagenet-512 --source /data/imagenet --max-side 512
    tpustream-make-shards imagefolder gs://BUCKET/imagenet-128 --source /data/imagenet --image-size 128

An image folder's files are kept as they are, their bytes copied (under jpg
for .jpg/.jpeg files, else their extension), as ImageNet shards usually hold
the original JPEGs; --max-side N shrinks the images larger than N to N on
their longer side and re-encodes them as JPEG; --image-size S resizes and
center-crops every image to SxS instead. The manifest records the images'
sizes (image_size null when they vary, and image_sizes: count, min, max, mean).

Layout: OUTPUT/<split>/<split>-NNNNNN.tar with members <key>.<png|jpg|raw|...>
and <key>.cls, and OUTPUT/<split>/manifest.json, written last: a split is usable
exactly when its manifest exists. Shard bytes are deterministic, every write
is atomic and identical shards already in place are skipped, so a rerun after
an interruption (Ctrl-C included) finishes the job without rewriting what is
done. Unreadable image files are left out and counted (--on-error skip, the
default) or stop the run naming the file (--on-error raise). The writing itself
is tpustream.data.write.writer; this module is the command.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from tpustream import storage
from tpustream.data.format.manifest import MANIFEST_NAME, ShardManifest
from tpustream.data.write.image_sources import (
    CIFAR_SIZE,
    DIGITS_SIZE,
    SplitSource,
    cifar_splits,
    digits_splits,
    imagefolder_splits,
)
from tpustream.data.write.writer import (
    DEFAULT_ENCODED_FORMAT,
    ENCODED_FORMATS,
    JPEG_QUALITY,
    MAX_LOGGED_SKIPS,
    ON_ERROR_CHOICES,
    SkippedImages,
    write_split,
)
from tpustream.errors import ConfigError, TpustreamError

SOURCES = ("digits", "cifar10", "cifar100", "imagefolder")
# Per-source defaults: digits is tiny, and a few shards let two DataLoader
# workers read in parallel; CIFAR follows the seed setup (1.28M images in 640
# shards); ImageNet-sized JPEGs make ~100 MB shards at 1000 per shard.
DEFAULT_SAMPLES_PER_SHARD = {"digits": 256, "cifar10": 2000, "cifar100": 2000, "imagefolder": 1000}
# Sources whose images have one fixed size: --image-size and --max-side do not apply to them.
FIXED_IMAGE_SIZES = {"digits": DIGITS_SIZE, "cifar10": CIFAR_SIZE, "cifar100": CIFAR_SIZE}
# 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C.
INTERRUPTED_EXIT_CODE = 130


def load_source(args: argparse.Namespace) -> list[SplitSource]:
    if args.source_kind == "digits":
        return digits_splits(args.seed)
    if not args.source:
        raise ConfigError(f"{args.source_kind} needs --source PATH (the downloaded tarball or folder)")
    if args.source_kind in ("cifar10", "cifar100"):
        return cifar_splits(args.source, args.source_kind)
    return imagefolder_splits(args.source, args.image_size)


def _quality(text: str) -> int:
    """--quality: an integer from 1 to 100, or argparse's usage error."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 100:
        raise argparse.ArgumentTypeError(f"must be an integer from 1 to 100, got {text!r}")
    return value


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
        choices=ENCODED_FORMATS,
        default=None,
        help="how pixels are stored: png (default), jpg, or raw (uint8 CHW pixels: no decode at "
        "training time); for imagefolder only with --image-size (else the files are kept as they are)",
    )
    parser.add_argument(
        "--image-size",
        type=int,
        default=None,
        help="imagefolder: resize the shorter side and center-crop every image to SxS, re-encoded "
        "(default: keep each file's bytes as they are)",
    )
    parser.add_argument(
        "--max-side",
        type=int,
        default=None,
        help="imagefolder: shrink images whose longer side exceeds N to N (aspect kept) and re-encode "
        "them as JPEG; smaller images are kept as they are",
    )
    parser.add_argument(
        "--quality",
        type=_quality,
        default=JPEG_QUALITY,
        help=f"JPEG quality (1-100) of the images this command encodes (default {JPEG_QUALITY})",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the training-split write order (and of the digits train/test split)",
    )
    parser.add_argument(
        "--on-error",
        choices=ON_ERROR_CHOICES,
        default="skip",
        help="an unreadable image file: skip (leave it out, count it, log the first "
        f"{MAX_LOGGED_SKIPS}) or raise (stop, naming the file)",
    )
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="encoding processes")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.upsample < 1:
        parser.error("--upsample must be at least 1")
    if args.samples_per_shard is not None and args.samples_per_shard < 1:
        parser.error("--samples-per-shard must be at least 1")
    for flag, value in (("--image-size", args.image_size), ("--max-side", args.max_side)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be at least 1")
        if value is not None and args.source_kind in FIXED_IMAGE_SIZES:
            size = FIXED_IMAGE_SIZES[args.source_kind]
            parser.error(f"{flag} applies to imagefolder only; {args.source_kind} images are {size}x{size}")
    if args.image_size is not None and args.max_side is not None:
        parser.error(
            "--image-size and --max-side exclude each other: --image-size makes every image SxS, "
            "--max-side only shrinks the large ones and keeps the rest as they are"
        )
    if args.source_kind == "digits" and args.source is not None:
        parser.error("--source is not for digits: scikit-learn ships the digits images")
    if args.source_kind == "imagefolder" and args.image_size is None and args.image_format is not None:
        parser.error(
            "--image-format applies to imagefolder only with --image-size: without it the image files "
            "are kept as they are (and --max-side re-encodes the large ones as JPEG)"
        )
    if args.image_format is None:
        args.image_format = DEFAULT_ENCODED_FORMAT
    return args


def make_shards(args: argparse.Namespace) -> list[ShardManifest]:
    output = storage.absolute(args.output)
    # A missing bucket is one line before the (possibly long) source load; a bad
    # source then leaves no output folder behind.
    storage.check_container(output)
    splits = load_source(args)
    per_shard = args.samples_per_shard or DEFAULT_SAMPLES_PER_SHARD[args.source_kind]
    skipped = SkippedImages()
    manifests = []
    for split in splits:
        manifest, written = write_split(
            split,
            output,
            samples_per_shard=per_shard,
            image_format=args.image_format,
            max_side=args.max_side,
            quality=args.quality,
            upsample=args.upsample,
            seed=args.seed,
            workers=args.workers,
            progress=not args.no_progress,
            on_error=args.on_error,
            skipped=skipped,
        )
        manifests.append(manifest)
        print(
            f"{split.name}: {manifest.num_samples} samples, {len(manifest.classes)} classes, "
            f"{len(manifest.shards)} shard(s) ({written} written, {len(manifest.shards) - written} "
            f"already in place) -> {storage.join(output, split.name, MANIFEST_NAME)}",
            flush=True,
        )
    if skipped:
        print(skipped.describe(), file=sys.stderr, flush=True)
    return manifests


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    args = parse_args(argv)
    try:
        make_shards(args)
    except TpustreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # The worker pool is shut down on the way out (writer._run_tasks);
        # shard writes are atomic and a split's manifest is written only once
        # all its shards are, so what is left is consistent and a rerun resumes.
        print(
            "interrupted: the shards written so far are kept; rerun the same command to finish "
            "(identical shards are skipped)",
            file=sys.stderr,
        )
        return INTERRUPTED_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
