"""python -m bench.feed: make or reuse the data, run every row, print the table and write results.json."""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import bench.feed
from bench.feed import report
from bench.feed.data import DataSpec, describe_data, prepare_data, train_shards
from bench.feed.rows import Row, describe_result, plan_rows, run_row
from bench.harness import REPO

# Settings (argparse dest: value) a plain run and a --quick one start from; the command line wins.
FULL = {
    "num_images": 13_000,
    "val_images": 500,
    "samples_per_shard": 500,
    "num_classes": 1000,
    "model": "resnet50",
    "image_size": 224,
    "batch_size": 256,
    "epochs": 3,
    "workers": "8,15",
    "device_workers": "4",
    "stock_workers": "15",
    "row_timeout": 150.0,
}
QUICK = {
    **FULL,
    "num_images": 320,
    "val_images": 64,
    "samples_per_shard": 64,
    "num_classes": 10,
    "model": "small_cnn",
    "image_size": 64,
    "batch_size": 32,
    "epochs": 2,
    "workers": "1",
    "device_workers": "1",
    "stock_workers": "1",
    "row_timeout": 120.0,
}
DATA_ROOT = Path("/tmp/tpustream-feed")  # outside the repository: a GPU run copies the working tree


def worker_counts(text: str) -> list[int]:
    """Worker counts from the command line: "8,15" -> [8, 15]; "" -> [] (no such rows)."""
    try:
        counts = list(dict.fromkeys(int(part) for part in text.split(",") if part.strip()))  # one row each
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: worker counts are whole numbers separated by commas"
        ) from None
    if any(count < 1 for count in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: every worker count must be at least 1")
    return counts


def trace_window(text: str) -> list[int]:
    """--trace-steps "START,END" as debug.profile_steps takes it: 1 <= START < END."""
    try:
        start, end = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: START,END, two global steps") from None
    if not 1 <= start < end:
        raise argparse.ArgumentTypeError(f"{text!r}: 1 <= START < END")
    return [start, end]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.feed",
        description=bench.feed.__doc__.splitlines()[0],
        epilog="Defaults are for the full run; --quick changes those it names.",
    )
    add = parser.add_argument
    add("--quick", action="store_true", help="320 images, small_cnn at 64 px, batch 32, 2 epochs, 1 worker")
    add("--accelerator", default="cuda", choices=("cuda", "cpu_eager"), help="cpu_eager: without a GPU")
    add(
        "--data",
        type=Path,
        help=f"data folder, reused when made for the same settings (default {DATA_ROOT}/...)",
    )
    add("--out", type=Path, help="results folder (default bench/results/feed/<time>)")
    add("--num-images", type=int, help="training images (13000; quick 320)")
    add("--val-images", type=int, help="validation images (500; quick 64)")
    add("--samples-per-shard", type=int, help="(500; quick 64)")
    add("--num-classes", type=int, help="(1000; quick 10)")
    add("--model", help="a train.py model name (resnet50; quick small_cnn)")
    add("--image-size", type=int, help="training crops' side (224; quick 64)")
    add("--batch-size", type=int, help="(256; quick 32)")
    add("--epochs", type=int, help="per row, epoch 0 left out of the rate (3; quick 2)")
    add("--workers", type=worker_counts, help='tpustream rows\' data.num_workers ("8,15"; quick "1")')
    add(
        "--device-workers",
        type=worker_counts,
        help='data.decode=device rows\' data.num_workers ("4"; quick "1"; "" none)',
    )
    add("--stock-workers", type=worker_counts, help='stock rows\' WebLoader workers ("15"; quick "1")')
    add("--row-timeout", type=float, help="seconds each row may run (150; quick 120)")
    add(
        "--trace-steps",
        type=trace_window,
        help="START,END: train.py rows trace global steps START+1..END (debug.profile_steps) into "
        "their run folder's tensorboard/; inside epoch 0, which the rate leaves out",
    )
    add("--dry-run", action="store_true", help="print the commands; make and run nothing")
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, worker_counts(value) if name.endswith("workers") else value)
    if args.epochs < 2:
        parser.error("--epochs must be at least 2 (epoch 0 is left out of the rate)")
    if min(args.num_images, args.val_images, args.samples_per_shard, args.num_classes, args.batch_size) < 1:
        parser.error("image counts, --samples-per-shard, --num-classes and --batch-size must be at least 1")
    if args.trace_steps and args.trace_steps[1] > args.num_images // args.batch_size:
        parser.error(
            f"--trace-steps {args.trace_steps}: the window must end in epoch 0 "
            f"(step {args.num_images // args.batch_size} at most), which the rate leaves out"
        )
    if args.data is None:
        args.data = DATA_ROOT / ("quick" if args.quick else f"{args.num_images}-images")
    return args


def data_spec(args: argparse.Namespace) -> DataSpec:
    return DataSpec(args.num_images, args.val_images, args.samples_per_shard, args.num_classes)


def results(args: argparse.Namespace, argv: Sequence[str], context: dict, rows: list[Row]) -> dict:
    """results.json: the command, the settings, the data, the machine and every row run so far."""
    report.add_ratios(rows)
    settings = {key: getattr(args, key) for key in (*FULL, "accelerator", "quick")}
    return {
        "command": shlex.join(["python", "-m", "bench.feed", *argv]),
        "measured": datetime.datetime.now().astimezone().isoformat(timespec="minutes"),
        "settings": settings,
        **context,
        "rows": [
            {
                "name": r.name,
                "input": r.input,
                "workers": r.workers,
                "folder": str(r.folder),
                "command": shlex.join(r.command),
                **r.result,
            }
            for r in rows
            if r.result
        ],
        "goals": report.goals(rows),
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = (args.out or REPO / "bench" / "results" / "feed" / stamp).resolve()
    root = args.data.resolve()
    rows = plan_rows(args, root, out / "runs", args.num_classes)
    if args.dry_run:
        print("\n".join(shlex.join(row.command) for row in rows))
        return 0
    data = prepare_data(data_spec(args), root)
    print(describe_data(data), flush=True)
    train_shards(root, args.image_size)  # tpustream resolves the split and reads its first samples, or fails
    context = {"data": {"folder": str(root), **data}, "environment": report.environment()}
    out.mkdir(parents=True, exist_ok=True)
    for row in rows:
        print(f"{row.name}: {shlex.join(row.command)}", flush=True)
        row.result = run_row(row, args.row_timeout)
        print(describe_result(row), flush=True)
        # After every row: a run cut off from outside keeps the rows it finished.
        found = results(args, argv, context, rows)
        (out / "results.json").write_text(json.dumps(found, indent=2, default=str) + "\n")
    print(f"\n{report.format_table(rows)}\n")
    print(report.describe_goals(found["goals"]))
    print(report.describe_environment(found["environment"]))
    print(f"results: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
