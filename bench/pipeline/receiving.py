"""What receiving a batch's pieces costs the replica's process, per piece and per batch.

    .venv/bin/python -m bench.pipeline.receiving                    # workers 1,2,4,8,16
    .venv/bin/python -m bench.pipeline.receiving --workers 15,16 --pieces 8000
    .venv/bin/python -m bench.pipeline.receiving --workers 2,4,8 --pieces 240 \
        --batch-bytes 17000000 --bytes-as numpy        # or tensor
    .venv/bin/python -m bench.pipeline.receiving --workers 15 --contend python  # or torch

A DataLoader like the trainer's (batch_size=None, the items as they are,
persistent workers forked from a fork server, prefetch_factor 4) over
workers that yield, as fast as they can, the small messages tpustream's
workers send under a canonical partition: a piece of a 256-sample batch
(labels, sample ids and the real mask as numpy arrays pickled inline, the
slot number, the fill count) whose pixels went into the shared slots. The
receiving thread's CPU time (time.thread_time) over --pieces pieces, after
200 untimed ones, is what DataLoader's bookkeeping, the pipe and the
unpickling take from the replica's process per piece; times the workers,
per batch. That thread holds the GIL for most of it: it is the most the
receiving can take from a training thread sharing that GIL.

--contend python|torch runs, beside the receiving thread, a thread that
stands in for a training thread holding the GIL: a pure-Python loop (holds
it until Python's switch interval takes it away, 5 ms) or a loop of small
torch operations (each releases it while torch runs it, as an eager GPU
step's launches do). The receiving thread's wall time a piece then shows
what waiting for the GIL adds to its CPU time.

--batch-bytes N adds to each piece its share of N bytes, as data.decode=device's
pieces carry their JPEGs (about 17 MB a batch of 256 ImageNet JPEGs):
--bytes-as tensor sends them as a torch tensor (DataLoader moves it into a
shared-memory file and sends its handle), numpy pickles them inline.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from tpustream.data.read.loader import worker_context

BATCH = 256
WARM_UP = 200


class Pieces(IterableDataset):
    """Each worker's share of `pieces` messages, each a piece of a BATCH-sample batch split `workers` ways."""

    def __init__(self, workers: int, pieces: int, batch_bytes: int = 0, bytes_as: str = "tensor"):
        self.size, self.count = BATCH // workers, (pieces + WARM_UP) // workers + 1
        self.piece_bytes, self.bytes_as = batch_bytes // workers, bytes_as

    def __iter__(self) -> Iterator[dict]:
        size = self.size
        labels, real = np.zeros(size, np.int64), np.ones(size, np.float32)
        ids = np.arange(size, dtype=np.int64)
        for index in range(self.count):
            piece = {"slot": index, "filled": 0, "label": labels, "real": real, "sample_id": ids}
            piece["bad_shards"] = []
            if self.piece_bytes:
                data = np.zeros(self.piece_bytes, np.uint8)  # a new buffer each, as a worker's batch is
                piece["encoded"] = torch.from_numpy(data) if self.bytes_as == "tensor" else data
            yield piece


def _unchanged(item: dict) -> dict:
    return item


def contend(kind: str, stop: threading.Event) -> None:
    """Hold the GIL as a training thread would, until stop: pure Python, or small torch operations."""
    a, b = torch.ones(64), torch.ones(64)
    while not stop.is_set():
        for _ in range(200):
            if kind == "python":
                sum(range(50))
            else:
                a.add_(b)


def measure(
    workers: int, pieces: int, batch_bytes: int = 0, bytes_as: str = "tensor", contender: str | None = None
) -> dict[str, float]:
    loader = DataLoader(
        Pieces(workers, pieces, batch_bytes, bytes_as),
        batch_size=None,
        collate_fn=_unchanged,
        num_workers=workers,
        prefetch_factor=4,
        persistent_workers=True,
        multiprocessing_context=worker_context(),  # the loader's own fork server, preload included
    )
    items = iter(loader)
    for _ in range(WARM_UP):
        next(items)
    stop = threading.Event()
    other = threading.Thread(target=contend, args=(contender, stop), daemon=True) if contender else None
    if other is not None:
        other.start()
    start, cpu = time.perf_counter(), time.thread_time()
    received = 0
    for _ in zip(range(pieces), items, strict=False):
        received += 1
    wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
    stop.set()
    if other is not None:
        other.join()
    items._shutdown_workers()
    return {
        "workers": workers,
        "pieces": received,
        "cpu_us_per_piece": 1e6 * cpu / received,
        "wall_us_per_piece": 1e6 * wall / received,
        "cpu_ms_per_batch": 1e3 * cpu / received * workers,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.pipeline.receiving", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--workers", default="1,2,4,8,16", help="DataLoader worker counts (default 1,2,4,8,16)"
    )
    parser.add_argument("--pieces", type=int, default=4000, help="pieces timed per worker count (4000)")
    parser.add_argument(
        "--batch-bytes", type=int, default=0, help="bytes a batch's pieces carry between them"
    )
    parser.add_argument("--bytes-as", choices=("tensor", "numpy"), default="tensor", help="how they travel")
    parser.add_argument(
        "--contend", choices=("python", "torch"), help="a thread holding the GIL beside the receiving"
    )
    args = parser.parse_args(argv)
    print("| workers | CPU us a piece | wall us a piece | CPU ms a batch of 256 |")
    print("| ---: | ---: | ---: | ---: |")
    for workers in (int(part) for part in args.workers.split(",")):
        row = measure(workers, args.pieces, args.batch_bytes, args.bytes_as, args.contend)
        print(
            f"| {workers} | {row['cpu_us_per_piece']:.0f} | {row['wall_us_per_piece']:.0f} "
            f"| {row['cpu_ms_per_batch']:.2f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
