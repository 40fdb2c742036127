"""tpustream-index: count the samples of WebDataset shards once and save the counts beside them.

    tpustream-index gs://BUCKET/laion/{00000..09999}.tar
    tpustream-index /data/cifar-train --output-dir gs://BUCKET/runs/r50   # shards read-only
    tpustream-index gs://BUCKET/in1k/train --force                       # recount every shard

train.py does the same at start (data.index=auto) for shards without
recorded counts; running it beforehand moves that time out of the job and,
on a pod, out of every host's start-up.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from tpustream import storage
from tpustream.data.resolve.counting import (
    COUNT_THREADS,
    count_into_index,
    group_by_folder,
    read_index,
    shards_to_count,
)
from tpustream.data.resolve.shard_spec import expand_spec
from tpustream.errors import TpustreamError


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tpustream-index",
        description="Count the samples of WebDataset shards and save tpustream-index.json beside them.",
    )
    parser.add_argument(
        "shards",
        nargs="+",
        help="folders, gs:// prefixes, brace patterns or index files (as data.train_shards)",
    )
    parser.add_argument(
        "--output-dir", help="where to save the index when the shards' folder is not writable (a run folder)"
    )
    parser.add_argument(
        "--force", action="store_true", help="recount every shard, not only new or changed ones"
    )
    parser.add_argument("--threads", type=int, default=COUNT_THREADS, help="shards read at once")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error("--threads must be at least 1")
    return args


def index_shards(args: argparse.Namespace) -> int:
    """Count what is missing, changed (or everything with --force); returns the samples indexed."""
    urls = expand_spec(list(args.shards)).urls
    output_dir = storage.absolute(args.output_dir) if args.output_dir else None
    total = 0
    for folder, members in group_by_folder(urls).items():
        _, entries = read_index(folder, output_dir)
        if args.force:
            todo = members
        else:
            missing, stale = shards_to_count(entries, members)
            todo = missing + stale
        if todo:
            saved, rate = count_into_index(
                folder, entries, todo, output_dir, progress=not args.no_progress, threads=args.threads
            )
            if saved is None:
                # The command's one job failed: say where it can save instead, and fail.
                where = f" nor in {output_dir}" if output_dir else "; give --output-dir (e.g. a run folder)"
                raise TpustreamError(
                    f"{folder}: counted {rate.describe()}, but the index could not be saved beside the "
                    f"shards{where}"
                )
            print(f"{folder}: counted {rate.describe()}; index {saved}", flush=True)
        samples = sum(entries[u].samples for u in members)
        total += samples
        already = len(members) - len(todo)
        print(f"{folder}: {len(members)} shard(s), {samples} samples ({already} already indexed)", flush=True)
    return total


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    args = parse_args(argv)
    try:
        index_shards(args)
    except TpustreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: nothing was saved for the shards still being counted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
