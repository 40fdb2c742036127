"""How well an epoch's training order is mixed (issue 23): per-reader plan, canonical streams, webdataset.

Reproduce (from the repository root; no accelerator, no I/O: sample ids only; 16 s here):

    .venv/bin/python -m bench.shuffle            # -> bench/results/shuffle/results.json and .md
    .venv/bin/python -m bench.shuffle --quick    # 128 shards: 7 s

The layout is ImageNet's training split as shards are often written, in class
order (the case where the shuffle has all the work to do): 1,281,167 samples
in 1,024 shards of ~1,251, class = position x 1000 // N. Readers are replicas x
4 DataLoader workers; the global batch is 4,096 (a v3-32's 32 cores x 128).
Each order is built by the code that makes it in a run:

    per-reader   data.streams=0 (the plan before canonical streams): replica r
                 a contiguous range, its worker w a contiguous run of whole
                 batches, each worker a shuffle buffer of data.shuffle_buffer
                 (tpustream.data.read.layout split_by_replica / split_by_worker,
                 stages.shuffle_samples, ShardStream's generators).
    canonical    data.streams=auto for that shape (partition.choose_partition): C
                 streams, each a contiguous range with a buffer of
                 shuffle_buffer x readers / C, every global step taking the next
                 global_batch / C samples of each (plan.stream_spans).
    webdataset   webdataset's stock recipe: the shard list permuted per epoch,
                 split over replicas and workers shard by shard (split_by_node /
                 split_by_worker: shards[r::R], then [w::W]), webdataset's own
                 shuffle(bufsize=shuffle_buffer, initial=shuffle_buffer) per
                 worker; batches from the workers round-robin. Not an exact
                 epoch (replicas differ in samples); compared up to the fewest
                 steps any replica has.

Per global batch: the distinct shards and classes it holds, the total
variation distance of its class mix from the epoch's (0: every class in its
share), and the Pearson correlation of the class counts of batches 1 to 8
steps apart, at the most correlated lag (0: independent). A uniform random
permutation of the epoch is the reference row.
Canonical rows for 1, 4 and 16 streams a reader (auto is 4 where the batch and
the shards allow), each stream's buffer the reader's over its streams.
Memory: encoded samples the shuffle buffers hold per host (4 workers a host,
and 110 KB a sample, our ImageNet-like JPEGs) on the shape the run starts on.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tpustream.data.format.manifest import ShardInfo
from tpustream.data.read.layout import (
    CanonicalPartition,
    SampleSpan,
    order_shards,
    plan_layout,
    split_by_replica,
    split_by_worker,
    stream_spans,
)
from tpustream.data.read.partition import choose_partition
from tpustream.data.read.stages import shuffle_samples
from tpustream.data.read.stream import STREAM_SALT

RESULTS = Path(__file__).parent / "results" / "shuffle"
IMAGENET_SAMPLES = 1_281_167
CLASSES = 1000
WORKERS = 4  # per replica (a host's share)
GLOBAL_BATCH = 4096
SAMPLE_BYTES = 110_000
SEED, EPOCH = 0, 0
LAGS = 2 * WORKERS

Order = np.ndarray  # (steps, global batch) sample positions in the written layout


def layout(num_samples: int, num_shards: int) -> tuple[list[ShardInfo], np.ndarray]:
    """Shards of near-equal counts over samples written in class order; each sample's class."""
    sizes = np.full(num_shards, num_samples // num_shards)
    sizes[: num_samples % num_shards] += 1
    shards = [ShardInfo(f"shard-{i:05d}", int(n)) for i, n in enumerate(sizes)]
    classes = np.arange(num_samples) * CLASSES // num_samples
    return shards, classes


def positions(spans: list[SampleSpan], starts: dict[str, int]) -> list[int]:
    """The written positions (sample ids) of a list of spans."""
    return [p for span in spans for p in range(starts[span.url] + span.start, starts[span.url] + span.stop)]


def shard_starts(shards: list[ShardInfo]) -> dict[str, int]:
    ends = np.cumsum([s.samples for s in shards])
    return {s.url: int(end - s.samples) for s, end in zip(shards, ends, strict=True)}


def per_reader_order(shards: list[ShardInfo], replicas: int, buffer: int, global_batch: int) -> Order:
    """data.streams=0: what ShardStream.pipeline reads, replica by replica, worker by worker."""
    batch = global_batch // replicas
    plan = plan_layout(sum(s.samples for s in shards), batch, replicas)
    ordered = order_shards(shards, SEED, EPOCH, shuffle=True)
    starts = shard_starts(shards)
    steps = np.empty((plan.steps, replicas, batch), np.int64)
    for rank in range(replicas):
        replica = split_by_replica(ordered, plan, rank)
        worker_batches: list[list[np.ndarray]] = []
        for worker in range(WORKERS):
            rng = np.random.default_rng([SEED, EPOCH, rank, worker, 1])
            mine = positions(split_by_worker(replica, batch, worker, WORKERS), starts)
            flat = np.fromiter(shuffle_samples(mine, buffer, rng), np.int64, len(mine))
            worker_batches.append(list(flat.reshape(-1, batch)))
        for step in range(plan.steps):  # the DataLoader takes its workers round-robin
            steps[step, rank] = worker_batches[step % WORKERS][step // WORKERS]
    return steps.reshape(plan.steps, -1)


def canonical_order(shards: list[ShardInfo], partition: CanonicalPartition, global_batch: int) -> Order:
    """data.streams=C: every stream's chunks, stream by stream (ShardStream.stream_pipeline)."""
    plan = plan_layout(sum(s.samples for s in shards), global_batch, 1)
    ordered = order_shards(shards, SEED, EPOCH, shuffle=True)
    starts = shard_starts(shards)
    chunk = partition.stream_batch(global_batch)
    streams = []
    for stream in range(partition.streams):
        rng = np.random.default_rng([SEED, EPOCH, STREAM_SALT, stream, 1])
        mine = positions(stream_spans(ordered, plan, partition, stream), starts)
        flat = np.fromiter(shuffle_samples(mine, partition.stream_buffer, rng), np.int64, len(mine))
        streams.append(flat.reshape(plan.steps, chunk))
    return np.concatenate(streams, axis=1)


def webdataset_order(shards: list[ShardInfo], replicas: int, buffer: int, global_batch: int) -> Order:
    """webdataset's shard shuffle, node and worker split by shard, and its sample shuffle."""
    import random

    from webdataset.filters import _shuffle

    batch = global_batch // replicas
    starts = shard_starts(shards)
    permuted = [shards[i] for i in np.random.default_rng([SEED, EPOCH]).permutation(len(shards))]
    per_replica = []
    for rank in range(replicas):
        worker_batches = []
        for worker in range(WORKERS):
            mine = permuted[rank::replicas][worker::WORKERS]
            samples = iter(p for s in mine for p in range(starts[s.url], starts[s.url] + s.samples))
            rng = random.Random(SEED * 1_000_003 + rank * WORKERS + worker)
            flat = np.fromiter(_shuffle(samples, buffer, buffer, rng=rng), np.int64)
            worker_batches.append(flat[: len(flat) // batch * batch].reshape(-1, batch))
        steps = sum(len(b) for b in worker_batches)
        order = []
        for step in range(steps):
            source = worker_batches[step % WORKERS]
            if step // WORKERS >= len(source):
                break  # round-robin stops at the first worker that ran out here
            order.append(source[step // WORKERS])
        per_replica.append(order)
    common = min(len(order) for order in per_replica)
    return np.stack([np.concatenate([order[s] for order in per_replica]) for s in range(common)])


def random_order(num_samples: int, global_batch: int) -> Order:
    """The reference: a uniform random permutation of the epoch."""
    order = np.random.default_rng([SEED, 99]).permutation(num_samples)
    steps = num_samples // global_batch
    return order[: steps * global_batch].reshape(steps, global_batch)


def mixing(order: Order, shard_of: np.ndarray, classes: np.ndarray) -> dict[str, float]:
    """Distinct shards and classes per global batch, its distance from the epoch's mix, and likeness."""
    batch_shards = shard_of[order]
    batch_classes = classes[order]
    distinct_shards = [len(np.unique(row)) for row in batch_shards]
    distinct_classes = [len(np.unique(row)) for row in batch_classes]
    counts = np.stack([np.bincount(row, minlength=CLASSES) for row in batch_classes]).astype(np.float64)
    shares = counts / counts.sum(axis=1, keepdims=True)
    epoch = np.bincount(classes, minlength=CLASSES) / len(classes)
    # Total variation distance from the epoch's mix: 0 = every class in its share, 1 = disjoint.
    distance = 0.5 * np.abs(shares - epoch).sum(axis=1)
    # Pearson correlation of the class counts of batches 1 to LAGS steps apart, at the most
    # correlated lag: ~0 when independent. Several lags, as a per-reader order cycles
    # through its workers' batches (lag 4 is the same workers' next batches).
    centered = counts - counts.mean(axis=1, keepdims=True)
    unit = centered / np.linalg.norm(centered, axis=1, keepdims=True)
    correlation = [
        float(np.mean((unit[lag:] * unit[:-lag]).sum(axis=1)))
        for lag in range(1, min(LAGS, len(order) - 1) + 1)
    ]
    return {
        "steps": int(len(order)),
        "shards_per_batch": float(np.mean(distinct_shards)),
        "classes_per_batch": float(np.mean(distinct_classes)),
        "min_classes_per_batch": int(np.min(distinct_classes)),
        "class_distance": float(np.mean(distance)),
        "nearby_correlation": max(correlation),
        "nearby_lag": 1 + int(np.argmax(correlation)),
    }


def run(
    num_shards: int,
    num_samples: int,
    replica_counts: list[int],
    buffer: int,
    streams_per_reader: list[int],
    global_batch: int = GLOBAL_BATCH,
) -> dict:
    shards, classes = layout(num_samples, num_shards)
    shard_of = np.repeat(np.arange(num_shards), [s.samples for s in shards])
    rows: list[dict] = []

    def measure(name: str, replicas: int | None, build: Callable[[], Order], **extra) -> None:
        start = time.perf_counter()
        order = build()
        row = {"order": name, "replicas": replicas, **extra, **mixing(order, shard_of, classes)}
        row["seconds"] = round(time.perf_counter() - start, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)

    measure("random permutation", None, lambda: random_order(num_samples, global_batch))
    for replicas in replica_counts:
        readers = replicas * WORKERS
        host_buffer_bytes = buffer * WORKERS * SAMPLE_BYTES  # each host: 4 workers' buffers
        common = {"readers": readers, "host_buffer_mb": round(host_buffer_bytes / 1e6)}
        measure(
            "per-reader",
            replicas,
            lambda r=replicas: per_reader_order(shards, r, buffer, global_batch),
            **common,
        )
        auto = choose_partition("auto", replicas, global_batch // replicas, WORKERS, num_shards, buffer)
        assert auto is not None
        for per_reader in streams_per_reader:
            setting = readers * per_reader
            batch = global_batch // replicas
            partition = choose_partition(setting, replicas, batch, WORKERS, num_shards, buffer)
            assert partition is not None
            measure(
                f"canonical, {per_reader} a reader" + (" (auto)" if partition == auto else ""),
                replicas,
                lambda p=partition: canonical_order(shards, p, global_batch),
                streams=partition.streams,
                stream_buffer=partition.stream_buffer,
                **common,
            )
        measure(
            "webdataset",
            replicas,
            lambda r=replicas: webdataset_order(shards, r, buffer, global_batch),
            **common,
        )
    return {
        "layout": {"shards": num_shards, "samples": num_samples, "classes": CLASSES, "order": "by class"},
        "global_batch": global_batch,
        "workers_per_replica": WORKERS,
        "shuffle_buffer": buffer,
        "rows": rows,
    }


def markdown(results: dict) -> str:
    lines = [
        f"Global batch {results['global_batch']}, {results['workers_per_replica']} workers a replica, "
        f"data.shuffle_buffer={results['shuffle_buffer']}; {results['layout']['shards']} shards written "
        f"in class order ({results['layout']['samples']} samples, {results['layout']['classes']} classes).",
        "",
        "| order | replicas x workers | streams (buffer each) | shards / batch | classes / batch (min) "
        "| distance from the epoch's class mix | correlation of batches 1-8 steps apart (most) "
        "| buffers / host |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        shape = "-" if row["replicas"] is None else f"{row['replicas']} x {results['workers_per_replica']}"
        streams = f"{row['streams']} ({row['stream_buffer']})" if "streams" in row else "-"
        memory = f"{row['host_buffer_mb']} MB" if "host_buffer_mb" in row else "-"
        lines.append(
            f"| {row['order']} | {shape} | {streams} | {row['shards_per_batch']:.0f} | "
            f"{row['classes_per_batch']:.0f} ({row['min_classes_per_batch']}) | "
            f"{row['class_distance']:.3f} | {row['nearby_correlation']:.3f} (lag {row['nearby_lag']}) | "
            f"{memory} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.shuffle", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="128 shards of the same size (a few seconds)")
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 8, 32, 64])
    parser.add_argument("--shuffle-buffer", type=int, default=2000)
    parser.add_argument("--streams-per-reader", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    shards, samples = (128, 128 * 1251) if args.quick else (1024, IMAGENET_SAMPLES)
    results = run(shards, samples, args.replicas, args.shuffle_buffer, args.streams_per_reader)
    out = args.out or (RESULTS / "quick" if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
