"""python -m bench.loaders: make or reuse the data, measure each library, print the table, write the JSON."""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import bench.loaders
from bench.harness import REPO
from bench.loaders import report
from bench.loaders.data import DataSpec, LoaderData, describe_data, prepare_data
from bench.loaders.libraries import READERS
from bench.loaders.measure import Settings, measure_elastic, measure_rate

# Settings (argparse dest: value) a plain run and a --quick one start from; the command line wins.
FULL = {
    "images": 3072,
    "samples_per_shard": 256,
    "batch_size": 32,
    "warmup": 8,
    "measured": 40,
    "workers": "1,2",
    "elastic_workers": 2,
}
QUICK = {
    **FULL,
    "images": 256,
    "samples_per_shard": 32,
    "batch_size": 16,
    "warmup": 2,
    "measured": 6,
    "workers": "1",
    "elastic_workers": 1,
}
DATA_ROOT = Path("/tmp/tpustream-loaders")  # outside the repository: a device run copies the working tree
OUT = REPO / "bench" / "results" / "loaders.json"


def worker_counts(text: str) -> list[int]:
    """--workers "1,2" -> [1, 2], each at least 1 (every library here batches in its workers)."""
    try:
        counts = list(dict.fromkeys(int(part) for part in text.split(",") if part.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: worker counts are whole numbers separated by commas"
        ) from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: one or more worker counts, each at least 1")
    return counts


def library_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(names) - set(READERS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: libraries are among {', '.join(READERS)}")
    return [name for name in READERS if name in names]  # the table's order


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.loaders",
        description=bench.loaders.__doc__.splitlines()[0],
        epilog="Defaults are for the full run; --quick changes those it names.",
    )
    add = parser.add_argument
    add("--quick", action="store_true", help="256 images, batch 16, 2 + 6 batches, 1 worker: a smoke run")
    add("--images", type=int, help="JPEGs made (3072; quick 256)")
    add("--samples-per-shard", type=int, help="tar shard size, MDS shards of about its bytes (256; quick 32)")
    add("--batch-size", type=int, help="a rank's batch (32; quick 16); the 1-rank resume reads twice that")
    add("--warmup", type=int, help="batches read before the timing (8; quick 2)")
    add(
        "--measured", type=int, help="batches timed; the state is taken after warmup + measured (40; quick 6)"
    )
    add("--workers", type=worker_counts, help='worker counts, a row each ("1,2"; quick "1")')
    add("--elastic-workers", type=int, help="workers a rank in the 2 -> 1 ranks resume (2; quick 1)")
    add("--libraries", type=library_names, default=list(READERS), help=f"some of {','.join(READERS)} (all)")
    add(
        "--data",
        type=Path,
        help=f"data folder, reused when made for the same settings (default {DATA_ROOT}/...)",
    )
    add("--out", type=Path, default=OUT, help=f"results JSON (default {OUT.relative_to(REPO)})")
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, worker_counts(value) if name == "workers" else value)
    if min(args.images, args.samples_per_shard, args.batch_size, args.warmup, args.measured) < 1:
        parser.error(
            "--images, --samples-per-shard, --batch-size, --warmup and --measured must be at least 1"
        )
    if args.elastic_workers < 1:
        parser.error("--elastic-workers must be at least 1")
    epoch = args.images // args.batch_size
    if args.warmup + args.measured >= epoch:
        parser.error(
            f"--warmup + --measured ({args.warmup + args.measured}) must stay inside an epoch of "
            f"{epoch} batches: the state is taken mid-epoch"
        )
    if args.images // (2 * args.batch_size) // 2 < 1:
        parser.error(
            "--images must hold at least 2 global batches of 2 x --batch-size (the 2 -> 1 ranks stop)"
        )
    if args.data is None:
        args.data = DATA_ROOT / ("quick" if args.quick else f"{args.images}-images")
    return args


def measure_library(name: str, data: LoaderData, workers: list[int], settings: Settings) -> dict[str, Any]:
    """A library's rows (one per worker count) and its 2 -> 1 ranks resume; "missing" without it."""
    reader_class = READERS[name]
    found: dict[str, Any] = {"name": name, "rows": []}
    missing = reader_class.missing()
    if missing:
        print(f"{name}: {missing}", flush=True)
        return found | {"missing": missing}
    for count in workers:
        try:
            row = measure_rate(reader_class, data, count, settings)
        except Exception as error:  # one library failing leaves the others' rows
            row = {"workers": count, "error": f"{type(error).__name__}: {error}".splitlines()[0]}
        found["rows"].append(row)
        print(f"{name} w={count}: {describe_row(row)}", flush=True)
    try:
        found["elastic"] = measure_elastic(reader_class, data, settings)
    except Exception as error:
        found["elastic"] = {"error": f"{type(error).__name__}: {error}".splitlines()[0]}
    print(f"{name} 2 -> 1 ranks: {report.elastic_cell(found['elastic'])}", flush=True)
    return found


def describe_row(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"fails: {row['error']}"
    return (
        f"{row['images_per_second']:.1f} images/s, first batch {row['first_batch_seconds']:.2f} s, "
        f"state {report.state_cell(row)}, resume {report.resume_cell(row)} s"
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    started = datetime.datetime.now().astimezone()
    spec = DataSpec(args.images, args.samples_per_shard)
    data, record = prepare_data(spec, args.data.resolve(), with_mds="mosaic" in args.libraries)
    print(describe_data(record), flush=True)
    settings = Settings(args.batch_size, args.warmup, args.measured, args.elastic_workers)
    results: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "bench.loaders", *argv]),
        "measured": started.isoformat(timespec="minutes"),
        "settings": {key: getattr(args, key) for key in (*FULL, "quick")},
        "data": {"folder": str(data.root), **record},
        "environment": report.environment(),
        "libraries": [],
    }
    for name in args.libraries:
        results["libraries"].append(measure_library(name, data, args.workers, settings))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        # After every library: a run cut off from outside keeps what it measured.
        args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    results["seconds"] = (datetime.datetime.now().astimezone() - started).total_seconds()
    args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"\n{report.format_table(results)}\n")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
