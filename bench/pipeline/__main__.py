"""The input-pipeline benchmark's command line: python -m bench.pipeline [--dataset NAME] [options]."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench import pipeline
from bench.pipeline import cifar, imagenet
from bench.pipeline.harness import BATCH_SIZE, BENCH

# Each dataset module supplies DEFAULT_NUM_IMAGES, QUICK_NUM_IMAGES, RESULTS (a
# folder under bench/), CONFIGS and run(args, command).
DATASETS = {"cifar": cifar, "imagenet": imagenet}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.pipeline", description=pipeline.__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--dataset",
        choices=DATASETS,
        default="cifar",
        help="cifar: 32x32 digit PNGs (bench.pipeline.cifar); "
        "imagenet: ImageNet-like JPEGs, 224 crops (bench.pipeline.imagenet)",
    )
    parser.add_argument(
        "--num-images",
        type=int,
        default=None,
        help=f"default {cifar.DEFAULT_NUM_IMAGES} (imagenet: {imagenet.DEFAULT_NUM_IMAGES})",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"default bench/{cifar.RESULTS} (imagenet: bench/{imagenet.RESULTS}; quick: .../quick)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: {cifar.QUICK_NUM_IMAGES} images (imagenet: {imagenet.QUICK_NUM_IMAGES})",
    )
    parser.add_argument(
        "--min-seconds", type=float, default=None, help="timed seconds per config (3; quick 1)"
    )
    parser.add_argument(
        "--profile",
        metavar="CONFIG",
        action="append",
        help="instead of benchmarking, cProfile one pass of CONFIG with 0 workers (repeatable; "
        "imagenet: its training form)",
    )
    args = parser.parse_args(argv)
    dataset = DATASETS[args.dataset]
    if args.num_images is None:
        args.num_images = dataset.QUICK_NUM_IMAGES if args.quick else dataset.DEFAULT_NUM_IMAGES
    if args.out is None:
        args.out = BENCH / dataset.RESULTS / "quick" if args.quick else BENCH / dataset.RESULTS
    if args.min_seconds is None:
        args.min_seconds = 1.0 if args.quick else 3.0
    if args.num_images < 4 * BATCH_SIZE:
        parser.error(f"--num-images must be at least {4 * BATCH_SIZE}")
    names = [config.name for config in dataset.CONFIGS]
    for name in args.profile or ():
        if name not in names:
            parser.error(f"--profile: unknown configuration {name!r}; one of {names}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    return DATASETS[args.dataset].run(args, " ".join(["python", "-m", "bench.pipeline", *argv]))


if __name__ == "__main__":
    sys.exit(main())
