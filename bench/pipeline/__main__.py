"""The input-pipeline benchmark's command line: python -m bench.pipeline [--dataset NAME] [options]."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from bench import pipeline
from bench.pipeline import cifar, imagenet, scaling
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
    parser.add_argument(
        "--workers",
        type=worker_counts,
        default=None,
        help="imagenet only: instead of the configurations, how the trainer's loader scales with these "
        "DataLoader worker counts, e.g. 1,2,4 (bench.pipeline.scaling)",
    )
    parser.add_argument(
        "--data",
        default=os.path.join(tempfile.gettempdir(), "tpustream-scaling"),
        help="--workers: where its images are made once and reused",
    )
    parser.add_argument(
        "--stage-images",
        type=int,
        default=scaling.DEFAULT_STAGE_IMAGES,
        help="--workers: images the per-stage times are measured on",
    )
    parser.add_argument(
        "--decode",
        choices=("host", "device"),
        default="host",
        help="--workers: data.decode (device: the workers send JPEGs, the GPU decodes them)",
    )
    args = parser.parse_args(argv)
    if args.workers is not None:
        if args.dataset != "imagenet":
            parser.error("--workers measures the imagenet pipeline: add --dataset imagenet")
        if args.num_images is None:
            args.num_images = scaling.DEFAULT_NUM_IMAGES
        if args.out is None:
            args.out = BENCH / imagenet.RESULTS / "scaling"
        if args.min_seconds is None:
            args.min_seconds = 5.0
        return args
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


def worker_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"worker counts separated by commas, e.g. 1,2,4; got {text!r}"
        ) from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"worker counts must be at least 1; got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    command = " ".join(["python", "-m", "bench.pipeline", *argv])
    if args.workers is not None:
        return scaling.run(args, command)
    return DATASETS[args.dataset].run(args, command)


if __name__ == "__main__":
    sys.exit(main())
