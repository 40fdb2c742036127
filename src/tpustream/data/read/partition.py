"""A run's canonical partition chosen when it starts (data.streams), and described in words.

The partition itself, and how streams map to replicas and workers, is
``plan.CanonicalPartition``; this module picks its stream count: enough
streams that every replica's workers read equal shares of each batch (every
batch waits for the busiest worker), few enough that each stream can start
on a shard of its own.
"""

from __future__ import annotations

from tpustream.data.read.layout import CanonicalPartition

# data.streams=auto: each replica's streams, at most this many per worker reading them at start.
AUTO_STREAMS_PER_READER = 4


# data.streams=auto: how even the workers' shares of a batch must be (see worker_balance),
# and how many streams a worker may read to get there.
AUTO_BALANCE = 0.9
AUTO_MAX_STREAMS_PER_READER = 16


def worker_balance(streams: int, workers: int) -> float:
    """The mean share of a replica's streams over the largest (1.0: every worker reads as many).

    Every batch waits for the worker with the most streams (streams_of
    gives the first ones one more), so this is the share of the workers'
    time that does not wait: 16 streams over 15 workers, 0.53 (one reads
    two, and each batch takes as long as 32 samples of one worker); 128
    streams over 15 workers, 0.95 (9 against a mean of 8.5).
    """
    workers = max(workers, 1)
    return (streams / workers) / -(-streams // workers)


def balanced_streams(divisors: list[int], workers: int, fallback: int) -> int:
    """The fewest of a replica's possible stream counts that share out to AUTO_BALANCE, else the most even."""
    workers = max(workers, 1)
    candidates = [d for d in divisors if workers <= d <= AUTO_MAX_STREAMS_PER_READER * workers]
    even = [d for d in candidates if worker_balance(d, workers) >= AUTO_BALANCE]
    if even:
        return min(even)
    return max([fallback, *candidates], key=lambda d: (worker_balance(d, workers), -d))


def choose_partition(
    setting: str | int,
    world_size: int,
    replica_batch: int,
    workers: int,
    num_shards: int,
    shuffle_buffer: int,
) -> CanonicalPartition | None:
    """The canonical partition of a run that starts now (data.streams; 0 = the per-reader plan: None).

    auto: each replica's streams are a divisor of its batch, at least one per
    worker and at most AUTO_STREAMS_PER_READER per worker, as many as that
    allows while every stream can start on a shard of its own (more streams:
    more shapes to continue on; more than shards: readers share shards),
    unless that leaves the workers' shares uneven (``worker_balance`` under
    AUTO_BALANCE): then the fewest streams, up to AUTO_MAX_STREAMS_PER_READER
    a worker, that even them out (``balanced_streams``). Each
    stream's buffer is the reader's data.shuffle_buffer over its streams, so a
    reader holds what it held without a partition. None when no divisor fits
    (batch_size 1 per replica with several workers).
    """
    workers = max(workers, 1)
    if setting == 0:
        return None
    if setting == "auto":
        divisors = [d for d in range(1, replica_batch + 1) if replica_batch % d == 0]
        fitting = [d for d in divisors if workers <= d <= AUTO_STREAMS_PER_READER * workers]
        if not fitting:
            return None
        within = [d for d in fitting if world_size * d <= num_shards]
        per_replica = max(within) if within else min(fitting)
        if worker_balance(per_replica, workers) < AUTO_BALANCE:
            per_replica = balanced_streams(divisors, workers, per_replica)
        streams = world_size * per_replica
    else:
        streams = int(setting)
    per_reader = max(1, streams // (world_size * workers))
    partition = CanonicalPartition(streams, -(-shuffle_buffer // per_reader) if shuffle_buffer > 1 else 0)
    partition.check_shape(world_size, replica_batch, workers)
    return partition


def describe_partition(partition: CanonicalPartition | None, global_batch: int) -> str:
    """The training order in words, and the shapes a stopped run can continue on."""
    if partition is None:
        return (
            "per replica and worker (data.streams=0, or a run begun without canonical streams): "
            "stopped mid-epoch, it continues there only on the same replicas, batch and workers"
        )
    replicas = partition.allowed_replicas()
    return (
        f"{partition.streams} canonical streams of {partition.stream_batch(global_batch)} sample(s) a step "
        f"(shuffle buffer {partition.stream_buffer} each): stopped mid-epoch, it continues at the same "
        f"step on {', '.join(map(str, replicas))} replica(s) with a global batch of {global_batch}, "
        f"each with up to {partition.streams}/replicas workers"
    )


def describe_balance(partition: CanonicalPartition | None, world_size: int, workers: int) -> str | None:
    """A start-up warning when the workers read uneven shares of the replica's streams, else None."""
    if partition is None:
        return None
    per_replica, workers = partition.per_replica(world_size), max(workers, 1)
    balance = worker_balance(per_replica, workers)
    if balance >= AUTO_BALANCE:
        return None
    even = [w for w in range(1, per_replica + 1) if per_replica % w == 0 and w <= workers]
    return (
        f"data.num_workers={workers} share {per_replica} canonical stream(s) unevenly: the busiest reads "
        f"{-(-per_replica // workers)}, so every batch waits for it and the workers are busy "
        f"{100 * balance:.0f}% of the time at most; {max(even)} worker(s) share them evenly "
        "(a run started with data.streams=auto chooses streams that share out)"
    )


def pieces_hold_whole_groups(
    partition: CanonicalPartition, world_size: int, workers: int, global_batch: int, group: int
) -> bool:
    """Whether each worker's piece of a batch holds whole augmentation groups (of `group` samples).

    A group's pairs and batch-level draws belong to its first sample, so a
    worker can draw for its piece only when no group straddles two pieces;
    otherwise the replica's process draws for the joined batch.
    """
    chunk = partition.stream_batch(global_batch)
    streams = [partition.streams_of(0, world_size, worker, workers) for worker in range(workers)]
    return all(len(mine) * chunk % group == 0 for mine in streams)
